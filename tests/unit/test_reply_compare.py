"""The promotion gate's judge-compared probe items (issue #26: "the judge comparing candidate and
promoted replies"): a probe-file line with ``"compare": true`` has no rule; the judge says which of the
candidate's and a reference version's replies is better, shown in alternating order, and the gate
pairs that preference (0 / 0.5 / 1) with the reference's 0.5."""

from __future__ import annotations

import asyncio
import json

import pytest

from clawray.actors.judge import JudgeResult, JudgeWorker
from clawray.config import ConfigError, DeployConfig, load_config, section
from clawray.gate import PromotionGate
from clawray.reply_compare import ReplyComparisons

ARITH = {"messages": [{"role": "user", "content": "2+2? Just the number."}], "answer": "4"}
HAIKU = {"messages": [{"role": "user", "content": "A haiku about rain, please."}], "compare": True}


def test_preferences_alternate_the_order_and_read_the_verdict_from_the_candidates_side():
    msgs = [[{"role": "user", "content": f"q{j}"}] for j in range(3)]
    comp = ReplyComparisons([1, 3, 4], msgs)
    comp.keep(0, ["r0", "r1", "r2"], set())
    seen = []

    def compare(requests):  # A is better on items 0 and 1, B on item 2
        seen.extend((m[0]["content"], a["content"], b["content"], key) for m, a, b, key in requests)
        return [1, 1, -1]

    prefs = comp.preferences(1, ["c0", "c1", "c2"], [0, 0], compare)
    # v1: the candidate is reply A on items where (j + 1) is even: item 1 only
    assert seen == [("q0", "r0", "c0", "v1/v0/0"), ("q1", "c1", "r1", "v1/v0/1"), ("q2", "r2", "c2", "v1/v0/2")]
    # item 0: A (the reference) better -> 0; item 1: A (the candidate) -> 1; item 2: B (the candidate) -> 1
    assert prefs == {0: [0.0, 1.0, 1.0]}
    assert comp.paired([1.0, 0.5, 0.0, 0.5, 0.5], prefs[0]) == [1.0, 0.0, 0.0, 1.0, 1.0]
    comp.keep(2, ["x", "y", "z"], {0})
    comp.keep(3, ["x", "y", "z"], {3})  # neither 0 nor 2 is needed any more
    assert sorted(comp.replies) == [3]
    with pytest.raises(ValueError):
        comp.paired([0.5] * 5, [1.0])
    with pytest.raises(KeyError):
        comp.preferences(4, ["a", "b", "c"], [2], compare)


def test_the_judge_compares_two_replies_by_majority_and_the_feedback_judge_refuses():
    worker = JudgeWorker({"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "j", "m": 3})
    answers, prompts = iter(["B reads better. \\boxed{-1}", "no verdict", "\\boxed{-1}"]), []

    async def ask_once(messages, seed_key):
        prompts.append((messages, seed_key))
        return next(answers)

    worker._ask_once = ask_once
    convo = [{"role": "user", "content": "A haiku about rain, please."}]
    result = asyncio.run(worker.compare(convo, {"content": "RAIN!!!"}, {"content": "soft rain falls"}, "v1/v0/0"))
    assert (result.score, result.votes, result.counts["invalid"]) == (-1, [-1, None, -1], 1)
    user = prompts[0][0][1]["content"]
    assert "[user] A haiku about rain, please." in user and "## Reply A\nRAIN!!!" in user
    assert "## Reply B\nsoft rain falls" in user and prompts[0][1] == "compare/v1/v0/0/0/0"
    stats = worker.stats
    assert (stats["compares"], stats["compare_votes"], stats["compare_invalid_votes"]) == (1, 3, 1)
    with pytest.raises(ValueError, match="feedback judge cannot compare"):
        asyncio.run(JudgeWorker({"backend": "feedback"}).compare(convo, {}, {}))


class _Call:
    def __init__(self, fn):
        self.remote = fn


class ScriptedJudge:
    """A judge actor's ``compare`` whose verdict prefers the reply holding ``better``."""

    def __init__(self, better: str):
        self.calls = []

        def compare(messages, a, b, key):
            self.calls.append((a["content"], b["content"], key))
            score = 1 if better in a["content"] else -1 if better in b["content"] else 0
            return JudgeResult(score=score, votes=[score])

        self.compare = _Call(compare)


def test_the_gate_pairs_the_judges_preference_with_the_promoted_versions_replies(tmp_path, tiny_model, monkeypatch):
    import ray
    from transformers import AutoTokenizer

    path = tmp_path / "probe.jsonl"
    path.write_text(json.dumps(ARITH) + "\n" + json.dumps(HAIKU) + "\n")
    cfg = load_config(["conf/rl.yaml"], ["deploy.gate=true", "env.enabled=false", f"deploy.probe_file={path}"])
    with pytest.raises(ConfigError, match="has compare items, which a judge compares: judge.backend=feedback cannot"):
        PromotionGate(cfg.deploy, cfg.env, str(tmp_path), judge_backend="feedback")
    # 4 probe items vouch for little: with the adjusted Wald bound a 0.3 margin lets the better candidate
    # below (2 of 4 better: lower -0.252) be shown non-inferior, the worse one (lower -0.585) not
    deploy = section(DeployConfig, {**cfg.deploy, "probe_n": 2, "rule": "noninferior", "margin": 0.3})
    gate = PromotionGate(deploy, cfg.env, str(tmp_path), judge_backend="engine")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    eos = tok.convert_tokens_to_ids(tok.eos_token)

    def serving(haiku: str):
        def generate(requests):
            texts = ["4" if "2+2" in tok.decode(r.prompt_ids) else haiku for r in requests]
            return [{"response_ids": tok.encode(t, add_special_tokens=False) + [eos]} for t in texts]

        return generate

    gate.baseline(0, tiny_model, serving("soft rain falls"))
    haiku_at = [i for i, t in enumerate(gate.last_texts) if t == "soft rain falls"]
    assert len(haiku_at) == 2 and gate.comparisons.items == haiku_at
    assert [gate.promoted_scores[i] for i in haiku_at] == [0.5, 0.5]  # a reference ties with itself
    assert gate.comparisons.replies == {0: ["soft rain falls"] * 2}
    monkeypatch.setattr(ray, "get", lambda refs: refs)  # the scripted judge answers at once

    # a candidate whose haiku the judge finds worse on both items: 2 worse, 0 better of 4 pairs
    scores, seconds = gate.probe(tiny_model, serving("RAIN!!!"))
    judge = ScriptedJudge("falls")
    prefs = gate.compare_replies(1, [judge])
    assert prefs == {0: [0.0, 0.0]}
    assert [c[2] for c in judge.calls] == ["v1/v0/0", "v1/v0/1"] and judge.calls[0][:2] == (
        "soft rain falls",
        "RAIN!!!",
    )
    d = gate.judge(1, scores, seconds, prefs=prefs)
    assert (d.worse, d.better, d.delta, d.p_worse) == (2, 0, pytest.approx(-0.25), 0.25)
    assert not d.promote and not d.backoff and "unproven" in d.reason and gate.promoted == 0
    rec = json.loads((tmp_path / "versions.jsonl").read_text().splitlines()[-1])
    assert rec["compare_prefs"] == {"0": [0.0, 0.0]} and rec["compare_replies"] == ["RAIN!!!", "RAIN!!!"]

    # a candidate the judge prefers becomes the promoted version, and its replies the reference
    scores, seconds = gate.probe(tiny_model, serving("rain falls on still ponds"))
    prefs = gate.compare_replies(1, [ScriptedJudge("ponds")])
    assert prefs == {0: [1.0, 1.0]}
    d = gate.judge(1, scores, seconds, prefs=prefs)
    assert d.promote and (d.worse, d.better) == (0, 2) and gate.promoted == 1
    # the stored scores hold 0.5 on compare items, so the best (by stored mean) stays the baseline, and
    # its replies stay a reference: the next candidate is compared with v0's and v1's
    assert gate.best == 0 and gate.comparisons.replies == {
        0: ["soft rain falls"] * 2,
        1: ["rain falls on still ponds"] * 2,
    }
    gate.probe(tiny_model, serving("grey rain"))
    judge = ScriptedJudge("ponds")
    assert gate.compare_replies(2, [judge]) == {1: [0.0, 0.0], 0: [0.5, 0.5]}
    assert [c[2] for c in judge.calls] == ["v2/v1/0", "v2/v1/1", "v2/v0/0", "v2/v0/1"]

    # a resume at v1 restores the references of v1 and of the best, v0, before any probe
    again = PromotionGate(deploy, cfg.env, str(tmp_path), judge_backend="engine")
    assert again.resume(1) and (again.promoted, again.best) == (1, 0)
    again._build(tiny_model)
    assert again.comparisons.items == haiku_at
    assert again.comparisons.replies == {0: ["soft rain falls"] * 2, 1: ["rain falls on still ponds"] * 2}

"""Behaviour-level diversity (clawray.algos.behaviour, clawray.monitor): signatures, entropy and
self-similarity by hand, the probe's requests and measurement, the behaviour floor's controller."""

import math

import pytest

from clawray.algos.behaviour import behaviour_stats, entropy, jaccard, ngrams, self_similarity, signature
from clawray.algos.invariants import EntropyController


def text(t):
    return {"role": "assistant", "content": t}


def tool(name, args):
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": name, "arguments": args}}],
    }


def test_signatures():
    # the first sentence, normalised: digits -> 0, punctuation gone, case folded
    assert signature(text("The answer is 7. Because 3+4.")) == "text:the answer is 0"
    assert signature(text("the ANSWER is 12!")) == signature(text("The answer is 7."))
    assert signature(text("Let me think: 3 + 4 = 7")) == "text:let me think 0 0 0"
    # a tool call: which tool, which argument keys (not their values)
    assert signature(tool("calc", '{"expression": "1+2"}')) == "tool:calc(expression)"
    assert signature(tool("calc", '{"expression": "9"}')) == signature(tool("calc", '{"expression": "1+2"}'))
    assert signature(tool("calc", "{not json")) == "tool:calc(?)"
    assert signature(tool("ls", "")) == signature(tool("ls", "{}")) == "tool:ls()"  # no arguments: one behaviour


def test_a_numbered_or_decimal_opening_is_not_a_sentence_end():
    """Four different replies opening with "1." or a decimal read as one behaviour ("text:0"): the
    behaviour floor saw a collapse and raised the entropy bonus."""
    replies = [
        text("1. Open the config file and set the port."),
        text("1. Run the test suite first."),
        text("3.5 GB is too large; split the archive."),
        text("- 2.0 is the new version, so upgrade.\nThen restart."),
    ]
    assert [signature(m) for m in replies] == [
        "text:open the config file and set the port",
        "text:run the test suite first",
        "text:0 0 gb is too large split the archive",
        "text:0 0 is the new version so upgrade",
    ]
    stats = behaviour_stats([replies])
    assert stats["inv/behaviour_distinct"] == 1.0 and stats["inv/behaviour_entropy"] == pytest.approx(math.log(4))


def test_entropy_and_overlap_hand_computed():
    assert entropy(["a", "a", "b", "b"]) == pytest.approx(math.log(2))
    assert entropy(["a"] * 4) == 0.0
    assert ngrams("a b c", 2) == {("a", "b"), ("b", "c")}
    assert jaccard({1, 2}, {2, 3}) == pytest.approx(1 / 3)
    # bigrams: {ab, bc} vs {ab, bd}: 1/3; {ab, bc} vs {xy}: 0; {ab, bd} vs {xy}: 0 -> mean 1/9
    assert self_similarity(["a b c", "a b d", "x y"], 2) == pytest.approx(1 / 9)


def test_behaviour_stats_of_a_collapsed_and_a_diverse_prompt():
    collapsed = [text("The answer is 7."), text("The answer is 8."), text("the answer is 7"), text("The answer is 9")]
    diverse = [
        text("The answer is 7."),
        text("Let me add: 3 + 4."),
        tool("calc", '{"expression": "3+4"}'),
        text("Seven."),
    ]
    stats = behaviour_stats([collapsed, diverse], n=2)
    # distinct: (1/4 + 4/4) / 2; entropy: (0 + ln 4) / 2
    assert stats["inv/behaviour_distinct"] == pytest.approx(0.625)
    assert stats["inv/behaviour_entropy"] == pytest.approx(math.log(4) / 2)
    # collapsed: bigrams of "The answer is 7." etc. -> pairs share {the answer, answer is} of 3 in the union
    # except the pair ("the answer is 7", "The answer is 7.") whose tokens differ only by the final "."
    assert 0 < stats["inv/self_similarity"] < 1
    with pytest.raises(ValueError):
        behaviour_stats([[text("a")]])


def test_self_similarity_of_identical_replies_is_one():
    stats = behaviour_stats([[text("same words here")] * 3])
    assert stats == {
        "inv/behaviour_distinct": pytest.approx(1 / 3),
        "inv/behaviour_entropy": 0.0,
        "inv/self_similarity": 1.0,
    }


def test_behaviour_floor_uses_the_entropy_controller():
    ctl = EntropyController(0.0, floor=1.0, lr=0.1, max_coef=0.05)
    assert ctl.update(0.5) == pytest.approx(0.05)  # 0 + 0.1 * (1 - 0.5) = 0.05, at the cap
    assert ctl.update(1.5) == pytest.approx(0.0)  # above the floor: it comes down again


def test_probe_requests_and_measure(tiny_model):
    from transformers import AutoTokenizer

    from clawray.monitor import BehaviourProbe

    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [[{"role": "user", "content": "Add 3 and 4."}], [{"role": "user", "content": "Add 1 and 1."}]]
    probe = BehaviourProbe(tok, prompts, k=2, max_tokens=8, seed=3)
    reqs = probe.requests()
    assert len(reqs) == 4 and {r.temperature for r in reqs} == {1.0}
    assert [r.seed for r in reqs] == [3 * 1_000_003 + i for i in range(4)]
    assert reqs[0].prompt_ids == reqs[1].prompt_ids != reqs[2].prompt_ids
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    replies = ["The answer is 7.", "The answer is 8.", "Two.", "It is 2."]
    outs = [{"response_ids": tok.encode(t, add_special_tokens=False) + [eos]} for t in replies]
    stats = probe.run(lambda rs: outs[: len(rs)])
    assert stats["inv/behaviour_distinct"] == pytest.approx((1 / 2 + 2 / 2) / 2)
    assert stats["inv/behaviour_entropy"] == pytest.approx(math.log(2) / 2)


def test_behaviour_monitor_probes_on_its_steps_and_feeds_the_controller(capsys):
    from types import SimpleNamespace

    from clawray.monitor import BehaviourMonitor

    class FakeProbe:
        def __init__(self, entropy):
            self.calls, self.entropy = 0, entropy

        def run(self, generate):
            self.calls += 1
            if self.entropy is None:
                raise RuntimeError("engine gone")
            return {"inv/behaviour_entropy": self.entropy}

    ctl = EntropyController(coef=0.0, floor=1.0, lr=0.5, max_coef=1.0)
    mon = BehaviourMonitor(SimpleNamespace(every_steps=2), None, ctl)
    mon._probe = FakeProbe(0.2)
    assert mon.maybe_probe(1, "unused", None) == {} and mon._probe.calls == 0  # not its turn
    out = mon.maybe_probe(2, "unused", None)
    # coef <- 0 + 0.5 * (1.0 - 0.2) = 0.4
    assert out["inv/behaviour_entropy"] == 0.2 and out["inv/behaviour_coef"] == pytest.approx(0.4)
    assert ctl.coef == pytest.approx(0.4) and out["timing/monitor_s"] >= 0
    mon._probe = FakeProbe(None)  # a failing probe is printed, the run goes on, the controller stays
    assert mon.maybe_probe(4, "unused", None) == {} and ctl.coef == pytest.approx(0.4)
    assert "behaviour probe failed: RuntimeError: engine gone" in capsys.readouterr().out
    off = BehaviourMonitor(SimpleNamespace(every_steps=0), None, ctl)
    assert off.maybe_probe(0, "unused", None) == {}

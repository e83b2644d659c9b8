"""The algorithms with plain fakes for the judge and the teacher (no Ray): each turn's verdict."""

import asyncio
from collections import Counter

import pytest

from clawray.actors.judge import HintResult, JudgeResult
from clawray.algos.algorithm import REGISTRY, Algorithm, WorkerCalls, algorithm_class, make_algorithm
from clawray.config import OPDConfig
from clawray.types import Turn


def _turn():
    return Turn(
        session_id="s",
        turn_index=3,
        messages=[{"role": "user", "content": "q"}],
        response_message={"role": "assistant", "content": "r"},
        prompt_ids=[1, 2],
        response_ids=[7, 8, 9],
        rollout_logprobs=[-0.5, -0.25, -1.0],
        policy_version=2,
        finish_reason="stop",
    )


def _calls(score=1, votes=(1,), hint="Say just the number.", teacher=(-0.1, -0.2, -0.3), fail=None):
    async def judge(turn, next_state):
        if fail == "judge":
            raise RuntimeError("judge died")
        return JudgeResult(score, list(votes))

    async def hint_fn(turn, next_state, accept, min_chars):
        return HintResult(hint, [])

    async def teacher_logprobs(turn, h):
        if fail == "teacher":
            raise RuntimeError("teacher died")
        return list(teacher)

    async def teacher_topk(turn, h, k):
        return [[-0.1] * k] * 3, [[5] * k] * 3

    return WorkerCalls(judge=judge, hint=hint_fn, teacher_logprobs=teacher_logprobs, teacher_topk=teacher_topk)


def _score(algo, **kw):
    counts = Counter()
    verdict = asyncio.run(algo.verdict(_turn(), [{"role": "user", "content": "ok"}], _calls(**kw), counts))
    return verdict, counts


def test_binary_rl_verdicts():
    rl = make_algorithm("rl")
    v, counts = _score(rl, score=-1, votes=(-1, -1, 1))
    assert (v.sample.reward, v.sample.kind, v.sample.turn_index, v.drop, v.held) == (-1.0, "rl", 3, None, None)
    assert counts == {"judged": 1, "score/-1": 1}
    v, _ = _score(rl, score=0, votes=(0, 0, 1))
    assert v.sample is None and v.held == pytest.approx(1 / 3) and v.record_note == "held"
    v, counts = _score(rl, score=0, votes=(None, None))
    assert (v.sample, v.held, v.drop) == (None, None, "unscored") and counts["judged"] == 1
    v, counts = _score(rl, fail="judge")
    assert v.drop == "judge_error" and v.record_note == "judge error: RuntimeError('judge died')" and not counts
    assert rl.promote(_turn(), 0.5).reward == 0.5


def test_unanimous_rl_trains_only_undisputed_scores():
    algo = make_algorithm("rl_unanimous")
    cases = {
        (1, (1, 1, 1)): (1.0, None),
        (-1, (-1, -1, -1)): (-1.0, None),
        (1, (1, None, 1)): (1.0, None),
        (1, (1, 1, -1)): (None, 1 / 3),
        (-1, (-1, -1, 0)): (None, -2 / 3),
        (0, (0, 0, 1)): (None, 1 / 3),
    }
    for (score, votes), (reward, held) in cases.items():
        v, counts = _score(algo, score=score, votes=votes)
        assert (v.sample.reward if v.sample else None, v.held) == (reward, pytest.approx(held)), votes
        assert counts == {"judged": 1, f"score/{score}": 1}  # the judge's own majority is what is counted
    assert v.record_note == "held" and algorithm_class("rl_unanimous").needs_teacher is False
    v, _ = _score(algo, score=0, votes=(None, None))
    assert v.drop == "unscored"


def test_opd_and_combine_verdicts():
    opd, combine = (
        make_algorithm("opd", OPDConfig(topk=2)),
        make_algorithm("combine", OPDConfig()),
    )  # opd.loss advantage: no top-k
    v, counts = _score(opd)
    assert (v.sample.kind, v.sample.reward, v.sample.teacher_logprobs) == ("opd", None, [-0.1, -0.2, -0.3])
    assert counts == {"judged": 1, "hints_accepted": 1, "dispatch/hint": 1}
    v, _ = _score(opd, hint=None)
    assert v.drop == "no_hint" and v.extra == {"hint": None}
    v, counts = _score(combine, score=-1, fail="teacher")  # the reward term alone, no teacher term
    assert (v.sample.reward, v.sample.teacher_logprobs, v.sample.info["hint"]) == (-1.0, None, None)
    assert counts["teacher_errors"] == 1 and v.extra["teacher_error"] == "RuntimeError('teacher died')"
    v, _ = _score(combine, score=0, hint=None)
    assert v.drop == "no_signal"
    v, _ = _score(make_algorithm("opd", OPDConfig(loss="topk", topk=2)))
    assert v.sample.teacher_topk_ids == [[5, 5]] * 3 and v.sample.teacher_logprobs is None


def test_opd_topk_is_a_variant_that_only_touches_algos():
    """Issue #25: an OPD variant with another loss term is one registered subclass. ``opd_topk``
    asks the teacher for its top-k whatever ``opd.loss`` says, and the config check reads its term."""
    algo = make_algorithm("opd_topk", OPDConfig(loss="advantage", topk=2))
    assert (algo.topk, algo.term(), algorithm_class("opd").term("topk"), algorithm_class("opd").term()) == (
        2,
        "topk_kl",
        "topk_kl",
        "ppo",
    )
    v, counts = _score(algo)
    assert (v.sample.kind, v.sample.reward, v.sample.teacher_logprobs) == ("opd_topk", None, None)
    assert v.sample.teacher_topk_ids == [[5, 5]] * 3 and counts["hints_accepted"] == 1
    assert [algorithm_class(n).with_reward for n in ("rl", "opd", "opd_topk", "combine")] == [True, False, False, True]
    from clawray.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"opd\.topk=21 exceeds 20.*trainer\.algo=opd_topk"):
        load_config([], ["trainer.algo=opd_topk", "opd.topk=21", "opd.teacher_backend=vllm"])


def test_registry_declares_what_a_run_needs():
    assert sorted(REGISTRY) == ["combine", "opd", "opd_topk", "rl", "rl_unanimous"]
    assert [algorithm_class(n).needs_teacher for n in ("rl", "opd", "combine")] == [False, True, True]
    assert make_algorithm("rl").loss_weights(0.3, 2.0) == (1.0, 2.0)
    assert make_algorithm("combine", OPDConfig()).loss_weights(0.3, 2.0) == (0.3, 2.0)
    with pytest.raises(ValueError, match="'opd' needs a teacher: pass its opd config section"):
        make_algorithm("opd")
    with pytest.raises(ValueError, match="unknown algorithm 'ppo'"):
        make_algorithm("ppo")
    assert issubclass(REGISTRY["combine"], Algorithm)


def test_accepted_hints_are_kept_longest_first_each_once():
    from clawray.actors.judge import accept_hint

    votes = [(1, "Use digits only."), (1, "Reply with the number alone."), (-1, None), (1, "Use digits only.")]
    votes += [(1, "Say the sum only"), (None, None), (1, "short")]
    r = accept_hint(votes, "any", min_chars=10)
    assert r.hints == ["Reply with the number alone.", "Use digits only.", "Say the sum only"]  # 28, 16, 16
    assert r.hint == "Reply with the number alone."
    assert accept_hint([(1, "Reply with the number alone."), (-1, None), (-1, None)], "majority").hints == []


def test_several_hints_train_the_mixture_of_their_teachers():
    """opd.max_hints = K > 1: the teacher scores under each of the first K accepted hints and the
    term is log((1/K) sum_k exp(l_k)) per token (mix_teachers), hand-computed here."""
    import math

    from clawray.algos.algorithm import mix_teachers

    by_hint = {"Reply with the number alone.": [-0.1, -2.0, -3.0], "Use digits only.": [-0.7, -0.2, -3.0]}
    by_hint["Say the sum only"] = [-5.0, -5.0, -5.0]

    def calls(fail_hint=None):
        async def hint_fn(turn, next_state, accept, min_chars):
            hints = list(by_hint)
            return HintResult(hints[0], [], hints=hints)

        async def teacher_logprobs(turn, h):
            if h == fail_hint:
                raise RuntimeError("teacher died")
            return by_hint[h]

        return WorkerCalls(hint=hint_fn, teacher_logprobs=teacher_logprobs)

    def verdict(algo, **kw):
        counts = Counter()
        return asyncio.run(algo.verdict(_turn(), [{"role": "user", "content": "no"}], calls(**kw), counts)), counts

    two = make_algorithm("opd", OPDConfig(max_hints=2))
    v, counts = verdict(two)
    want = [math.log((math.exp(-0.1) + math.exp(-0.7)) / 2), math.log((math.exp(-2.0) + math.exp(-0.2)) / 2), -3.0]
    assert v.sample.teacher_logprobs == pytest.approx(want, abs=1e-12)
    assert [round(x, 4) for x in want] == [-0.3557, -0.7402, -3.0]  # log(0.70071), log(0.47703)
    assert v.sample.info == {"hint": "Reply with the number alone.", "hints": list(by_hint)[:2]}
    assert v.extra == {"hint": "Reply with the number alone.", "hints": list(by_hint)[:2]}
    assert counts == {"judged": 1, "hints_accepted": 1, "dispatch/hint": 1, "hint_mixtures": 1}
    # a failed call leaves its hint out: the other one alone is the teacher
    v, counts = verdict(two, fail_hint="Reply with the number alone.")
    assert v.sample.teacher_logprobs == [-0.7, -0.2, -3.0] and v.sample.info == {"hint": "Use digits only."}
    assert counts["teacher_errors"] == 1 and "hint_mixtures" not in counts
    # K = 1 (the default) is the longest hint alone, as before
    v, _ = verdict(make_algorithm("opd", OPDConfig()))
    assert v.sample.teacher_logprobs == [-0.1, -2.0, -3.0] and "hints" not in v.sample.info
    assert mix_teachers([[-1.0, -2.0]]) == [-1.0, -2.0]
    assert mix_teachers([[-1.0]] * 3) == pytest.approx([-1.0])  # K equal teachers: that teacher
    with pytest.raises(ValueError, match=r"lengths \[2, 1\]"):
        mix_teachers([[-1.0, -2.0], [-1.0]])


def test_several_hints_need_the_advantage_term():
    from clawray.config import ConfigError, load_config

    assert (
        load_config(
            [],
            [
                "trainer.algo=opd",
                "judge.backend=openai",
                "judge.base_url=http://j/v1",
                "judge.model=j",
                "judge.m=3",
                "opd.max_hints=4",
            ],
        ).opd.max_hints
        == 4
    )
    with pytest.raises(ConfigError, match=r"opd.max_hints=2 mixes .*trainer.algo=opd_topk"):
        load_config([], ["trainer.algo=opd_topk", "opd.max_hints=2"])
    with pytest.raises(ConfigError, match=r"opd.max_hints=3 .*opd.loss=topk"):
        load_config([], ["trainer.algo=combine", "opd.loss=topk", "opd.max_hints=3"])
    assert make_algorithm("opd", OPDConfig(loss="topk", max_hints=3)).max_hints == 1

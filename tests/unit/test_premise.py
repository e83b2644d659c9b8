"""OPD's premise check (clawray.premise): the probe on fake engine/teacher callables with the real
environment, tokenizer and feedback-judge hint rule; the sign-test verdict by hand."""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from clawray.actors.judge import accept_hint, feedback_hint
from clawray.envs import make_env
from clawray.envs.base import Environment, Problem
from clawray.premise import PremiseCheck, PremiseItem, PremiseResult, premise_action, verdict


def test_verdict_is_the_exact_one_sided_sign_test():
    # 14 worse, 2 better: P(X >= 14 | 16, 1/2) = (C(16,14) + C(16,15) + C(16,16)) / 2**16 = 137 / 65536
    label, p_helps, p_hurts = verdict([-0.5] * 14 + [0.25] * 2)
    assert label == "anti-informative"
    assert p_hurts == pytest.approx(137 / 65536)
    assert p_helps == pytest.approx(sum(math.comb(16, k) for k in range(2, 17)) / 2**16)
    # 5 of 5 better: p = 1/32 < 0.05; 4 of 4: p = 1/16, not significant
    assert verdict([0.1] * 5)[0] == "informative" and verdict([0.1] * 5)[1] == pytest.approx(1 / 32)
    assert verdict([0.1] * 4, min_items=4)[0] == "inconclusive"
    assert verdict([0.1] * 3, min_items=4)[0] == "unmeasured"
    assert verdict([0.0] * 6 + [-1.0] * 2)[0] == "inconclusive"  # ties are dropped: 2 of 2 worse, p = 1/4
    with pytest.raises(ValueError):
        verdict([0.1], alpha=0.0)


@pytest.mark.parametrize(
    "name, level",
    [("sums", 3), ("brief", 3), ("terse", 3), ("concise", 3), ("plain", 3), ("arith", 1), ("arith", 2), ("arith", 3)],
)
def test_every_preferred_reply_is_one_the_user_accepts(name, level):
    env = make_env(name, level)
    for task in env.prompts("eval", 0)[:20]:
        reply = env.preferred_reply(task)
        assert env.grade(task, reply)["solved"], (task, reply)
        assert env.feedback(task, reply)[1]


class Probe:
    """Fake policy and teacher over the real tokenizer. The policy answers task i with ``replies[i]``.
    The teacher's hinted prompt is the sampled prompt + a marker token; with it the teacher answers
    task i with just the number for the first ``follows[i]`` of its seeds (else wordily, as it always
    does without a hint), and gives every preferred-reply token log-prob ``plain + raise_by[i]``
    (``plain`` without a hint). ``can_sample=False``: an endpoint teacher."""

    MARK = 7

    def __init__(self, tokenizer, replies, raise_by, follows=None, plain=-2.0, can_sample=True):
        self.tok, self.replies, self.raise_by, self.plain = tokenizer, replies, raise_by, plain
        self.follows, self.can_sample = follows or [0] * len(replies), can_sample
        self.generated, self.hinted, self.scored, self.prompted, self.sampled = [], [], [], [], []
        self.eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)

    def ids(self, text):
        return self.tok.encode(text, add_special_tokens=False) + [self.eos]

    def task(self, prompt_ids):
        prompt = list(prompt_ids[:-1]) if prompt_ids[-1] == self.MARK else list(prompt_ids)
        return [list(r.prompt_ids) for r in self.generated].index(prompt)

    def generate(self, requests):
        self.generated = requests
        return [{"response_ids": self.ids(r)} for r in self.replies]

    def hints(self, turns, states):
        self.hinted = list(zip(turns, states))
        return [accept_hint([feedback_hint(s)], "any", 10).hint for s in states]

    def prompt_ids(self, turns, hints):
        self.prompted = list(zip(turns, hints))
        return [list(t.prompt_ids) + ([self.MARK] if h else []) for t, h in zip(turns, hints)]

    def logprobs(self, turns, hints):
        self.scored = list(zip(turns, hints))
        out = []
        for turn, hint in zip(turns, hints):
            shift = self.raise_by[self.task(turn.prompt_ids)] if hint else 0.0
            out.append([self.plain + shift] * len(turn.response_ids))
        return out

    def teacher_generate(self, requests):
        self.sampled = requests
        if not self.can_sample:
            return None
        out, seen = [], {}
        for r in requests:
            i, hinted = self.task(r.prompt_ids), r.prompt_ids[-1] == self.MARK
            j = seen[(i, hinted)] = seen.get((i, hinted), -1) + 1
            text = str(self.answers[i]) if hinted and j < self.follows[i] else f"I think it is {self.answers[i]}."
            out.append({"response_ids": self.ids(text)})
        return out

    def calls(self, check):
        """``PremiseCheck.run``'s arguments."""
        self.answers = [t.answer for t in check.sampler.tasks]
        probe = self

        class Teacher:
            def prompt_ids(self, turns, hints):
                return probe.prompt_ids(turns, hints)

            def logprobs(self, turns, hints):
                return probe.logprobs(turns, hints)

            def generate(self, requests):
                return probe.teacher_generate(requests)

        return self.generate, self.hints, Teacher()


def test_the_probe_samples_and_scores_the_teacher_with_and_without_the_users_hint(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    env = make_env("sums")
    check = PremiseCheck(env, tok, num_prompts=8, temperature=0.7, seed=3, max_tokens=16, follow_n=4)
    tasks = check.sampler.tasks
    # tasks 0 and 1 answered as wanted (no correction); 2..7 right but wordy, so corrected
    replies = [str(t.answer) for t in tasks[:2]] + [f"The sum is {t.answer}." for t in tasks[2:]]
    raise_by = [0.0, 0.0, 0.5, 1.0, 0.25, 0.5, 2.0, 0.75]
    follows = [0, 0, 4, 3, 2, 4, 1, 4]  # of 4 seeds, the hinted teacher answers with just the number
    probe = Probe(tok, replies, raise_by, follows)
    result = check.run(*probe.calls(check))

    assert len(probe.generated) == 8 and {r.temperature for r in probe.generated} == {0.7}
    assert (result.probed, result.solved, result.unhinted, len(result.items)) == (8, 2, 0, 6)
    correction = "The number is right, but I asked for the number only. Please redo it with just the number."
    assert [s[0]["content"] for _, s in probe.hinted] == [correction] * 6
    # follow: 6 turns x 4 seeds with the hint, then the same 24 without; the same seeds in both halves
    assert [h for _, h in probe.prompted] == [correction] * 6 + [""] * 6
    assert len(probe.sampled) == 48 and [r.seed for r in probe.sampled[:24]] == [r.seed for r in probe.sampled[24:]]
    assert len({r.seed for r in probe.sampled}) == 24 and {r.max_tokens for r in probe.sampled} == {16}
    assert [i.solved_hinted for i in result.items] == [1.0, 0.75, 0.5, 1.0, 0.25, 1.0]
    assert [i.solved_plain for i in result.items] == [0.0] * 6
    assert result.solved_hinted == pytest.approx(4.5 / 6) and result.solved_plain == 0.0
    # preferred reply: each hinted turn scored with the correction as hint, then with none
    assert [h for _, h in probe.scored] == [correction] * 6 + [""] * 6
    for (turn, _), task in zip(probe.scored, tasks[2:] + tasks[2:]):
        assert turn.response_ids == probe.ids(str(task.answer))
        assert turn.prompt_ids == probe.generated[tasks.index(task)].prompt_ids  # the prompt as sampled
    assert [i.delta for i in result.items] == pytest.approx(raise_by[2:])
    assert result.mean_delta == pytest.approx(5.0 / 6)
    assert result.items[0].question == tasks[2].question and result.items[0].preferred == str(tasks[2].answer)
    # the verdict reads follow: 6 of 6 better, p = 1/64
    assert (result.measure, result.verdict) == ("follow", "informative") and result.p_helps == pytest.approx(1 / 64)
    assert "accepted 75% of the time, without it 0% (better on 6, worse on 0 of 6" in result.line()
    assert result.metrics()["premise/solved_hinted"] == pytest.approx(0.75)


def test_a_hint_that_raises_the_answer_but_is_not_followed_is_not_informative(tiny_model):
    """SmolLM2's case: the correction spells out the answer and the teacher's log-prob of it rises,
    but with the hint it still does not reply as asked: the verdict reads the replies."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    check = PremiseCheck(make_env("sums"), tok, num_prompts=6, seed=1)
    replies = [f"The sum is {t.answer}." for t in check.sampler.tasks]
    result = check.run(*Probe(tok, replies, raise_by=[0.8] * 6, follows=[1, 0, 0, 1, 0, 0]).calls(check))
    assert result.mean_delta == pytest.approx(0.8)
    assert (result.verdict, result.p_helps) == ("inconclusive", pytest.approx(1 / 4))
    assert premise_action(result, "refuse", "t")[0] == "refuse"  # refuse: training needs the premise shown


def test_an_endpoint_teacher_is_judged_on_the_preferred_reply(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    check = PremiseCheck(make_env("sums"), tok, num_prompts=6, seed=1)
    replies = [f"Well, {t.answer - 1}." for t in check.sampler.tasks]  # wrong: "That's wrong. ..." hints
    result = check.run(*Probe(tok, replies, [-1.5] * 6, can_sample=False).calls(check))
    assert (result.measure, result.verdict) == ("preferred", "anti-informative")
    assert result.mean_delta == pytest.approx(-1.5) and result.p_hurts == pytest.approx(1 / 64)
    assert result.solved_hinted is None and "premise/solved_hinted" not in result.metrics()
    level, text = premise_action(result, "refuse", "the initial policy")
    assert level == "refuse" and "opd.premise_check=warn trains anyway" in text
    assert "preferred reply -1.50 nats/token with the hint" in text
    assert premise_action(result, "warn", "x")[0] == "warn"
    with pytest.raises(ValueError):
        premise_action(result, "none", "x")


def test_an_informative_or_unmeasured_probe_is_only_said():
    good = PremiseResult("informative", [PremiseItem("q", "r", "h", 0.0, 1.0)])
    assert premise_action(good, "refuse", "t")[0] == "info"
    assert premise_action(PremiseResult("unmeasured", reason="r"), "refuse", "t") == (
        "info",
        "OPD premise unmeasured: r [teacher: t]",
    )


class NoPreference(Environment):
    """Tasks "q<i>"; a reply "ok" is accepted; no preferred reply named."""

    name = "nopref"

    def all_tasks(self):
        return [Problem(f"q{i}", i) for i in range(50)]

    def grade(self, task, reply):
        return {"solved": reply.strip() == "ok"}

    def feedback(self, task, reply):
        return ("thanks", True) if reply.strip() == "ok" else ("No, that is wrong: just say ok.", False)


def test_an_environment_without_a_preferred_reply_is_judged_on_follow_alone(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    check = PremiseCheck(NoPreference(), tok, num_prompts=5, follow_n=2)
    probe = Probe(tok, ["no"] * 5, [0.0] * 5)
    probe.teacher_generate = lambda requests: [
        {"response_ids": probe.ids("ok" if r.prompt_ids[-1] == Probe.MARK else "no")} for r in requests
    ]
    result = check.run(*probe.calls(check))
    assert probe.scored == [] and result.mean_delta is None  # nothing to score
    assert (result.verdict, result.solved_hinted, result.solved_plain) == ("informative", 1.0, 0.0)
    assert "preferred reply" not in result.line()


def test_too_few_hinted_turns_are_unmeasured(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    check = PremiseCheck(make_env("sums"), tok, num_prompts=5, seed=2)
    replies = [str(t.answer) for t in check.sampler.tasks[:3]] + ["no idea", "no idea"]
    result = check.run(*Probe(tok, replies, [1.0] * 5, follows=[4] * 5).calls(check))
    assert (result.verdict, result.solved, len(result.items)) == ("unmeasured", 3, 2)
    assert result.reason == (
        "2 hinted probe turn(s) measured, fewer than 4 (5 prompts: 3 already solved, 0 without an accepted hint)"
    )


def test_the_teacher_is_named_without_an_endpoints_credentials():
    from clawray.premise import teacher_name

    assert teacher_name("frozen", "/m") == "the initial policy, /m"
    assert teacher_name("live", "/m") == "the current policy"
    assert teacher_name("https://user:secret@host/v1", "/m") == "an endpoint"
    assert teacher_name("/models/big", "/m") == "/models/big"

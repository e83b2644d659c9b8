"""Groups and DAPO dynamic sampling (clawray.algos.rejection, clawray.batching.fill_dynamic), GRPO over them."""

import pytest
import torch

from clawray import batching
from clawray import step_metrics
from clawray.algos.advantages import batch_advantages
from clawray.algos.invariants import DegenerateBatchGuard
from clawray.algos.rejection import group_keys, opening, zero_variance
from clawray.config import load_config
from clawray.resume import LoopState
from clawray.types import Sample, SampleMeta


def test_zero_variance_groups_hand_computed():
    assert zero_variance(["a", "a", "b", "b", "c"], [1, 1, 1, -1, 0.5]) == [0, 1, 4]
    # a sample without a reward (pure OPD) is never rejected and does not join its group
    assert zero_variance(["a", "a", "a"], [1, None, -1]) == []
    assert zero_variance(["a", "a"], [1, None]) == [0]


def test_group_keys_by_prompt_session_prefix_or_none():
    prompts, openings, turns = [[1, 2], [1, 2], [1, 3]], ["o1", "o1", "o1"], [1, 2, 2]
    assert group_keys("prompt", prompts, openings, turns) == [(1, 2), (1, 2), (1, 3)]
    assert group_keys("session_prefix", prompts, openings, turns) == [("o1", 1), ("o1", 2), ("o1", 2)]
    assert group_keys("none", prompts, openings, turns) == [0, 0, 0]
    with pytest.raises(ValueError, match="group_by"):
        group_keys("user", prompts, openings, turns)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert opening(msgs) == msgs[:2]


def test_grpo_over_session_prefix_groups():
    # turn 2 of two sessions with one opening: rewards 1, -1 -> +1, -1; the lone turn 1 -> 0
    keys = group_keys("session_prefix", [[1], [2], [3]], ["o", "o", "o"], [2, 2, 1])
    adv = batch_advantages([1.0, -1.0, 1.0], DegenerateBatchGuard("none"), "grpo", keys)
    assert adv.advantages == pytest.approx([1.0, -1.0, 0.0])


def _sample(prompt, reward):
    return Sample(
        tokens=[prompt, 9],
        prompt_len=1,
        loss_mask=[1],
        rollout_logprobs=[-0.1],
        reward=reward,
        policy_version=0,
        session_id=f"s{prompt}",
        turn_index=1,
    )


def _meta(prompt, reward):
    return SampleMeta.of(_sample(prompt, reward))


def _batch(metas, seqs=None):
    """A queue batch of ``metas``; ``seqs``: their journal sequence numbers (default 1, 2, ...)."""
    seqs = seqs or list(range(1, len(metas) + 1))
    return {
        "refs": [f"ref{q}" for q in seqs],
        "meta": metas,
        "versions": [0] * len(metas),
        "staleness": [1] * len(metas),
        "seqs": seqs,
    }


def _fill(monkeypatch, takes, **trainer):
    """``(fill(batch, next_version), the loop state, the sizes asked of the queue)``."""
    cfg = load_config(
        [],
        ["trainer.dynamic_sampling=true", "trainer.batch_size=4", "env.resample_n=4"]
        + [f"trainer.{k}={v}" for k, v in trainer.items()],
    )
    state = LoopState.from_config(cfg)
    calls = []

    def wait_batch(actors, version, batch_size, next_version, timeout, max_batch_size):
        calls.append(batch_size)
        if not takes:
            return None
        take = takes.pop(0)
        return (
            _batch(*take)
            if isinstance(take, tuple)
            else _batch(take, [100 + len(calls) * 10 + i for i in range(len(take))])
        )

    def no_fetch(refs):
        raise AssertionError(f"the driver fetched {refs}")  # dynamic sampling decides on metadata only

    monkeypatch.setattr(batching, "wait_batch", wait_batch)
    monkeypatch.setattr(batching.ray, "get", no_fetch)
    return (
        lambda batch, next_version: batching.fill_dynamic(cfg.trainer, None, state, batch, next_version),
        state,
        calls,
    )


def test_dynamic_sampling_refills_until_enough_samples_have_variance(monkeypatch):
    first = [_meta(1, 1.0), _meta(1, 1.0), _meta(2, 1.0), _meta(2, -1.0)]
    fill, state, calls = _fill(monkeypatch, [[_meta(3, 0.5), _meta(3, -0.5)]], dynamic_sampling_wait_s=30)
    batch, rejected = fill(_batch(first), 1)
    assert rejected == {0, 1} and len(batch["meta"]) == len(batch["refs"]) == 6 and calls == [1]  # one refill
    assert batch["seqs"] == [1, 2, 3, 4, 110, 111] and state.zero_variance_dropped == 2


def test_a_refill_from_a_restarted_queue_never_repeats_a_sample_of_the_batch(monkeypatch):
    """Ray restarted the queue while dynamic sampling refilled: the new queue replays the journal,
    the batch's own samples (seqs 3, 4) included. They were trained twice in one step (twice the
    weight, and a sample counted twice in the step's metrics)."""
    first = [_meta(1, 1.0), _meta(1, 1.0), _meta(2, 1.0), _meta(2, -1.0)]
    again = [_meta(2, 1.0), _meta(2, -1.0), _meta(3, 0.5), _meta(3, -0.5)]
    fill, state, calls = _fill(monkeypatch, [(again, [3, 4, 5, 6])], dynamic_sampling_wait_s=30)
    batch, rejected = fill(_batch(first), 1)
    assert batch["seqs"] == [1, 2, 3, 4, 5, 6] and batch["refs"] == ["ref1", "ref2", "ref3", "ref4", "ref5", "ref6"]
    assert [m.reward for m in batch["meta"]] == [1.0, 1.0, 1.0, -1.0, 0.5, -0.5]
    assert rejected == {0, 1} and calls == [1] and state.zero_variance_dropped == 2


def test_dynamic_sampling_stops_at_the_wait_limit(monkeypatch):
    first = [_meta(1, 1.0), _meta(2, -1.0), _meta(3, 1.0), _meta(3, -1.0)]
    fill, state, calls = _fill(monkeypatch, [], dynamic_sampling_wait_s=0)
    batch, rejected = fill(_batch(first), 1)
    assert rejected == {0, 1} and len(batch["meta"]) == 4 and calls == []  # no wait: trains the 2 it has
    assert state.zero_variance_dropped == 2


def test_credit_metrics_of_a_batch():
    a, b, c = _sample(1, 0.5), _sample(2, -1.0), _sample(3, None)
    a.info.update(outcome=1.0, shaping={"truncated": -0.5})
    b.info.update(outcome=-1.0)
    a, b, c = SampleMeta.of(a), SampleMeta.of(b), SampleMeta.of(c)
    assert (a.outcome, a.shaping, c.outcome, c.shaping) == (1.0, (("truncated", -0.5),), None, ())
    m = step_metrics.credit_metrics([a, b, c], {"credit/turns_waiting": 3, "credit/mean_session_turns": 2.5})
    assert m == {
        "credit/turns_waiting": 3.0,
        "credit/mean_session_turns": 2.5,
        "reward/outcome_mean": 0.0,
        "reward/shaping/truncated": -0.25,
    }
    assert torch.isnan(torch.tensor(step_metrics.credit_metrics([c], {})["reward/outcome_mean"]))


# ------------------------------------------------------------------------------------------ resample mode
class _ScriptedClient:
    """Stands in for the openai client of a SimUserPool: records each request (session id, messages,
    whether it closes the session), answers "no idea", and stops the pool at its ``stop_after``-th
    closed session."""

    def __init__(self, pool, stop_after):
        from types import SimpleNamespace

        self.requests, self.pool, self.stop_after, self.closed = [], pool, stop_after, 0
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, model, messages, max_tokens, temperature, extra_headers, **tools):
        from types import SimpleNamespace

        done = extra_headers["X-Session-Done"] == "true"
        self.requests.append((extra_headers["X-Session-Id"], [dict(m) for m in messages], done, tools))
        self.closed += done
        if self.closed == self.stop_after:
            self.pool._stop.set()
        msg = SimpleNamespace(content="no idea", tool_calls=None)
        return SimpleNamespace(choices=[SimpleNamespace(message=msg)])


@pytest.mark.parametrize("n", [3, 1])
def test_resample_mode_asks_each_problem_n_times_and_grpo_gets_groups_of_n(tiny_model, n):
    from transformers import AutoTokenizer

    from clawray.algos.advantages import group_advantages
    from clawray.config import EnvConfig
    from clawray.envs.sim_user import SimUserPool

    pool = SimUserPool("http://127.0.0.1:9/v1", EnvConfig(name="brief", resample_n=n, max_turns=1, seed=0))
    client = pool.client = _ScriptedClient(pool, stop_after=12)
    pool._loop(0)  # one worker, in this thread, until the 12th session closes
    firsts = [r for r in client.requests if not r[2]]  # each session's first (trained) request
    assert len(firsts) == 12 and len({sid for sid, *_ in firsts}) == 12  # 12 sessions, 12 ids
    # in: 12 / n problems, each asked in n consecutive sessions with the same opening messages
    openings = [tuple(m["content"] for m in msgs) for _, msgs, _, _ in firsts]
    assert len(set(openings)) == 12 // n
    assert all(len(set(openings[i : i + n])) == 1 for i in range(0, 12, n))
    # out: the first turns as the tracker would emit them (the served prompt ids: the chat template
    # of the same messages), grouped by prompt as the driver does for trainer.advantage=grpo
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rewards = [1.0, -1.0, -1.0] * 4  # per group of 3: one solved, two not
    metas = []
    for (sid, msgs, _, _), r in zip(firsts, rewards):
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        sample = Sample(list(ids) + [5, 6], len(ids), [1, 1], [-1.0, -1.0], r, 0, session_id=sid, turn_index=1)
        metas.append(SampleMeta.of(sample))
    keys = batching.sample_groups(metas, "prompt")
    sizes = sorted(keys.count(k) for k in set(keys))
    assert sizes == [n] * (12 // n)
    adv = group_advantages(torch.tensor(rewards), torch.tensor([sorted(set(keys)).index(k) for k in keys]))
    if n == 3:  # rewards [1, -1, -1]: mean -1/3, population std sqrt(8/9); (1 + 1/3) / sqrt(8/9) = sqrt(2)
        h = 2**0.5
        assert adv.tolist() == pytest.approx([h, -h / 2, -h / 2] * 4, abs=1e-6)
    else:  # groups of one carry no preference
        assert adv.tolist() == [0.0] * 12
    # dynamic sampling keeps the groups with variance: with n = 3 all 12 samples (4 groups) stay;
    # with n = 1 every group of one is rejected
    assert len(zero_variance(keys, rewards)) == (0 if n == 3 else 12)


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (["trainer.dynamic_sampling=true"], True),  # every group of the simulated user holds one sample
        (["trainer.advantage=grpo"], True),
        (["trainer.advantage=grpo", "trainer.group_by=session_prefix"], True),
        (["trainer.dynamic_sampling=true", "env.resample_n=4"], False),
        (["trainer.advantage=grpo", "trainer.group_by=none"], False),
        (["trainer.dynamic_sampling=true", "env.enabled=false"], False),  # live traffic: its own groups
    ],
)
def test_groups_of_one_are_refused_where_the_simulated_user_asks_each_problem_once(overrides, refused):
    from clawray.config import ConfigError, load_config

    if refused:
        with pytest.raises(ConfigError, match=r"env.resample_n=1 asks each problem in one session"):
            load_config([], overrides)
    else:
        assert load_config([], overrides).env.resample_n in (1, 4)

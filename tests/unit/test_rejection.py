"""Groups and DAPO dynamic sampling (clawray.algos.rejection, Driver._fill_dynamic), GRPO over them."""

import pytest
import torch

from clawray import driver as driver_mod
from clawray import step_metrics
from clawray.algos.advantages import batch_advantages
from clawray.algos.invariants import DegenerateBatchGuard
from clawray.algos.rejection import group_keys, opening, zero_variance
from clawray.config import load_config
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


def _batch(metas):
    return {
        "refs": [f"ref{i}" for i in range(len(metas))],
        "meta": metas,
        "versions": [0] * len(metas),
        "staleness": [1] * len(metas),
        "seqs": list(range(len(metas))),
    }


def _driver(monkeypatch, takes, **trainer):
    cfg = load_config(
        [], ["trainer.dynamic_sampling=true", "trainer.batch_size=4"] + [f"trainer.{k}={v}" for k, v in trainer.items()]
    )
    d = driver_mod.Driver.__new__(driver_mod.Driver)
    d.cfg, d.zero_variance_dropped = cfg, 0
    calls = []

    def wait_batch(driver, batch_size, next_version, timeout, max_batch_size):
        calls.append(batch_size)
        if not takes:
            return None
        return _batch(takes.pop(0))

    def no_fetch(refs):
        raise AssertionError(f"the driver fetched {refs}")  # dynamic sampling decides on metadata only

    monkeypatch.setattr("clawray.recovery.wait_batch", wait_batch)
    monkeypatch.setattr(driver_mod.ray, "get", no_fetch)
    return d, calls


def test_dynamic_sampling_refills_until_enough_samples_have_variance(monkeypatch):
    first = [_meta(1, 1.0), _meta(1, 1.0), _meta(2, 1.0), _meta(2, -1.0)]
    d, calls = _driver(monkeypatch, [[_meta(3, 0.5), _meta(3, -0.5)]], dynamic_sampling_wait_s=30)
    batch, rejected = d._fill_dynamic(_batch(first), 1)
    assert rejected == {0, 1} and len(batch["meta"]) == len(batch["refs"]) == 6 and calls == [1]  # one refill
    assert batch["seqs"] == [0, 1, 2, 3, 0, 1] and d.zero_variance_dropped == 2


def test_dynamic_sampling_stops_at_the_wait_limit(monkeypatch):
    first = [_meta(1, 1.0), _meta(2, -1.0), _meta(3, 1.0), _meta(3, -1.0)]
    d, calls = _driver(monkeypatch, [], dynamic_sampling_wait_s=0)
    batch, rejected = d._fill_dynamic(_batch(first), 1)
    assert rejected == {0, 1} and len(batch["meta"]) == 4 and calls == []  # no wait: trains the 2 it has
    assert d.zero_variance_dropped == 2


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

"""The promotion gate's canary (issue #26, clawray.canary): the live verdict on hand-made reward tallies,
the window over the queue's tallies, the session-affine arm of a session and the engines it may use,
an engine's arm check, the config's rules, and the order of a canary's sync, probe, window and
promotion or rollback (fake sync, learners and queue)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest

from clawray.canary import CanaryWindow, canary_engine, canary_verdict
from clawray.config import ConfigError, DeployConfig, load_config, section
from clawray.promotion import decide
from clawray.serve.routing import DOWN, PAUSED, UP, arm_states, choose_engine, in_canary
import test_gate


def tally(rewards: list[float]) -> tuple[float, float, float]:
    return (len(rewards), sum(rewards), sum(r * r for r in rewards))


GOOD = [1.0] * 30 + [-1.0] * 10  # mean 0.5, sample variance (40 - 40 x 0.25) / 39 = 0.769231


def test_a_canary_significantly_worse_than_the_promoted_version_is_harm():
    """-0.5 vs 0.5 over 40 turns each: se = sqrt(2 x 0.769231 / 40) = 0.196116, Welch-Satterthwaite df
    = 78 (equal variances and sizes: 2n - 2), upper = -1 + t_(0.95, 78) 1.664625 x 0.196116 = -0.673540
    < -0.1."""
    v = canary_verdict(tally([1.0] * 10 + [-1.0] * 30), tally(GOOD), 32, 0.05, 0.1)
    assert v.harm is True and v.turns == 40 and v.promoted_turns == 40
    assert v.mean == -0.5 and v.promoted_mean == 0.5 and v.delta == -1.0
    assert v.upper == pytest.approx(-1.0 + 1.6646246 * math.sqrt(2 * 30 / 39 / 40), abs=1e-6)
    assert v.upper == pytest.approx(-0.673540, abs=1e-6) and v.reason.startswith("worse: live reward -0.500 over 40")


def test_a_small_live_drop_within_the_noise_is_no_evidence_of_harm():
    """0.4 (variance 33.6 / 39) vs 0.5: se = sqrt((0.861538 + 0.769231) / 40) = 0.201914, df 77.75,
    upper = -0.1 + 1.664689 x 0.201914 = 0.236124 >= -0.1."""
    v = canary_verdict(tally([1.0] * 28 + [-1.0] * 12), tally(GOOD), 32, 0.05, 0.1)
    assert v.harm is False and v.delta == pytest.approx(-0.1) and v.upper == pytest.approx(0.236124, abs=1e-6)
    # with 20 x the turns and margin 0 the same drop is significant: upper ~ -0.1 + 0.332118 / sqrt(20)
    v = canary_verdict(tally(([1.0] * 28 + [-1.0] * 12) * 20), tally(GOOD * 20), 32, 0.05, 0.0)
    assert v.harm is True and v.upper == pytest.approx(-0.1 + 0.332118 / math.sqrt(20), abs=2e-3)


def test_too_few_turns_in_an_arm_is_inconclusive_and_the_probe_decides():
    v = canary_verdict(tally([-1.0] * 31), tally(GOOD), 32, 0.05, 0.1)
    assert v.harm is None and math.isnan(v.upper) and "inconclusive" in v.reason
    assert v.record()["upper"] is None and v.metrics()["deploy/canary_harm"] == -1.0
    empty = canary_verdict((0, 0, 0), tally(GOOD), 32, 0.05, 0.1)
    assert empty.harm is None and empty.turns == 0 and math.isnan(empty.mean)
    with pytest.raises(ValueError, match="min_turns >= 2"):
        canary_verdict(tally(GOOD), tally(GOOD), 1, 0.05, 0.1)


def test_the_verdict_vetoes_a_probe_promotion_only_on_harm():
    probe = decide([1.0] * 20, [1.0] * 20)
    assert probe.promote
    harm = canary_verdict(tally([-1.0] * 40), tally(GOOD), 32, 0.05, 0.1).apply(probe)
    assert not harm.promote and harm.backoff and harm.reason.startswith("rejected by its canary: worse")
    fine = canary_verdict(tally(GOOD), tally(GOOD), 32, 0.05, 0.1).apply(probe)
    assert fine.promote and fine.reason.endswith("canary: no evidence of harm: live reward 0.500 over 40 turns "
                                                 "vs the promoted version's 0.500 over 40, delta +0.000, "
                                                 "upper bound +0.326 vs -0.1")  # fmt: skip


def test_the_window_counts_what_was_put_after_it_opened():
    deploy = section(DeployConfig, {"gate": True, "canary_turns": 2, "canary_timeout_s": 30})
    reads = iter([{3: (100, 50, 100)}, {3: (101, 51, 101), 4: (1, -1, 1)}, {3: (102, 52, 102), 4: (2, -2, 2)}])
    window = CanaryWindow(lambda: next(reads), 4, 3, deploy, poll_s=0.0)
    window.open()
    v = window.wait()  # the first read after open has one turn each: it reads again
    assert (v.turns, v.mean, v.promoted_turns, v.promoted_mean) == (2, -1.0, 2, 1.0)
    assert v.harm is True and v.upper == -2.0  # zero variance: the bound is the difference itself
    timed = CanaryWindow(lambda: {3: (5, 5, 5)}, 4, 3, section(DeployConfig, {"canary_timeout_s": 0.01}), 0.0)
    timed.open()
    assert timed.wait().harm is None  # nothing arrived before the timeout: inconclusive
    # Ray restarted the queue mid-window: its tallies start from 0 again; the window counts from there
    # (it read 2 - 100 = -98 promoted turns and could only time out, inconclusive)
    reads = iter([{3: (100, 50, 100)}, {3: (1, 1, 1), 4: (1, -1, 1)}, {3: (2, 2, 2), 4: (2, -2, 2)}])
    restarted = CanaryWindow(lambda: next(reads), 4, 3, deploy, poll_s=0.0)
    restarted.open()
    v = restarted.wait()
    assert (v.turns, v.mean, v.promoted_turns, v.promoted_mean) == (2, -1.0, 2, 1.0) and v.harm is True


def test_which_engine_serves_the_canary():
    on = section(DeployConfig, {"gate": True, "canary_fraction": 0.2})
    assert canary_engine(on, ["e0", "e1", "e2"]) == 2
    assert canary_engine(on, ["e0"]) is None  # the promoted version needs another engine
    assert canary_engine(section(DeployConfig, {"gate": True}), ["e0", "e1"]) is None
    assert canary_engine(section(DeployConfig, {"canary_fraction": 0.2}), ["e0", "e1"]) is None


def test_a_session_is_in_the_canary_by_its_id_alone():
    ids = [f"session-{i}" for i in range(20000)]
    share = sum(in_canary(i, 0.25) for i in ids) / len(ids)
    assert abs(share - 0.25) < 0.01
    assert all(in_canary(i, 0.5) for i in ids if in_canary(i, 0.25))  # a larger fraction keeps its sessions
    assert [in_canary(i, 0.25) for i in ids[:50]] == [in_canary(i, 0.25) for i in ids[:50]]
    assert not in_canary(None, 0.9) and not in_canary("", 0.9) and not in_canary("s", 0.0)


def test_canary_traffic_goes_to_the_canary_engine_and_the_rest_never_does():
    states, arms = [UP, UP, UP], [None, None, "canary"]
    assert arm_states(states, arms, canary=True) == ([DOWN, DOWN, UP], False)
    assert arm_states(states, arms, canary=False) == ([UP, UP, DOWN], False)
    # a paused canary engine (a sync) keeps its sessions; a down one sends them to the others
    assert arm_states([UP, UP, PAUSED], arms, canary=True) == ([DOWN, DOWN, PAUSED], False)
    assert arm_states([UP, UP, DOWN], arms, canary=True) == ([UP, UP, DOWN], True)
    # an engine reserved for the probe serves nobody; without a canary every engine serves everyone
    assert arm_states(states, [None, None, "reserved"], canary=True) == ([UP, UP, DOWN], False)
    assert arm_states(states, [None] * 3, canary=True) == ([UP, UP, UP], False)
    allowed, _ = arm_states(states, arms, canary=False)
    assert all(choose_engine(f"s{i}", allowed, [0, 0, 0], 2, 0) != 2 for i in range(100))  # not even its home


def test_an_engine_serving_a_canary_refuses_other_traffic():
    from clawray.actors import rollout
    from clawray.engines.base import GenerateRequest

    with pytest.raises(ValueError, match="unknown arm"):
        asyncio.run(rollout.RolloutEngine.set_arm(SimpleNamespace(), "main"))
    with pytest.raises(ValueError, match=r"fraction in \(0, 1\)"):
        asyncio.run(rollout.RolloutEngine.set_arm(SimpleNamespace(), "canary", 1.0))
    engine = SimpleNamespace(arm=None, name="rollout-1")
    check = lambda canary: rollout.RolloutEngine._check_arm(engine, GenerateRequest([1], canary=canary))  # noqa: E731
    check(False), check(True)  # no arm: serves every request
    asyncio.run(rollout.RolloutEngine.set_arm(engine, "canary", 0.25))
    assert engine.arm == "canary" and engine.canary_fraction == 0.25
    check(True)
    with pytest.raises(rollout.EngineArmError, match="rollout-1 serves the canary arm only"):
        check(False)
    asyncio.run(rollout.RolloutEngine.set_arm(engine, "reserved"))
    assert engine.canary_fraction == 0.0
    for canary in (False, True):
        with pytest.raises(rollout.EngineArmError, match="reserved arm only"):
            check(canary)


def test_a_canary_needs_the_gate_a_second_engine_and_the_asynchronous_loop():
    ok = ["deploy.gate=true", "env.enabled=true", "rollout.num_engines=2", "deploy.canary_fraction=0.2"]
    assert load_config([], ok).deploy.canary_fraction == 0.2
    for change, why in (
        ("deploy.gate=false", "needs deploy.gate=true"),
        ("rollout.num_engines=1", "needs rollout.num_engines >= 2"),
        ("trainer.overlap=false", "needs trainer.overlap=true"),
    ):
        with pytest.raises(ConfigError, match=why):
            load_config([], [*ok, change])
    with pytest.raises(ConfigError, match="canary_fraction"):
        load_config([], [*ok[:3], "deploy.canary_fraction=1.0"])


# ---------------------------------------------------------------- the gate's canary flow (fakes)


class FakeSync(test_gate.FakeSync):
    """test_gate's fake controller, with the canary's partial syncs (``only``) in each call's record."""

    names = ["rollout-0", "rollout-1"]

    def sync(self, version, hold=False, only=None):
        out = super().sync(version, hold)
        self.calls[-1] += (only,)
        return out

    def release(self, only=None):
        super().release()
        self.calls[-1] += (only,)
        return []


def test_a_canary_is_probed_alone_served_to_its_fraction_and_promoted_or_rolled_back(tmp_path, monkeypatch):
    import clawray.gate as gate_module
    import clawray.recovery

    make_gate, records = test_gate.make_gate, test_gate.records

    monkeypatch.setattr(clawray.recovery, "restarted_engines", lambda actors: [])
    arms: list[tuple] = []
    monkeypatch.setattr(gate_module, "_set_arm", lambda engine, arm, fraction=0.0: arms.append((engine, arm, fraction)))
    reads: list[dict] = []
    monkeypatch.setattr(gate_module, "_reward_tallies", lambda queue: reads.pop(0))
    base = [1.0] * 20
    gate = make_gate(
        tmp_path, base, base, base, [0.0] * 20, base, canary_fraction=0.25, canary_turns=40, max_rejections=5
    )
    actors = SimpleNamespace(
        weight_sync=FakeSync(), learners=test_gate.FakeLearners(), engines=["e0", "e1"], judges=[], queue=None
    )
    gate.baseline(0, "unused", None)
    # v1: as good live as v0 -> promoted; every engine loads it
    reads[:] = [{0: tally(GOOD)}, {0: tally(GOOD * 2), 1: tally(GOOD)}]
    out = gate.sync_candidate(actors, 1, "unused")
    assert not out.rolled_back and gate.promoted == 1 and actors.learners.calls == ["keep"]
    assert actors.weight_sync.calls == [("sync", 1, True, [1]), ("release", [1]), ("sync", 1, False, None)]
    assert arms == [("e1", "reserved", 0.0), ("e1", "canary", 0.25), ("e1", None, 0.0)]
    assert out.metrics["deploy/canary_turns"] == 40 and out.metrics["deploy/canary_harm"] == 0.0
    rec = records(tmp_path)[-1]
    assert rec["decision"] == "promoted" and rec["canary"]["turns"] == 40 and rec["canary"]["harm"] is False
    # v2: passes its probe, worse live (-1 vs 0.5) -> rejected with the back-off; e1 alone loads v1 back
    actors.weight_sync.calls.clear(), arms.clear()
    reads[:] = [{1: tally(GOOD)}, {1: tally(GOOD * 2), 2: tally([-1.0] * 40)}]
    out = gate.sync_candidate(actors, 2, "unused")
    assert out.rolled_back and gate.promoted == 1 and actors.learners.calls[-1] == ("restore", 0.5)
    assert actors.weight_sync.calls == [
        ("sync", 2, True, [1]), ("release", [1]), ("sync", 1, True, [1]), ("release", [1])
    ]  # fmt: skip
    assert [a[1] for a in arms] == ["reserved", "canary", None]
    rec = records(tmp_path)[-1]
    assert (
        rec["decision"] == "rejected" and rec["backoff"] is True and rec["reason"].startswith("rejected by its canary")
    )
    # v3: fails its probe (0.0 vs 1.0) -> no canary at all, e1 loads v1 back
    actors.weight_sync.calls.clear(), arms.clear()
    out = gate.sync_candidate(actors, 3, "unused")
    assert out.rolled_back and actors.weight_sync.calls == [
        ("sync", 3, True, [1]),
        ("sync", 1, True, [1]),
        ("release", [1]),
    ]
    assert [a[1] for a in arms] == ["reserved", None] and "canary" not in records(tmp_path)[-1]
    # v4: its window cannot read the queue -> withdrawn (no back-off), e1 loads v1 back, serves everyone
    actors.weight_sync.calls.clear(), arms.clear()

    reads[:] = [{1: tally(GOOD)}]

    def lost(queue):  # the window opens, then the queue is gone
        if reads:
            return reads.pop(0)
        raise RuntimeError("the queue actor died")

    monkeypatch.setattr(gate_module, "_reward_tallies", lost)
    out = gate.sync_candidate(actors, 4, "unused")
    assert out.rolled_back and actors.learners.calls[-1] == ("restore", 1.0) and gate.promoted == 1
    assert actors.weight_sync.calls == [
        ("sync", 4, True, [1]), ("release", [1]), ("sync", 1, True, [1]), ("release", [1])
    ]  # fmt: skip
    assert [a[1] for a in arms] == ["reserved", "canary", None]
    rec = records(tmp_path)[-1]
    assert rec["decision"] == "withdrawn"
    assert rec["reason"] == "the probe or its canary failed: RuntimeError: the queue actor died"


class FakeEngine:
    """An engine handle for EnginePool: ``stats.remote()`` is awaitable; its arm as RolloutEngine's."""

    def __init__(self, name: str, arm=None, fraction: float = 0.0):
        self.name, self.arm, self.fraction = name, arm, fraction
        self.stats = SimpleNamespace(remote=self._stats)

    async def _stats(self) -> dict:
        return {
            "in_flight": 0,
            "paused": False,
            "awaiting_sync": False,
            "arm": self.arm,
            "canary_fraction": self.fraction,
        }


def test_the_pool_keeps_canary_sessions_on_the_canary_engine_and_the_rest_off_it():
    from collections import Counter

    from clawray.actors.rollout import EngineArmError
    from clawray.serve.engine_pool import EnginePool

    e0, e1 = FakeEngine("e0"), FakeEngine("e1", "canary", 0.5)

    async def attempt(engine, canary):
        if engine.arm == "reserved" or (engine.arm == "canary" and not canary):  # RolloutEngine._check_arm
            raise EngineArmError(f"{engine.name} serves the {engine.arm} arm only")
        return engine.name, canary

    async def scenario():
        pool = EnginePool([e0, e1], engine_slack=100, retry_after_s=1.0, counts=Counter(), poll_s=3600)
        await pool._poll_one(0), await pool._poll_one(1)
        sessions = [f"s{i}" for i in range(200)]
        served = [(s, await pool.run(s, 1, attempt)) for _ in range(3) for s in sessions]
        # the canary ends, unknown to the pool until e1 refuses a request: it asks e1 and chooses again
        e1.arm, e1.fraction = "reserved", 0.0
        after = [await pool.run(s, 1, attempt) for s in sessions[:20]]
        return served, after, pool.counts

    served, after, counts = asyncio.run(scenario())
    assert all(out == (("e1", True) if in_canary(s, 0.5) else ("e0", False)) for s, out in served)
    assert 80 <= sum(in_canary(s, 0.5) for s, _ in served) / 3 <= 120
    assert after == [("e0", False)] * 20 and counts["engine_arm_refusals"] >= 1


@pytest.mark.parametrize(
    "p, df, value",
    [  # Student's t quantiles (tables: Abramowitz & Stegun 26.10; R's qt)
        (0.95, 1, 6.313751515),  # tan(0.45 pi)
        (0.95, 2, 2.919985580),
        (0.95, 10, 1.812461123),
        (0.975, 5, 2.570581836),
        (0.99, 30, 2.457261542),
        (0.95, 78, 1.664624645),
        (0.95, math.inf, 1.644853627),
        (0.5, 3, 0.0),
    ],
)
def test_t_quantiles_match_the_tables(p, df, value):
    from clawray.canary import t_quantile

    assert t_quantile(p, df) == pytest.approx(value, abs=1e-8)


def test_a_canary_of_two_turns_an_arm_uses_welchs_t_and_calls_no_harm_on_noise():
    """Candidate rewards [0, 0.4], promoted [1, 1]: s_c^2 = 0.08, se = 0.2, Welch-Satterthwaite df = 1
    (only one arm varies): upper = -0.8 + 6.3138 x 0.2 = +0.463, no harm; the normal quantile gave
    -0.471 and rejected it (at 2 turns an arm it called harm on noise 2.4x alpha as often)."""
    v = canary_verdict((2, 0.4, 0.16), (2, 2.0, 2.0), 2, 0.05, 0.1)
    assert v.harm is False and v.upper == pytest.approx(-0.8 + 6.313751515 * 0.2, abs=1e-8)
    sure = canary_verdict(tally([-1.0, -1.0]), tally([1.0, 1.0]), 2, 0.05, 0.1)  # no variance: se 0
    assert sure.harm is True and sure.upper == -2.0

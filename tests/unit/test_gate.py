"""The promotion gate's bookkeeping (issue #26, clawray.gate): the promoted version and its paired
probe scores, decisions recorded in versions.jsonl, rejections in a row that stop the run, and which
versions are probed or may be checkpointed. The probe's generations are faked: each call returns the
next list of per-item scores."""

from __future__ import annotations

import json
import math

import pytest

from clawray.config import ConfigError, DeployConfig, load_config, section
from clawray.gate import GateStopped, PromotionGate


class FakeEvaluator:
    """Stands in for clawray.evaluation.Evaluator: ``run`` returns the next scores as replies."""

    def __init__(self, *rounds: list[float], measure: str = "solved"):
        self.rounds, self.measure, self.calls = list(rounds), measure, 0

    def run(self, generate):
        self.calls += 1
        scores = self.rounds.pop(0)
        return {"seconds": 0.5, "replies": [{"scores": {self.measure: s, "other": 1.0}} for s in scores]}


def make_gate(tmp_path, *rounds, **deploy) -> PromotionGate:
    gate = PromotionGate(section(DeployConfig, {"gate": True, **deploy}), None, str(tmp_path))
    gate._evaluator = FakeEvaluator(*rounds)
    return gate


def records(tmp_path) -> list[dict]:
    return [json.loads(line) for line in open(tmp_path / "versions.jsonl")]


def test_a_candidate_that_holds_is_promoted_and_its_scores_become_the_reference(tmp_path):
    base = [1.0] * 10 + [0.0] * 10  # 0.5
    better = [1.0] * 12 + [0.0] * 8  # 0.6, better on 2 items
    gate = make_gate(tmp_path, base, better, better)
    assert gate.baseline(0, "unused", None) == 0.5 and gate.promoted == 0
    scores, seconds = gate.probe("unused", None)
    decision = gate.judge(1, scores, seconds, samples=4)
    assert decision.promote and gate.promoted == 1 and gate.promoted_scores == better
    assert gate.rejections == 0 and gate.dropped_samples == 0
    rec = records(tmp_path)
    assert [r["decision"] for r in rec] == ["baseline", "promoted"]
    assert rec[1]["version"] == 1 and rec[1]["promoted_before"] == 0 and rec[1]["items"] == 20
    assert rec[1]["candidate_mean"] == 0.6 and rec[1]["promoted_mean"] == 0.5 and rec[1]["worse"] == 0
    assert gate.metrics(decision, 2.5, 0.5) == {
        "deploy/serving_version": 1.0,
        "deploy/rejections": 0.0,
        "deploy/dropped_samples": 0.0,
        "deploy/promoted": 1.0,
        "deploy/rejected": 0.0,
        "deploy/probe_s": 0.5,
        "deploy/candidate_mean": 0.6,
        "deploy/promoted_mean": 0.5,
        "deploy/p_worse": 1.0,
        "deploy/users_held_s": 2.5,
    }


def test_significant_drops_are_rejected_and_max_rejections_in_a_row_stop_the_run(tmp_path):
    base = [1.0] * 16 + [0.0] * 4  # 0.8
    worse = [0.0] * 8 + [1.0] * 8 + [0.0] * 4  # 0.4: worse on 8 items, better on none
    gate = make_gate(tmp_path, base, worse, worse, max_rejections=2)
    gate.baseline(3, "unused", None)
    d1 = gate.judge(4, *gate.probe("unused", None), samples=5)
    # exact sign test: P(X >= 8), X ~ Binomial(8, 1/2) = 1/256
    assert not d1.promote and d1.p_worse == 1 / 256 and d1.delta == pytest.approx(-0.4)
    assert gate.promoted == 3 and gate.promoted_scores == base and gate.rejections == 1
    gate.check_stop()  # one rejection: the run goes on
    gate.judge(4, *gate.probe("unused", None), samples=3)
    assert gate.rejections == 2 and gate.dropped_samples == 8
    with pytest.raises(GateStopped, match=r"rejected 2 candidates in a row .* still served v3\. Last: rejected"):
        gate.check_stop()
    assert [r["decision"] for r in records(tmp_path)] == ["baseline", "rejected", "rejected"]
    assert records(tmp_path)[2]["rejections_in_a_row"] == 2


def test_a_promotion_resets_the_rejections_and_the_floor_rejects_alone(tmp_path):
    base = [1.0] * 5 + [0.0] * 15  # 0.25
    same = list(base)
    gate = make_gate(tmp_path, base, same, same, floor=0.3, max_rejections=5)
    gate.baseline(0, "unused", None)
    d = gate.judge(1, *gate.probe("unused", None))
    assert not d.promote and "below the floor 0.300" in d.reason and gate.rejections == 1
    gate.cfg = section(DeployConfig, {"gate": True, "floor": 0.0, "max_rejections": 5})
    assert gate.judge(1, *gate.probe("unused", None)).promote and gate.rejections == 0


def test_every_versions_probes_every_kth_version_and_only_promoted_ones_are_settled(tmp_path):
    gate = make_gate(tmp_path, [1.0, 0.0], every_versions=3)
    assert gate.due(1)  # nothing promoted yet
    gate.baseline(2, "unused", None)
    assert [v for v in range(3, 9) if gate.due(v)] == [5, 6, 7, 8]
    assert gate.settled(2) and not gate.settled(3) and gate.served(4) == 2
    off = PromotionGate(section(DeployConfig, {}), None, str(tmp_path))
    assert off.settled(7) and not off.enabled and off.served(7) == 7
    off.check_stop()  # the gate off never stops a run


def test_the_measure_is_the_configured_one_or_the_checks_first(tmp_path):
    gate = make_gate(tmp_path, [1.0, 0.0], measure="other")
    assert gate.probe("unused", None)[0] == [1.0, 1.0]
    gate = make_gate(tmp_path, [1.0, 0.0], measure="missing")
    with pytest.raises(
        ConfigError, match=r"deploy.measure='missing': the environment's check reports \['other', 'solved'\]"
    ):
        gate.probe("unused", None)
    gate = make_gate(tmp_path, [1.0, 0.0])
    assert gate.probe("unused", None)[0] == [1.0, 0.0]


def test_the_gate_needs_an_environment_and_valid_settings():
    with pytest.raises(ConfigError, match="deploy.gate=true needs a probe: deploy.probe_file"):
        load_config(["conf/rl.yaml"], ["deploy.gate=true", "env.enabled=false"])
    with pytest.raises(ConfigError, match="deploy.on_reject='keep'"):
        load_config([], ["deploy.on_reject=keep"])
    with pytest.raises(ConfigError, match="deploy.every_versions=0"):
        load_config([], ["deploy.every_versions=0"])
    cfg = load_config(["conf/rl.yaml"], ["deploy.gate=true"])
    assert cfg.deploy.gate and cfg.deploy.margin == 0.05 and cfg.deploy.max_rejections == 3


def test_small_drops_that_add_up_are_caught_against_the_best_promoted_version(tmp_path):
    """Each candidate is 1 item worse than the last promoted one (never significant alone), so without
    the best-version check the served policy would ratchet down; against the best (v0) the fourth
    drop is significant: P(X >= 5 | n = 5) = 1/32 < 0.05 and 5/20 = 0.25 > margin 0.1."""
    rounds = [[1.0] * 20]
    for k in range(1, 6):
        rounds.append([0.0] * k + [1.0] * (20 - k))
    gate = make_gate(tmp_path, *rounds, margin=0.1, max_rejections=9)
    gate.baseline(0, "unused", None)
    decisions = [gate.judge(v, *gate.probe("unused", None)) for v in range(1, 6)]
    assert [d.promote for d in decisions] == [True, True, True, True, False]
    assert decisions[4].reason.startswith("against the best promoted v0: rejected: significantly worse")
    assert gate.promoted == 4 and gate.best == 0 and decisions[4].p_worse == 1 / 32


def test_a_candidate_the_test_promotes_is_rejected_by_its_invariant_guards(tmp_path):
    same = [1.0] * 10 + [0.0] * 10
    gate = make_gate(tmp_path, same, same, same, max_rejections=5, entropy_ratio_min=0.5)
    gate.baseline(0, "unused", None, guards=lambda: {"entropy": 0.6, "mismatch_kl": 1e-7, "tokens": 40})
    assert gate.reference_guards == {"entropy": 0.6, "mismatch_kl": 1e-7, "tokens": 40}
    d = gate.judge(1, *gate.probe("unused", None), guards={"entropy": 0.2, "mismatch_kl": 1e-7, "tokens": 40})
    assert not d.promote and gate.rejections == 1 and gate.promoted == 0
    assert (
        d.reason.startswith("rejected: policy entropy collapsed: 0.2000 nats/token")
        and "no significant drop" in d.reason
    )
    m = gate.metrics(d, 1.0, 0.5)
    assert m["deploy/rejected"] == 1.0 and m["deploy/entropy"] == 0.2 and m["deploy/mismatch_kl"] == 1e-7
    d = gate.judge(1, *gate.probe("unused", None), guards={"entropy": 0.5, "mismatch_kl": 0.5, "tokens": 40})
    assert not d.promote and "log-prob mismatch 0.5 (KL per token) above 0.01" in d.reason
    rec = records(tmp_path)
    assert rec[0]["entropy"] == 0.6 and rec[1]["entropy"] == 0.2 and rec[2]["mismatch_kl"] == 0.5
    assert rec[1]["scores"] == same  # every decision keeps its per-item scores (a resume pairs with them)


def test_the_guard_replies_are_the_probes_first_nonempty_replies_as_samples(tmp_path):
    from clawray.engines.base import GenerateRequest

    gate = make_gate(tmp_path, guard_replies=2)
    reply = {"response_ids": [7, 8], "logprobs": [-0.5, -0.25], "policy_version": 4, "token_versions": [4, 4]}
    gate.last_replies = [
        (GenerateRequest(prompt_ids=[1, 2, 3], temperature=0.7), {**reply, "response_ids": [], "logprobs": []}),
        (GenerateRequest(prompt_ids=[1, 2, 3], temperature=0.7), reply),
        (
            GenerateRequest(prompt_ids=[4], temperature=0.7),
            {**reply, "response_ids": [9], "logprobs": [-1.0], "token_versions": None},
        ),
        (GenerateRequest(prompt_ids=[5], temperature=0.7), reply),
    ]
    samples = gate.guard_samples()
    assert [(s.tokens, s.prompt_len, s.rollout_logprobs) for s in samples] == [
        ([1, 2, 3, 7, 8], 3, [-0.5, -0.25]),
        ([4, 9], 1, [-1.0]),
    ]
    assert all(s.temperature == 0.7 and s.policy_version == 4 and s.loss_mask == [1] * s.response_len for s in samples)
    assert make_gate(tmp_path, guard_replies=0).guard_samples() == []
    off = make_gate(tmp_path, entropy_ratio_min=0.0, mismatch_max=0.0)
    off.last_replies = gate.last_replies
    assert off.guard_samples() == [] and off.measure_guards(learners=None) is None


def test_a_resume_restores_the_promoted_scores_and_the_best_version_of_its_lineage(tmp_path):
    """v0 baseline 0.5, v1 promoted 0.6 (the best), v2 promoted 0.55, v3 rejected, v4 promoted 0.5;
    then a resume at v2 (the last checkpoint) discards v3-v4; a later resume at v3 finds no record."""
    base, best, v2 = [1.0] * 10 + [0.0] * 10, [1.0] * 12 + [0.0] * 8, [1.0] * 11 + [0.0] * 9
    worse = [0.0] * 20
    gate = make_gate(tmp_path, base, best, v2, worse, base, guard_replies=0)
    gate.baseline(0, "unused", None, guards=lambda: {"entropy": 0.6, "mismatch_kl": 0.0, "tokens": 9})
    for v in (1, 2, 3, 4):
        gate.judge(v, *gate.probe("unused", None))
    assert gate.promoted == 4 and gate.best == 1
    resumed = make_gate(tmp_path)
    assert resumed.resume(2)
    assert resumed.promoted == 2 and resumed.promoted_scores == v2 and resumed.rejections == 0
    assert resumed.best == 1 and resumed.best_scores == best
    assert resumed.reference_guards == {"entropy": 0.6, "mismatch_kl": 0.0, "tokens": 9}
    assert records(tmp_path)[-1] == {**records(tmp_path)[-1], "version": 2, "decision": "resumed", "best": 1}
    # after the resume at v2, the old lineage's v4 is gone: it cannot be resumed, v1 still can
    assert not make_gate(tmp_path).resume(4) and not make_gate(tmp_path).resume(3)
    again = make_gate(tmp_path)
    assert again.resume(1) and again.promoted_scores == best and again.best == 1
    assert not make_gate(tmp_path / "nowhere").resume(0)  # no versions.jsonl: the caller probes a baseline
    # a record torn by a kill mid-append is left out (it read as a damaged file: a new baseline), and
    # the next record is appended whole after it, not glued onto it
    with open(tmp_path / "versions.jsonl", "a") as f:
        f.write('{"version": 5, "decis')
    torn = make_gate(tmp_path)
    assert torn.resume(1) and torn.promoted_scores == best
    assert (
        records(tmp_path)[-1]["decision"] == "resumed"
        and '"version": 5' not in (tmp_path / "versions.jsonl").read_text()
    )


def test_a_resume_under_another_probe_probes_a_new_baseline_instead_of_pairing_unrelated_items(tmp_path, capsys):
    """The run probed 32 items; its resume with deploy.probe_prompts=0 (108 items) restored the 32
    scores, and every later judge failed ("got 108 and 32"): each candidate was withdrawn, none ever
    promoted, and the run never stopped. With the same count but another seed it paired unrelated
    items. The baseline now records the probe's identity; a resume under another probes anew."""
    base, v1 = [1.0] * 10 + [0.0] * 10, [1.0] * 12 + [0.0] * 8
    gate = make_gate(tmp_path, base, v1, probe_prompts=20)
    gate.baseline(0, "unused", None)
    gate.judge(1, *gate.probe("unused", None))
    assert records(tmp_path)[0]["probe"] == {
        "split": "eval", "prompts": 20, "n": 1, "seed": 1, "temperature": gate.cfg.probe_temperature,
        "max_tokens": None, "measure": "",
    }  # fmt: skip
    assert make_gate(tmp_path, probe_prompts=20).resume(1)  # the same probe: resumed
    capsys.readouterr()
    for changed in ({"probe_prompts": 0}, {"probe_prompts": 20, "probe_seed": 7}):
        assert not make_gate(tmp_path, **changed).resume(1)  # the caller probes a new baseline
        key = "prompts" if "probe_seed" not in changed else "seed"
        assert f"the probe changed since v0's baseline ({key})" in capsys.readouterr().out


def test_under_the_noninferior_rule_an_unproven_candidate_is_rolled_back_without_a_back_off(tmp_path):
    """margin 0.15, 20 items: one item worse gives the adjusted Wald lower bound (Bonett & Price: one
    pseudo-pair each way, 22 differences: centre -1/22, se sqrt((3/22 - 1/22^2) / 22)) -0.174 <= -0.15:
    not shown non-inferior, though no drop is significant (p = 0.5); an identical candidate (lower
    bound -1.645 sqrt(2/22) / sqrt(22) = -0.106) is promoted."""
    z = 1.6448536269514715
    base = [1.0] * 20
    gate = make_gate(tmp_path, base, [0.0] + [1.0] * 19, base, rule="noninferior", margin=0.15, max_rejections=2)
    gate.baseline(0, "unused", None)
    d = gate.judge(1, *gate.probe("unused", None), samples=4)
    se = math.sqrt((3 / 22 - (1 / 22) ** 2) / 22)
    assert not d.promote and not d.backoff and d.p_worse == 0.5 and d.lower == pytest.approx(-1 / 22 - z * se)
    assert gate.promoted == 0 and gate.rejections == 1 and gate.dropped_samples == 4
    rec = records(tmp_path)[-1]
    assert rec["decision"] == "rejected" and rec["backoff"] is False and "unproven" in rec["reason"]
    d = gate.judge(2, *gate.probe("unused", None))
    tied = -z * math.sqrt(2 / 22) / math.sqrt(22)
    assert d.promote and d.lower == pytest.approx(tied) and gate.promoted == 2 and gate.rejections == 0
    assert records(tmp_path)[-1]["lower"] == pytest.approx(tied)


class FakeSync:
    """The weight-sync controller's surface that sync_candidate uses; records each call."""

    failures = 0

    def __init__(self):
        self.calls: list[tuple] = []

    def sync(self, version, hold=False):
        self.calls.append(("sync", version, hold))
        zero = dict.fromkeys(("pause_s", "seconds", "send_s", "gather_s", "rebuild_s"), 0.0)
        return {
            "ok": True,
            "held": hold,
            "paused": hold,
            "bytes": 0,
            "load_s": {},
            "receive_s": {},
            "error": None,
            **zero,
        }

    def release(self, only=None):
        self.calls.append(("release",))
        return []

    def engine_versions(self):
        return {}


class FakeLearners:
    def __init__(self):
        self.calls: list = []

    def keep_promoted(self):
        self.calls.append("keep")

    def restore_promoted(self, lr_factor):
        self.calls.append(("restore", lr_factor))


def test_sync_candidate_backs_the_learning_rate_off_only_for_a_candidate_shown_worse(tmp_path):
    from types import SimpleNamespace

    base = [1.0] * 20
    unproven = [0.0] + [1.0] * 19  # lower bound -0.174 <= -0.15, p = 0.5
    worse = [0.0] * 8 + [1.0] * 12  # worse on 8, better on 0: p = 1/256, delta -0.4
    gate = make_gate(tmp_path, base, unproven, worse, base, rule="noninferior", margin=0.15, max_rejections=5)
    actors = SimpleNamespace(weight_sync=FakeSync(), learners=FakeLearners(), engines=[], judges=[])
    gate.baseline(0, "unused", None)
    outcomes = [gate.sync_candidate(actors, v, "unused") for v in (1, 1, 1)]
    assert [o.rolled_back for o in outcomes] == [True, True, False]
    assert actors.learners.calls == [("restore", 1.0), ("restore", 0.5), "keep"]
    assert actors.weight_sync.calls == [
        ("sync", 1, True), ("sync", 0, True), ("release",), ("sync", 1, True), ("sync", 0, True), ("release",),
        ("sync", 1, True), ("release",)
    ]  # fmt: skip
    assert [r.get("backoff") for r in records(tmp_path)] == [None, False, True, None]
    assert outcomes[1].metrics["deploy/rejected"] == 1.0 and gate.promoted == 1


def test_a_rolled_back_candidates_samples_are_discarded_from_the_journal_and_counted(tmp_path, monkeypatch):
    """A rejected candidate's samples were dropped by the gate but stayed consumed in the sample
    journal, so a learner rebuild or a resume revived and trained them. Now the gate discards their
    sequence numbers; a promoted candidate's are kept, and an exit that returns the learners to the
    promoted version counts what it drops."""
    from types import SimpleNamespace

    import ray

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    discarded: list = []
    queue = SimpleNamespace(discard=SimpleNamespace(remote=lambda seqs: discarded.append(list(seqs))))
    base, worse = [1.0] * 20, [0.0] * 8 + [1.0] * 12
    gate = make_gate(tmp_path, base, worse, base, rule="noninferior", margin=0.15, max_rejections=5)
    actors = SimpleNamespace(weight_sync=FakeSync(), learners=FakeLearners(), engines=[], judges=[], queue=queue)
    gate.baseline(0, "unused", None)
    gate.trained(["m1", "m2"], [11, 12])
    assert gate.sync_candidate(actors, 1, "unused").rolled_back and discarded == [[11, 12]]
    gate.trained(["m3"], [13])
    assert not gate.sync_candidate(actors, 1, "unused").rolled_back and discarded == [[11, 12]]
    assert gate.dropped_samples == 2
    gate.trained(["m4", "m5"], [14, 15])
    learners = SimpleNamespace(learners=SimpleNamespace(version=lambda: 2, restore_promoted=lambda f: None))
    assert gate.settle(learners, 1) == 1 and gate.dropped_samples == 4 and gate.pending_seqs == []


def test_a_candidate_whose_sync_failed_part_way_is_never_served_and_only_engines_back_on_the_promoted_resume(
    tmp_path, capsys
):
    """A candidate's held sync that reached rollout-0 and failed on rollout-1: the controller resumed
    every engine, so rollout-0 served the withdrawn candidate until the rollback's sync. Now a held sync
    keeps them paused, failed or not; the rollback is held too, and when it fails as well only the
    engines that answer with the promoted version resume (rollout-1 kept it); rollout-0 waits for the
    next sync."""
    from types import SimpleNamespace

    class PartialSync(FakeSync):
        names = ["rollout-0", "rollout-1"]

        def sync(self, version, hold=False):
            out = super().sync(version, hold)
            return {**out, "ok": False, "held": False, "error": "rollout-1: connection closed"}

        def release(self, only=None):
            self.calls.append(("release", only))
            return []

        def engine_versions(self):
            return {"rollout-0": 1, "rollout-1": 0}  # rollout-0 loaded the candidate v1

    base = [1.0] * 20
    gate = make_gate(tmp_path, base, base)
    actors = SimpleNamespace(weight_sync=PartialSync(), learners=FakeLearners(), engines=[], judges=[])
    gate.baseline(0, "unused", None)
    out = gate.sync_candidate(actors, 1, "unused")
    assert out.rolled_back and actors.learners.calls == [("restore", 1.0)]
    assert actors.weight_sync.calls == [("sync", 1, True), ("sync", 0, True), ("release", [1])]
    assert records(tmp_path)[-1]["decision"] == "withdrawn"
    assert "rollout-0 stay(s) paused until the next sync loads it" in capsys.readouterr().out


def test_a_stop_during_a_candidates_step_or_probe_checkpoints_the_promoted_version(tmp_path):
    """Ctrl-C while v1 is trained or probed: the driver's version is still v0 (it moves once the
    step's sync is done), so settle(v0) found it settled and the exit checkpoint saved the learners'
    unprobed v1 weights as v0, which the resume then served as its baseline. Now the learners are
    asked: past the promoted version, they return to it first."""
    from types import SimpleNamespace

    class Learners(FakeLearners):
        def __init__(self, version):
            super().__init__()
            self._version = version

        def version(self):
            if isinstance(self._version, Exception):
                raise self._version
            return self._version

    gate = make_gate(tmp_path, [1.0] * 20)
    gate.baseline(0, "unused", None)
    gate.trained(["a sample of v1"])
    candidate = SimpleNamespace(learners=Learners(1))
    assert gate.settle(candidate, 0) == 0 and candidate.learners.calls == [("restore", 1.0)] and gate.pending == []
    promoted = SimpleNamespace(learners=Learners(0))
    assert gate.settle(promoted, 0) == 0 and promoted.learners.calls == []
    assert gate.settle(SimpleNamespace(learners=Learners(RuntimeError("the learner died"))), 0) is None


def test_the_probe_draws_its_prompts_from_the_configured_split(tmp_path, monkeypatch):
    """deploy.probe_split=train keeps the eval split out of what the gate selects on; a probe file is
    one held-out set, so only eval goes with it."""
    import transformers

    import clawray.evaluation

    seen: dict = {}

    class Capture:
        def __init__(self, env, tokenizer, **kwargs):
            seen.update(kwargs, env=env.name)
            self.tasks = []

    monkeypatch.setattr(clawray.evaluation, "Evaluator", Capture)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: None)
    for split in ("eval", "train"):
        cfg = load_config([], ["deploy.gate=true", "env.enabled=true", "env.name=arith", f"deploy.probe_split={split}"])
        PromotionGate(cfg.deploy, cfg.env, str(tmp_path))._build("unused")
        assert seen["split"] == split and seen["env"] == "arith"
    with pytest.raises(ConfigError, match="deploy.probe_split must be eval"):
        load_config([], ["deploy.gate=true", "deploy.probe_file=probe.jsonl", "deploy.probe_split=train"])


def test_with_the_gate_a_periodic_checkpoint_waits_for_the_next_promoted_version(tmp_path, monkeypatch):
    """checkpoint.every_steps 4 with a gate that promotes every 3 versions: step 4 holds an unprobed
    candidate, so its checkpoint was skipped, and the next one came only when a step count divisible
    by 4 met a promotion (step 12): a crash lost up to 12 steps, and with steps and promotions that
    never meet (a rejection shifts them) every periodic checkpoint was skipped. Now the checkpoint
    due at step 4 is saved at the next settled step (6), the one due at 8 at 9."""
    import types

    from clawray.resume import Checkpoints

    cfg = load_config([], [f"run_dir={tmp_path}", "checkpoint.every_steps=4"])
    state = types.SimpleNamespace(steps_done=0)
    ckpt = Checkpoints(cfg, state, actors=None)
    saved = []

    def save():
        saved.append(state.steps_done)
        ckpt.last = {"seconds": 0.25}

    monkeypatch.setattr(ckpt, "save", save)
    seconds = []
    for step in range(1, 13):
        state.steps_done = step
        seconds.append(ckpt.periodic(settled=step % 3 == 0))  # promoted at v3, v6, v9, v12
    assert saved == [6, 9, 12] and seconds.count(0.25) == 3
    for step in range(13, 17):  # without the gate (always settled): every 4 steps, as before
        state.steps_done = step
        ckpt.periodic()
    assert saved == [6, 9, 12, 16]


def test_lr_back_offs_since_the_promoted_point_compound_and_a_withdrawal_keeps_them():
    """deploy.lr_backoff 0.5: each restore multiplied the point's rate, so two rejections in a row
    left x0.5 (not x0.25) and a withdrawn candidate (factor 1) put the full rate back."""
    import torch

    from clawray.actors.learner import LearnerWorker

    w = LearnerWorker.__new__(LearnerWorker)
    lin = torch.nn.Linear(2, 2)
    w.model, w.trainable = lin, list(lin.parameters())
    w.optimizer = torch.optim.AdamW(w.trainable, lr=1e-5)
    w.scheduler = torch.optim.lr_scheduler.LambdaLR(w.optimizer, lambda s: 1.0)
    w.version, w.optimizer_steps, w.skipped_steps = 4, 4, 0
    w.keep_promoted()

    def candidate():
        lin(torch.ones(2)).sum().backward()
        w.optimizer.step()
        w.scheduler.step()
        w.optimizer.zero_grad()

    lrs = []
    for factor in (0.5, 0.5, 1.0):
        candidate()
        lrs.append(w.restore_promoted(factor)["lr"])
    candidate()
    assert lrs == pytest.approx([5e-6, 2.5e-6, 2.5e-6]) and w.scheduler.get_last_lr() == pytest.approx([2.5e-6])
    assert w.version == 4
    w.keep_promoted()  # a promotion: the new point starts from the backed-off rate
    candidate()
    assert w.restore_promoted(0.5)["lr"] == pytest.approx(1.25e-6)


def test_a_learner_rebuild_cuts_the_discarded_versions_from_a_later_resumes_lineage(tmp_path):
    """v2 (0.9, the best) was promoted, then the learners were rebuilt from v1's checkpoint and a new
    v2 (0.6) was promoted. A resume at v2 read the discarded v2's 0.9 as the best promoted reference."""
    import types

    s = lambda k: [1.0] * k + [0.0] * (20 - k)  # noqa: E731
    gate = make_gate(tmp_path, s(10), s(12), s(18), s(12), guard_replies=0)
    gate.baseline(0, "unused", None)
    gate.judge(1, *gate.probe("unused", None))
    gate.judge(2, *gate.probe("unused", None))
    gate.after_learner_rebuild(types.SimpleNamespace(learners=FakeLearners()), 1)
    gate.judge(2, *gate.probe("unused", None))
    resumed = make_gate(tmp_path)
    assert resumed.resume(2)
    assert sum(resumed.promoted_scores) / 20 == pytest.approx(0.6)
    assert sum(resumed.best_scores) / 20 == pytest.approx(0.6) and resumed.best in (1, 2)


def test_a_resume_says_when_the_checkpoints_learning_rate_goes_on_over_a_changed_learner_lr(tmp_path, capsys):
    """resume=true restores the optimizer and the schedule (their learning rate, back-offs included),
    so a changed learner.lr does not apply: it was silent, now the resume says so."""
    import dataclasses
    import json
    import types

    import clawray.resume as resume_mod
    from clawray.resume import Checkpoints, LoopState

    run = str(tmp_path)
    ckpt = tmp_path / "checkpoints" / "ckpt-000001"
    ckpt.mkdir(parents=True)
    st = LoopState.from_config(load_config([], [f"run_dir={run}"]))
    saved = {"version": 3, "steps_done": 3, "all_masked_dropped": 0, "skipped_steps": {}}
    saved.update({k: dataclasses.asdict(getattr(st, k)) for k in ("guard", "entropy", "behaviour")})
    (ckpt / "driver.json").write_text(json.dumps(saved))
    (tmp_path / "checkpoints" / "latest").write_text("ckpt-000001\n")
    for lr, said in ((2e-5, True), (1e-3, False)):
        cfg = load_config([], [f"run_dir={run}", "resume=true", f"learner.lr={lr}"])
        worker = types.SimpleNamespace(load_checkpoint=types.SimpleNamespace(remote=lambda p: {"base_lr": 1e-3}))
        actors = types.SimpleNamespace(
            learner_workers=[worker],
            queue=types.SimpleNamespace(stats=types.SimpleNamespace(remote=lambda: {"size": 0})),
            weight_sync=types.SimpleNamespace(sync=lambda v: {"ok": True}),
        )
        ckpts = Checkpoints(cfg, LoopState.from_config(cfg), actors)
        ckpts._resume_path = str(ckpt)
        orig = resume_mod.ray
        resume_mod.ray = types.SimpleNamespace(get=lambda x, timeout=None: x)
        try:
            ckpts.restore()
        finally:
            resume_mod.ray = orig
        out = capsys.readouterr().out
        assert ("goes on from the checkpoint's schedule (base 0.001" in out) is said, out

"""`conf/opd.yaml` and `conf/combine.yaml` run the whole loop (tiny model): simulated users, hint
judge, frozen teacher scoring, FSDP2 update with the OPD term, weight sync."""

import json

import pytest

from clawray.driver import Driver
from conftest import tiny_run_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "preset, extra",
    [
        # self-distillation (the teacher is the synced rollout engine); the premise probe runs, says,
        # and training goes on
        ("conf/opd.yaml", ["opd.teacher=live", "opd.premise_check=warn"]),
        ("conf/combine.yaml", ["opd.premise_check=none"]),
        ("conf/opd.yaml", ["opd.loss=topk", "opd.topk=8", "opd.premise_check=none"]),
    ],
)
def test_distillation_presets_complete_two_updates(ray_cluster, tiny_model, tmp_path, preset, extra):
    cfg = tiny_run_config(
        tiny_model,
        tmp_path,
        presets=[preset],
        overrides=extra
        + [
            "trainer.num_steps=2",
            "learner.num_workers=1",  # FSDP across ranks is the learner and chaos tests' (a setup costs 7 s less)
            "trainer.batch_timeout_s=180",
            "env.concurrency=2",
            "env.max_tokens=12",
            "env.max_turns=2",
            "learner.lr=1e-3",
            "wandb.mode=disabled",
        ],
    )
    d = Driver(cfg)
    try:
        d.setup()
        if "opd.teacher=live" in extra:
            assert d.actors.teacher_engine is d.actors.engines[0]
        else:
            assert d.actors.teacher_engine is not None and d.actors.teacher_engine not in d.actors.engines
        summary = d.run()
        algo = cfg.trainer.algo
        assert summary["policy_version"] == 2 and summary["engine_versions"] == [2]
        sessions = summary["sessions"]
        assert sessions["hints_accepted"] >= 1 and sessions["samples"] >= 4
        rows = [json.loads(line) for line in open(tmp_path / "records" / "judgments.jsonl")]
        hinted = [r for r in rows if r.get("hint")]
        assert hinted and all(len(r["hint"]) > cfg.opd.min_hint_chars for r in hinted)
        if algo == "opd":
            assert all(r["score"] is None for r in rows)  # OPD casts no PRM vote
        else:
            assert any(k.startswith("dispatch/") for k in sessions)
        metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
        probed = "opd.premise_check=warn" in extra
        assert [m["policy_version"] for m in metrics] == ([0, 1, 2] if probed else [1, 2])
        if probed:  # the probe's row: the brief task's 16 held-out prompts, the tiny teacher sampled
            assert d.premise.probed == 16 and d.premise.verdict in ("informative", "inconclusive", "anti-informative")
            assert metrics[0]["step"] == 0 and metrics[0]["premise/items"] == len(d.premise.items) >= 4
            assert 0 <= metrics[0]["premise/solved_hinted"] <= 1
            metrics = metrics[1:]
        last = metrics[-1]
        assert 0 < last["judge/hint_acceptance_rate"] <= 1 and last["judge/mean_hint_chars"] > cfg.opd.min_hint_chars
        assert last["teacher/scored"] >= 1 and last["timing/teacher_scoring_s"] > 0
        if algo == "combine":
            assert last["judge/votes_per_turn"] == 1.0 and last["judge/agreement_rate"] == 1.0
    finally:
        d.shutdown()

"""The CPU twin of launch/gpu_check.sh: the whole loop over the ``ipc`` weight transport.

Its own module: a second Driver needs Serve to itself (test_loop.py keeps one running for its module).
"""

import json

import pytest

from clawray.driver import Driver
from conftest import tiny_run_config

pytestmark = pytest.mark.slow


def test_loop_over_the_ipc_transport_logs_sync_and_generation_throughput(ray_cluster, tiny_model, tmp_path):
    """The CPU twin of launch/gpu_check.sh: the real Driver with sync.transport=ipc (shared-memory
    handles between the learner and the engine) and sync.mode=inflight (no pause: the engine loads
    between two steps) trains 2 steps, the engine ends on v2, and every step logs the figures
    gpu_check.sh prints."""
    cfg = tiny_run_config(
        tiny_model,
        tmp_path / "run",
        overrides=[
            "sync.transport=ipc",
            "sync.mode=inflight",
            "learner.num_workers=1",  # FSDP across ranks is the learner and chaos tests' (a setup costs 7 s less)
            "trainer.num_steps=2",
            "trainer.batch_timeout_s=180",
            "env.concurrency=2",
            "env.max_tokens=16",
            "env.max_turns=2",
            "wandb.mode=disabled",
        ],
    )
    d = Driver(cfg)
    try:
        d.setup()
        summary = d.run()
        assert summary["policy_version"] == 2 and summary["engine_versions"] == [2]
        lines = [json.loads(line) for line in open(f"{d.run_dir}/metrics.jsonl")]
        assert [m["policy_version"] for m in lines] == [1, 2]
        for m in lines:
            assert m["sync/ok"] == 1.0 and m["timing/weight_sync_s"] > 0 and m["sync/gbytes_per_s"] > 0
            assert m["rollout/tokens"] > 0 and m["rollout/tokens_per_s"] > 0
            # inflight: nothing paused or interrupted; requests waited only for the load
            assert m["sync/interrupted_requests"] == 0.0 and m["sync/pause_s"] == m["sync/load_s_max"] > 0
            assert m["sync/inflight_requests"] >= 0.0
    finally:
        d.shutdown()

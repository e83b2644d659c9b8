"""``trainer.overlap: false``, the serial loop (the baseline of ``bench/loop_throughput.py``): the
real Driver, Serve endpoint, simulated users, judge, queue, learners and weight sync on the tiny model,
with no simulated-user request in flight during any train step or weight sync (checked on wall-clock
timestamps: the users' request log against the driver's timeline)."""

import pytest
import ray

from clawray.driver import Driver
from conftest import tiny_run_config

pytestmark = pytest.mark.slow


def test_serial_loop_never_generates_while_it_trains_or_syncs(ray_cluster, tiny_model, tmp_path):
    cfg = tiny_run_config(
        tiny_model,
        tmp_path / "run",
        overrides=[
            "trainer.overlap=false",
            "learner.num_workers=1",  # FSDP across ranks is the learner and chaos tests' (a setup costs 7 s less)
            "trainer.num_steps=2",
            "trainer.batch_timeout_s=180",
            "env.concurrency=4",
            "env.max_tokens=16",
            "wandb.mode=disabled",
        ],
    )
    d = Driver(cfg)
    try:
        d.setup()
        d.users.start(d.base_url)
        rows = [d.step() for _ in range(cfg.trainer.num_steps)]
        sim = d.users.pool
        requests = ray.get(sim.request_log.remote())
        d.users.stop()
    finally:
        d.shutdown()
    phases = list(d.timeline.spans)
    assert [p for p, _, _ in phases] == ["train", "sync"] * 2
    assert d.version == 2, [r["skipped"] for r in rows]
    assert len(requests) >= 2 * cfg.trainer.batch_size, requests  # at least two batches' worth of turns
    overlaps = [(p, a, b, s, e) for p, a, b in phases for s, e in requests if s < b and e > a]
    assert overlaps == [], (phases, requests)

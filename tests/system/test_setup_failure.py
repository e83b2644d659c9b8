"""A run whose setup fails part-way releases everything it created (actors, placement group)."""

import time

import pytest
import ray
from ray import serve
from ray.util.state import list_actors

from clawray.driver import Driver
from clawray.serve.instance import APP_NAME
from clawray.serve.instance import serve_running
from conftest import tiny_run_config


def _alive_actors(cluster: dict) -> set[str]:
    return {
        a.actor_id for a in list_actors(address=cluster["dashboard"], filters=[("state", "=", "ALIVE")], limit=10_000)
    }


@pytest.mark.slow
def test_driver_setup_failure_releases_actors_and_resources(ray_cluster, tiny_model, tmp_path):
    """The learners fail to start (LoRA on a module the model lacks) after the queue, engine, judge
    and session tracker exist: setup raises the learner's cause, and afterwards no actor it created
    is alive and the cluster's CPUs are back (the old code kept the engine and the placement group)."""
    cfg = tiny_run_config(
        tiny_model, tmp_path / "run", overrides=["learner.lora.rank=4", "learner.lora.target_modules=[no_such]"]
    )
    before_actors = _alive_actors(ray_cluster)
    before_cpus = ray.available_resources().get("CPU", 0.0)
    d = Driver(cfg)
    with pytest.raises(RuntimeError, match=r"learner rank \d of 2 failed to start: .*no_such"):
        d.setup()
    assert d.actors.engines and d.actors.queue is not None  # it failed part-way, after creating actors
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        _alive_actors(ray_cluster) - before_actors or ray.available_resources().get("CPU", 0.0) < before_cpus
    ):
        time.sleep(0.5)
    assert _alive_actors(ray_cluster) - before_actors == set()
    assert ray.available_resources().get("CPU", 0.0) >= before_cpus
    # the cluster's Serve was running before: the run deleted its app and left Serve running
    assert serve_running() and APP_NAME not in serve.status().applications
    d.close()  # a second shutdown is a no-op

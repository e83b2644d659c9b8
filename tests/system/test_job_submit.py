"""launch/submit.sh submits a short clawray run as a Ray job to a local head node."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import SERVE_PORT

pytestmark = pytest.mark.slow


def test_submit_script_runs_a_short_job(ray_cluster, tiny_model, tmp_path):
    env = {
        **os.environ,
        "RAY_ADDRESS": ray_cluster["dashboard"],
        "CLAWRAY_PYTHON": sys.executable,
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
    }
    run_dir = tmp_path / "job"
    cmd = [
        "bash",
        "launch/submit.sh",
        "conf/rl.yaml",
        "conf/cpu.yaml",
        f"model.path={tiny_model}",
        "rollout.backend=hf",
        "rollout.num_cpus=0.25",
        "rollout.torch_threads=1",
        "judge.backend=feedback",
        "trainer.batch_size=2",
        "trainer.num_steps=1",
        "trainer.batch_timeout_s=180",
        "env.concurrency=2",
        "env.max_tokens=16",
        "env.max_turns=2",
        "wandb.mode=disabled",
        f"serve.port={SERVE_PORT}",  # the cluster's Serve: the job deploys into it
        "trainer.max_batch_size=2",
        "eval.enabled=false",
        f"run_dir={run_dir}",
    ]
    for _ in range(40):  # the head's job agent can take a while to register on a loaded 2-core box
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        out = r.stdout + r.stderr
        if "No available agent to submit job" not in out:
            break
        time.sleep(3)
    assert r.returncode == 0, out[-4000:]
    assert "[clawray] step 1/1 | samples 2" in out and "succeeded" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["policy_version"] == 1 and summary["engine_versions"] == [1]


def test_submit_script_usage_errors():
    r = subprocess.run(["bash", "launch/submit.sh"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
    r = subprocess.run(["bash", "launch/submit.sh", "conf/nope.yaml"], capture_output=True, text=True)
    assert r.returncode == 2 and "config file not found" in r.stderr


def test_submit_script_refuses_a_config_outside_the_shipped_checkout(tmp_path):
    """Only the checkout travels to the cluster (--working-dir): a config file elsewhere would not exist there."""
    outside = tmp_path / "mine.yaml"
    outside.write_text("trainer: {num_steps: 1}\n")
    r = subprocess.run(["bash", "launch/submit.sh", "conf/rl.yaml", str(outside)], capture_output=True, text=True)
    assert r.returncode == 2 and f"config file {outside} is outside the checkout" in r.stderr

"""The seed's student/teacher scenario end to end on the tiny model (2 updates each, hf engine):
conf/student.yaml through the `clawray run` command (what the user sees: clawray's lines only,
before -> after, where the model is; the rest in job.log without ANSI codes), conf/teacher.yaml
through the driver in-process."""

import json
import os
import subprocess
import sys

import pytest

from conftest import SERVE_PORT, tiny_run_config
from test_gsm8k_env import GSM8K

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not os.path.isfile(GSM8K), reason=f"{GSM8K} is absent")]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cpu_overrides(tiny_model, run_dir):
    # the GPU presets on CPU: no GPUs, the tiny model; short replies and 2 updates of 2 samples
    return [
        f"model.path={tiny_model}",
        "rollout.backend=hf",
        "rollout.num_gpus=0",
        "learner.num_gpus=0",
        "rollout.num_cpus=0.25",
        "rollout.torch_threads=1",
        "learner.num_cpus=0.25",
        "learner.torch_threads=1",
        f"env.data_path={GSM8K}",
        "env.concurrency=2",
        "env.max_tokens=16",
        "env.max_turns=2",
        "trainer.batch_size=2",
        "trainer.num_steps=2",
        "trainer.batch_timeout_s=300",
        "learner.lr=1e-3",
        "eval.num_prompts=2",
        "eval.n=2",
        f"run_dir={run_dir}",
    ]


def test_student_preset_through_the_cli(ray_cluster, tiny_model, tmp_path):
    run_dir = tmp_path / "student"
    cmd = [
        sys.executable,
        "-m",
        "clawray.cli",
        "run",
        "conf/rl.yaml",
        "conf/student.yaml",
        *_cpu_overrides(tiny_model, run_dir),
        f"ray.address={ray_cluster['address']}",
        f"serve.port={SERVE_PORT}",  # the cluster's Serve: the job deploys into it
    ]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines and all(ln.startswith(("[clawray]", "clawray:")) for ln in lines), lines
    text = out.stdout
    assert (
        "[clawray] step 2/2" in text
        and "[clawray] eval on student eval (4 samples each): step 0 (v0) -> step 2 (v2)" in text
    )
    assert "graceful_shutdown failed" not in text + out.stderr
    ckpt = os.path.join(run_dir, "checkpoints", "ckpt-000001")
    assert f"[clawray] trained model (policy v2): {ckpt}/model" in text
    assert f"model.path={ckpt}/model" in text and f"clawray report {run_dir}" in text
    # model-only checkpoint (conf/student.yaml: checkpoint.save_optimizer=false): no train_state, not resumable
    assert os.path.isfile(os.path.join(ckpt, "model", "config.json"))
    assert not os.path.exists(os.path.join(ckpt, "train_state"))
    assert json.load(open(os.path.join(ckpt, "driver.json")))["resumable"] is False
    log = open(os.path.join(run_dir, "job.log")).read()
    assert "\x1b" not in log and "[clawray] step 1/2" in log and "graceful_shutdown failed" not in log
    evals = json.load(open(os.path.join(run_dir, "eval.json")))
    assert [e["step"] for e in evals] == [0, 2] and set(evals[0]["metrics"]) == {
        "solved",
        "correct",
        "shows_work",
        "natural",
    }


def test_teacher_preset_through_the_driver(ray_cluster, tiny_model, tmp_path):
    from clawray.driver import run

    cfg = tiny_run_config(
        tiny_model,
        tmp_path / "teacher",
        presets=["conf/teacher.yaml"],
        overrides=_cpu_overrides(tiny_model, tmp_path / "teacher") + ["eval.enabled=true"],
    )
    assert cfg.env.name == "teacher" and cfg.trainer.num_steps == 2
    summary = run(cfg)
    assert summary["steps"] == 2 and summary["policy_version"] == 2
    assert [e["step"] for e in summary["eval"]] == [0, 2]
    assert set(summary["eval"][0]["metrics"]) == {"solved", "specific", "friendly"}
    assert summary["sim_user"]["sessions"] >= 1 and summary["sim_user"].get("errors", 0) == 0

"""bench/gpu_paths.py, the GPU window's script, run on the CPU on the tiny model with the Ray stub:
every check passes and reports the figures the window is for (it must work the first time it meets a
GPU, so it runs here on every CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_gpu_paths_script_runs_every_check_on_the_cpu(tmp_path):
    out = tmp_path / "figures.json"
    cmd = [sys.executable, "bench/gpu_paths.py", "--device", "cpu", "--stub-ray", "--prompts", "3"]
    proc = subprocess.run(
        [*cmd, "--max-tokens", "8", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert list(figures) == [
        "1 machine",
        "2 learner group",
        "3 engine bfloat16 vs learner",
        "4 engine float32 vs learner",
        "5 three PPO updates",
        "6 learner weights into the engine",
    ]
    assert figures["2 learner group"]["backend"] == "gloo"
    assert figures["2 learner group"]["param_dtype"] == "torch.float32"
    # the float32 engine and the float32 learner compute the same log-probs; bf16 sampling does not
    fp32, bf16 = figures["4 engine float32 vs learner"], figures["3 engine bfloat16 vs learner"]
    assert fp32["mismatch_kl"] < 1e-9 < bf16["mismatch_kl"]
    assert fp32["tokens"] == bf16["tokens"] == 24  # 3 replies of 8 tokens (the tiny model has no eos in 8)
    # on the CPU the learner is fp32: an fp32 scorer of the bf16 engine's replies sees the learner's gap
    assert abs(fp32["bf16_engine_vs_fp32_scorer_kl"] - bf16["mismatch_kl"]) <= 0.01 * bf16["mismatch_kl"]
    updates = figures["5 three PPO updates"]
    assert len(updates["steps"]) == 3 and updates["tensors_moved"] == updates["tensors"]
    assert figures["6 learner weights into the engine"]["mismatched"] == []
    assert "| 6 learner weights into the engine | ok |" in proc.stdout

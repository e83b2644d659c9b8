"""One run per run folder (issue #27.1): a second run in the folder of a live run is refused with a
message naming the owner, before it reads, prunes or replaces anything there; a dead owner's lock is
gone with its process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from clawray.checkpoint import set_aside
from clawray.run_lock import LOCK_FILE, RunFolderInUse, RunFolderLock, checkpoint_folder_lock

HOLD = """
import sys, time
from clawray.run_lock import RunFolderLock, checkpoint_folder_lock
(checkpoint_folder_lock if sys.argv[2:] == ["checkpoints"] else RunFolderLock)(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(run_dir, *kind):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), *kind], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_lock_is_refused_until_the_first_is_released(tmp_path):
    first, second = RunFolderLock(str(tmp_path)), RunFolderLock(str(tmp_path))
    first.acquire()
    with pytest.raises(RunFolderInUse, match=rf"in use by another clawray run \(pid {os.getpid()} on "):
        second.acquire()
    assert first.held and not second.held
    first.release()
    first.release()  # idempotent
    second.acquire()
    assert second.held and oct(os.stat(tmp_path / LOCK_FILE).st_mode & 0o777) == "0o600"
    second.release()


def test_a_killed_owner_frees_the_folder(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(RunFolderInUse, match=rf"pid {proc.pid} on"):
            RunFolderLock(str(tmp_path)).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    lock = RunFolderLock(str(tmp_path))
    lock.acquire()  # the stale file does not block a resume
    lock.release()


def test_a_driver_in_a_live_runs_folder_is_refused_and_touches_nothing(tmp_path, tiny_model, monkeypatch):
    """The issue's input: a fresh run started in the folder of a live one deleted its journal. Now
    setup stops at the lock: the live run's journal and checkpoints are byte-identical after it. On a
    Ray cluster the live run shares (bench/chaos.py's second-run: one process), the refused run's
    shutdown used to stop the live run's Serve: it stops only what it started."""
    import clawray.serve.instance
    from clawray import driver as driver_module
    from clawray.driver import Driver
    from conftest import tiny_run_config

    stopped = []
    monkeypatch.setattr(clawray.serve.instance, "shutdown_serve", lambda: stopped.append("serve"))
    monkeypatch.setattr(driver_module.ray, "is_initialized", lambda: True)  # the live run's Ray

    run_dir = tmp_path / "run"
    (run_dir / "journal").mkdir(parents=True)
    (run_dir / "checkpoints" / "ckpt-000001").mkdir(parents=True)
    journal = run_dir / "journal" / "samples.jsonl"
    journal.write_text('{"seq": 1}\n')
    proc = _holder(run_dir)
    try:
        d = Driver(tiny_run_config(tiny_model, run_dir))
        t0 = time.monotonic()
        with pytest.raises(RunFolderInUse, match=rf"run folder {run_dir} is in use .*pid {proc.pid}.*own run_dir="):
            d.setup()
        assert time.monotonic() - t0 < 30
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert journal.read_text() == '{"seq": 1}\n'
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["ckpt-000001"]
    assert stopped == []


def test_a_checkpoint_folder_is_locked_beside_it_so_setting_it_aside_keeps_the_lock(tmp_path):
    folder = tmp_path / "ckpts"
    lock = checkpoint_folder_lock(str(folder))
    assert lock.path == str(tmp_path / ".ckpts.clawray.lock")
    lock.acquire()  # the folder need not exist yet
    (folder / "ckpt-000001").mkdir(parents=True)
    moved = set_aside(str(folder))  # a fresh run's own setting aside of an earlier run's checkpoints
    assert moved and not folder.exists() and os.listdir(moved) == ["ckpt-000001"]
    with pytest.raises(RunFolderInUse, match=rf"checkpoint folder {folder} is in use .*own checkpoint.dir="):
        checkpoint_folder_lock(str(folder)).acquire()  # still held: the lock did not travel with the folder
    lock.release()
    again = checkpoint_folder_lock(str(folder))
    again.acquire()
    again.release()


def test_a_driver_sharing_a_live_runs_checkpoint_folder_is_refused_and_touches_nothing(tmp_path, tiny_model):
    """Two run folders, one checkpoint.dir: the second run's setup would have set the live run's
    checkpoints aside (a fresh run) or pruned them; it stops at the checkpoint folder's lock."""
    from clawray.driver import Driver
    from conftest import tiny_run_config

    live = tmp_path / "live"
    (live / "checkpoints" / "ckpt-000001").mkdir(parents=True)
    proc = _holder(live / "checkpoints", "checkpoints")
    try:
        d = Driver(tiny_run_config(tiny_model, tmp_path / "second", overrides=[f"checkpoint.dir={live}/checkpoints"]))
        with pytest.raises(RunFolderInUse, match=rf"checkpoint folder {live}/checkpoints is in use .*pid {proc.pid}"):
            d.setup()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert sorted(os.listdir(live / "checkpoints")) == ["ckpt-000001"]
    assert not d._run_lock.held and not d._checkpoint_lock.held  # the refused run gave its own folder back

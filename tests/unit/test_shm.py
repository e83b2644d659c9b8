"""clawray.weight_sync.shm: the ipc transport's CPU buffers are 0600 files named by their creator's
pid, mapped (not copied) by a handle in another process, and removed once the creator is gone."""

import os
import pickle
import stat
import subprocess
import sys

import pytest
import torch

from clawray.weight_sync import shm


def _files(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith(shm.PREFIX))


def test_a_buffer_is_a_private_file_another_process_maps_and_writes_through(tmp_path):
    flat, handle = shm.create(6, torch.bfloat16, directory=str(tmp_path))
    try:
        (name,) = _files(tmp_path)
        assert name.startswith(f"{shm.PREFIX}{os.stat('/proc/self/ns/pid').st_ino}-{os.getpid()}-")
        assert os.path.getsize(tmp_path / name) == 12  # 6 x 2 bytes
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
        flat.copy_(torch.arange(6, dtype=torch.bfloat16))
        code = (
            "import pickle, sys, torch\n"
            "t = pickle.loads(sys.stdin.buffer.read())\n"
            "print(t.dtype, t.tolist())\n"
            "t[0] = 42\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], input=pickle.dumps(handle), capture_output=True, check=True
        ).stdout.decode()
        assert out.strip() == "torch.bfloat16 [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]"
        assert flat[0].item() == 42.0  # the other process wrote into this very memory
    finally:
        shm.remove(handle.path)
    assert _files(tmp_path) == []


def test_a_handle_never_creates_a_missing_or_reshaped_file(tmp_path):
    flat, handle = shm.create(4, torch.float32, directory=str(tmp_path))
    with pytest.raises(ValueError, match="holds 16 bytes where 5 x float32 is 20"):
        shm.open_handle(handle.path, 5, "float32")
    shm.remove(handle.path)
    with pytest.raises(FileNotFoundError):
        pickle.loads(pickle.dumps(handle))
    assert _files(tmp_path) == []
    assert flat.tolist() == [0.0] * 4  # the creator's mapping outlives the name


def test_the_sweep_removes_only_files_of_processes_that_are_gone(tmp_path):
    # a creator killed before it could clean up (as Ray stops a sender): its file stays ...
    code = (
        "import os, sys, torch\n"
        "from clawray.weight_sync import shm\n"
        "shm.create(3, torch.float32, directory=sys.argv[1])\n"
        "os.kill(os.getpid(), 9)\n"
    )
    dead = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert dead.returncode == -9
    (left,) = _files(tmp_path)
    _, mine = shm.create(3, torch.float32, directory=str(tmp_path))
    untouched = [f"{shm.PREFIX}notapid-0-0", left.replace(f"{shm.PREFIX}", f"{shm.PREFIX}1", 1)]
    for name in untouched:  # not one of ours by its name; a dead pid of another pid namespace
        (tmp_path / name).write_bytes(b"")
    try:
        # ... until a sweep, which leaves the live creator's (this process's) file alone
        assert shm.sweep(str(tmp_path)) == [str(tmp_path / left)]
        assert _files(tmp_path) == sorted([os.path.basename(mine.path), *untouched])
        assert shm.sweep(str(tmp_path)) == []
    finally:
        shm.remove(mine.path)


def test_a_process_that_exits_normally_removes_its_own(tmp_path):
    code = (
        "import sys, torch\n"
        "from clawray.weight_sync import shm\n"
        "shm.create(3, torch.float32, directory=sys.argv[1])\n"
        "shm.create(5, torch.float32, directory=sys.argv[1])\n"
        "print(len(shm._OWN))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        capture_output=True,
        check=True,
    ).stdout.decode()
    assert out.strip() == "2"
    assert _files(tmp_path) == []

"""Damaged files at resume (issue #27.3): checkpoints are verified against their manifest and a
damaged newest one falls back to the newest intact one, said; a damaged journal line is named by
file and line; a torn last line is said, not silent."""

from __future__ import annotations

import json
import os

import pytest

from clawray.checkpoint import (
    MANIFEST,
    DamagedFileError,
    commit_checkpoint,
    latest_intact_checkpoint,
    new_checkpoint_dirs,
    verify_checkpoint,
    write_manifest,
)
from clawray.journal import SESSIONS_FILE, SampleJournal, prepare_journals, read_records


def _checkpoint(root, steps, weights=b"w" * 1000):
    tmp, final = new_checkpoint_dirs(str(root))
    os.makedirs(os.path.join(tmp, "model"))
    with open(os.path.join(tmp, "model", "model.safetensors"), "wb") as f:
        f.write(weights)
    with open(os.path.join(tmp, "driver.json"), "w") as f:
        json.dump({"steps_done": steps, "version": steps}, f)
    write_manifest(tmp)
    return commit_checkpoint(tmp, final, keep_last=3)


def test_manifest_verifies_sizes_and_crcs(tmp_path):
    path = _checkpoint(tmp_path, 1)
    manifest = json.load(open(os.path.join(path, MANIFEST)))["files"]
    assert sorted(manifest) == ["driver.json", "model/model.safetensors"]
    assert manifest["model/model.safetensors"] == {"size": 1000, "crc32": 2810990746}  # zlib.crc32(b"w" * 1000)
    assert verify_checkpoint(path) is None
    weights = os.path.join(path, "model", "model.safetensors")
    with open(weights, "r+b") as f:
        f.write(b"x")  # same size, other bytes
    assert verify_checkpoint(path) == "model/model.safetensors does not match its CRC-32"
    with open(weights, "r+b") as f:
        f.truncate(10)
    assert verify_checkpoint(path) == "model/model.safetensors is 10 bytes, 1000 were written"
    os.remove(weights)
    assert verify_checkpoint(path) == "model/model.safetensors is missing"


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path):
    first, second, third = (_checkpoint(tmp_path, s) for s in (1, 2, 3))
    with open(os.path.join(third, "model", "model.safetensors"), "r+b") as f:
        f.truncate(500)
    with open(os.path.join(second, "driver.json"), "w") as f:
        f.write('{"steps_done": 2, "ver')  # torn: also breaks the manifest's size
    lines = []
    assert latest_intact_checkpoint(str(tmp_path), lines.append) == first
    assert lines == [
        f"[clawray] checkpoint {third} is damaged (model/model.safetensors is 500 bytes, 1000 were written): not resumed from",
        f"[clawray] checkpoint {second} is damaged (driver.json is 22 bytes, 31 were written): not resumed from",
        f"[clawray] resume falls back to {first}, the newest intact checkpoint",
    ]
    os.remove(os.path.join(first, "model", "model.safetensors"))
    with pytest.raises(
        DamagedFileError,
        match=r"every checkpoint in .* is damaged: ckpt-000003: .*; ckpt-000002: .*; ckpt-000001: model/model.safetensors is missing",
    ):
        latest_intact_checkpoint(str(tmp_path), lines.append)


def test_a_checkpoint_without_manifest_needs_a_readable_driver_json(tmp_path):
    path = _checkpoint(tmp_path, 1)
    os.remove(os.path.join(path, MANIFEST))
    assert verify_checkpoint(path) is None
    with open(os.path.join(path, "driver.json"), "w") as f:
        f.write("{")
    assert verify_checkpoint(path) == "driver.json is unreadable (JSONDecodeError)"
    assert latest_intact_checkpoint(str(tmp_path / "none")) is None


def test_journal_lines_damaged_in_the_middle_are_named_and_a_torn_last_line_is_said(tmp_path):
    paths = prepare_journals(str(tmp_path), None)
    j = SampleJournal(paths["samples"], fsync=False)
    j.file.close()
    path = paths["samples"]
    with open(path, "w") as f:
        f.write('{"op":"drop","reason":"stale","seqs":[],"n":1}\n' * 3 + '{"op":"ack","seq":7,"vers')
    said = []
    assert len(read_records(path, said.append)) == 3
    assert said == [
        f"[clawray] journal {path}: line 4, the last, is torn (a write cut by the process's end, never acknowledged): ignored"
    ]
    with open(path, "w") as f:
        f.write(
            '{"op":"drop","reason":"stale","seqs":[],"n":1}\n'
            + "garbage\n"
            + '{"op":"drop","reason":"stale","seqs":[],"n":1}\n'
        )
    with pytest.raises(DamagedFileError, match=rf"journal {path}: line 2 of 3 is not a complete record"):
        read_records(path)
    with open(path, "w") as f:
        f.write("[1, 2]\n{}\n")  # JSON, but not a record
    with pytest.raises(DamagedFileError, match="line 1 of 2"):
        read_records(path)
    # the sessions journal is checked before any actor starts (it used to surface as a Serve error)
    os.remove(path)
    with open(os.path.join(os.path.dirname(path), SESSIONS_FILE), "w") as f:
        f.write("{}\nnot json\n{}\n")
    with pytest.raises(DamagedFileError, match=rf"{SESSIONS_FILE}: line 2 of 3"):
        prepare_journals(str(tmp_path), resume_step=0)


def test_a_pruned_checkpoint_leaves_the_checkpoints_before_it_is_deleted(tmp_path, monkeypatch):
    """A crash inside the pruning rmtree left ``ckpt-000001`` without its manifest and weights but with
    its driver.json, which verification passed and a fallback resumed from. The pruned folder is now
    renamed out of the checkpoints first; the next checkpoint sweeps what a crash left."""
    import clawray.checkpoint as checkpoint

    first = _checkpoint(tmp_path, 1)
    removed = []
    monkeypatch.setattr(
        checkpoint.shutil, "rmtree", lambda path, **kw: removed.append(path)
    )  # crashes: nothing removed
    tmp, final = new_checkpoint_dirs(str(tmp_path))
    with open(os.path.join(tmp, "driver.json"), "w") as f:
        json.dump({"steps_done": 2, "version": 2}, f)
    write_manifest(tmp)
    commit_checkpoint(tmp, final, keep_last=1)
    assert [os.path.basename(p) for p in removed] == [f".tmp-ckpt-pruned-ckpt-000001-{os.getpid()}"]
    assert not os.path.exists(first) and checkpoint.list_checkpoints(str(tmp_path)) == [final]
    monkeypatch.undo()
    new_checkpoint_dirs(str(tmp_path))  # the next checkpoint's sweep
    assert sorted(n for n in os.listdir(tmp_path) if "pruned" in n) == []

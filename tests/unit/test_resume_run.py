"""A resume continues the run whose journal is in the folder: never an earlier run's checkpoint, never
from the initial policy once a checkpoint covered the journal, never after rewriting the journal for a
checkpoint it then refuses (``clawray.resume.Checkpoints``, before any actor starts)."""

import json
import os

import pytest
from omegaconf import OmegaConf

from clawray.checkpoint import commit_checkpoint, latest_checkpoint, new_checkpoint_dirs, write_manifest
from clawray.journal import SampleJournal, SampleState, read_records
from clawray.resume import Checkpoints
from clawray.types import Sample


def _cfg(run_dir, resume, ckpt_dir=""):
    return OmegaConf.create(
        {
            "run_dir": str(run_dir),
            "resume": resume,
            "checkpoint": {"dir": str(ckpt_dir)},
            "queue": {"journal_fsync": False, "journal_compact_mb": 64},
        }
    )


def _checkpoint(root, steps, resumable=True):
    tmp, final = new_checkpoint_dirs(str(root))
    with open(os.path.join(tmp, "driver.json"), "w") as f:
        json.dump({"steps_done": steps, "version": steps, "resumable": resumable}, f)
    write_manifest(tmp)
    return commit_checkpoint(tmp, final)


def _sample(i):
    return Sample(tokens=[5, 6, 100 + i], prompt_len=2, loss_mask=[1], rollout_logprobs=[-1.0], reward=1.0,
                  policy_version=0, session_id=f"s{i}", turn_index=1)  # fmt: skip


def _prepare(cfg) -> str:
    return Checkpoints(cfg, None, None).prepare_journals()["samples"]["path"]


def test_a_fresh_run_sets_the_earlier_runs_checkpoints_aside_and_its_resume_continues_its_own_journal(tmp_path):
    """Run A left a checkpoint of step 20 (v20); run B started fresh in the same folder, trained step
    1 on samples 1 and 2 and died before its first checkpoint. ``resume=true`` loaded A's checkpoint
    for B: samples 1 and 2 counted as covered (lost), 3 and 4 (v0) queued behind a v20 policy."""
    run = tmp_path / "run"
    a = _checkpoint(run / "checkpoints", 20)
    path = _prepare(_cfg(run, False))  # run B, fresh
    aside = [n for n in os.listdir(run) if n.startswith("checkpoints.earlier-")]
    assert len(aside) == 1 and sorted(os.listdir(run / aside[0])) == ["ckpt-000001", "latest"]  # A's, kept whole
    assert latest_checkpoint(str(run / "checkpoints")) is None and not os.path.exists(a)
    j = SampleJournal(path)
    for i in (1, 2, 3, 4):
        j.ack(_sample(i), 0)
    j.consume([1, 2], step=1, trained=True)
    j.file.close()
    Checkpoints(_cfg(run, True), None, None).check_resumable()
    path = _prepare(_cfg(run, True))  # no checkpoint of B's: from the initial policy, the whole journal
    assert [s.session_id for _, s, _ in SampleJournal(path).replay()] == ["s1", "s2", "s3", "s4"]
    assert _prepare(_cfg(run, False)) and len([n for n in os.listdir(run) if n.startswith("checkpoints.")]) == 1


def test_a_resume_without_the_checkpoint_that_covered_the_journal_is_refused_before_anything_starts(tmp_path):
    """A relative ``checkpoint.dir`` read from another working folder (or another run's) found no
    checkpoint, and the resume silently started over from v0 on a journal whose first steps a
    checkpoint had covered (their samples forgotten): those trained samples were lost."""
    run = tmp_path / "run"
    path = _prepare(_cfg(run, False, tmp_path / "ck"))
    j = SampleJournal(path)
    for i in (1, 2, 3):
        j.ack(_sample(i), 0)
    j.consume([1, 2], step=2, trained=True)
    j.forget(2)  # the checkpoint of step 2 (in tmp_path/ck) covers samples 1 and 2
    j.file.close()
    for ckpt_dir in (tmp_path / "elsewhere", ""):
        cfg = _cfg(run, True, ckpt_dir)
        with pytest.raises(FileNotFoundError, match="was covered by a checkpoint of step 2: starting over"):
            Checkpoints(cfg, None, None).check_resumable()
        with pytest.raises(FileNotFoundError, match="was covered by a checkpoint of step 2"):
            _prepare(cfg)
    state = SampleState.from_records(read_records(path))
    assert state.covered == 2 and SampleState.from_records(state.records()).covered == 2  # kept by a compaction
    _checkpoint(tmp_path / "ck", 2)  # with the run's checkpoint folder: resumed from step 2, sample 3 queued again
    Checkpoints(_cfg(run, True, tmp_path / "ck"), None, None).check_resumable()
    assert [s.session_id for _, s, _ in SampleJournal(_prepare(_cfg(run, True, tmp_path / "ck"))).replay()] == ["s3"]


def test_a_model_only_newest_checkpoint_is_refused_before_the_journal_is_rewritten(tmp_path):
    run = tmp_path / "run"
    path = _prepare(_cfg(run, False))
    j = SampleJournal(path)
    for i in (1, 2):
        j.ack(_sample(i), 0)
    j.consume([1, 2], step=21, trained=True)
    j.file.close()
    _checkpoint(run / "checkpoints", 20)
    _checkpoint(run / "checkpoints", 22, resumable=False)  # checkpoint.save_optimizer=false
    before = open(path).read()
    with pytest.raises(FileNotFoundError, match="ckpt-000002 was saved with checkpoint.save_optimizer=false"):
        _prepare(_cfg(run, True))
    assert open(path).read() == before  # step 21's consume mark not voided for a resume that never ran

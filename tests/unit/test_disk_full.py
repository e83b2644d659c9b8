"""A full disk (issue #27.2): every writer survives ENOSPC without a torn line, a request is still
answered, the run goes on, nothing acknowledged is lost, and the tracker says what is failing. The
disk is simulated by a fault-injecting ``os.write`` that writes part of a buffer, then refuses."""

from __future__ import annotations

import asyncio
import errno
import json
import os

import pytest

import clawray.records as records_mod
from clawray.records import JsonlRecords, append_whole

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


class FullDisk:
    """``os.write`` that writes ``room`` more bytes in all, then raises ENOSPC."""

    def __init__(self, room: int):
        self.room, self.real = room, os.write

    def __call__(self, fd, data):
        if self.room <= 0:
            raise ENOSPC
        n = self.real(fd, bytes(data[: self.room]))
        self.room -= n
        return n


def test_append_whole_cuts_a_partial_write_back(tmp_path, monkeypatch):
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'{"a":1}\n')
    fd = os.open(path, os.O_RDWR | os.O_APPEND)
    monkeypatch.setattr(records_mod.os, "write", FullDisk(5))
    with pytest.raises(OSError) as e:
        append_whole(fd, b'{"b":2222222}\n')
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert path.read_bytes() == b'{"a":1}\n'  # the 5 bytes written were cut back
    append_whole(fd, b'{"c":3}\n')
    os.close(fd)
    assert path.read_bytes() == b'{"a":1}\n{"c":3}\n'


def test_records_refused_by_the_disk_are_counted_not_raised(tmp_path, monkeypatch):
    rec = JsonlRecords(str(tmp_path / "records" / "turns.jsonl"), 1 << 20, 2)
    assert rec.append({"n": 1})
    monkeypatch.setattr(records_mod.os, "write", FullDisk(3))
    assert rec.append({"n": 2}) is False and rec.append({"n": 3}) is False
    assert (rec.write_errors, rec.error) == (2, "turns.jsonl: No space left on device")
    monkeypatch.undo()
    assert rec.append({"n": 4}) and rec.error is None
    assert [json.loads(x) for x in open(rec.path)] == [{"n": 1}, {"n": 4}]  # no torn line


def test_a_sample_the_journal_cannot_write_is_not_acknowledged_and_the_next_one_is(tmp_path, monkeypatch):
    from clawray.journal import SampleJournal, prepare_journals, read_records
    from clawray.types import Sample

    def sample(i):
        return Sample(
            tokens=[1, 2, 3],
            prompt_len=2,
            loss_mask=[1],
            rollout_logprobs=[-0.1],
            reward=1.0,
            policy_version=0,
            session_id=f"s{i}",
            turn_index=1,
        )

    paths = prepare_journals(str(tmp_path), None)
    j = SampleJournal(paths["samples"], fsync=True)
    assert j.ack(sample(0), 0) == 1
    monkeypatch.setattr(records_mod.os, "write", FullDisk(40))
    with pytest.raises(OSError):
        j.ack(sample(1), 0)
    monkeypatch.undo()
    assert not j.is_duplicate(sample(1)) and j.state.put == 1  # not acknowledged
    assert j.ack(sample(1), 0) == 2  # the disk has room again: acknowledged, next number
    j.file.close()
    said = []
    recs = read_records(paths["samples"], said.append)
    assert [r["seq"] for r in recs] == [1, 2] and said == []  # no torn line anywhere


def test_metrics_rows_the_disk_refuses_do_not_end_the_run(tmp_path, monkeypatch, capsys):
    from clawray.metrics_log import MetricsLog

    t = MetricsLog(str(tmp_path), "disabled", "p", "", {})
    t.log({"loss": 1.0}, step=1)
    monkeypatch.setattr(records_mod.os, "write", FullDisk(10))
    t.log({"loss": 2.0}, step=2)  # used to raise out of Driver.step and end the run
    monkeypatch.undo()
    t.log({"loss": 3.0}, step=3)
    assert t.write_errors == 1
    assert [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")] == [1, 3]
    assert "metrics.jsonl: step 2's row not written (No space left on device)" in capsys.readouterr().out


def test_the_tracker_answers_and_says_what_fails_while_the_disk_is_full(tmp_path, monkeypatch):
    """233 of 233 requests got 500 while /health said ok: now record_turns answers, the journal
    and records refusals are counted, and ``storage_failing`` names them until the disk has room."""
    from clawray.actors.session import SessionTracker
    from clawray.journal import prepare_journals
    from conftest import make_turn

    paths = prepare_journals(str(tmp_path), None)
    tracker = SessionTracker(
        [], None, records_dir=str(tmp_path / "records"), journal={"path": paths["sessions"], "fsync": False}
    )

    async def go():
        first = await tracker.record_turns([make_turn("a", [{"role": "user", "content": "hi"}], "hello")])
        monkeypatch.setattr(records_mod.os, "write", FullDisk(0))
        second = await tracker.record_turns([make_turn("b", [{"role": "user", "content": "yo"}], "hey")])
        full = await tracker.stats()
        monkeypatch.undo()
        third = await tracker.record_turns([make_turn("c", [{"role": "user", "content": "ok"}], "fine")])
        return first, second, full, third, await tracker.stats()

    first, second, full, third, after = asyncio.run(go())
    assert (first, second, third) == ([1], [1], [1])
    assert full["storage_failing"] == [
        "sessions journal: No space left on device",
        "turns.jsonl: No space left on device",
    ]
    assert (full["storage_errors"], full["records_write_errors"]) == (1, 1)
    assert after["storage_failing"] == [] and after["turns"] == 3
    turns = [json.loads(x)["session_id"] for x in open(tmp_path / "records" / "turns.jsonl")]
    assert turns == ["a", "c"]


def test_the_driver_waits_for_the_disk_to_record_a_consumed_batch(monkeypatch, capsys):
    """bench/chaos.py disk-full: the queue's journal refused step 2's ``consumed`` mark and the
    RayTaskError(OSError) ended the run. The driver now retries the mark until it is written (a
    skipped mark would train the batch again after a resume)."""
    from types import SimpleNamespace

    import clawray.resume as resume

    monkeypatch.setattr(resume, "JOURNAL_RETRY_S", 0.01)
    monkeypatch.setattr(resume.ray, "get", lambda v: v)
    tries = []

    def mark():
        tries.append(1)
        if len(tries) <= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return None

    d = SimpleNamespace(journal_waits=0)
    resume.Checkpoints.mark(d, mark, "step 2's batch")
    assert len(tries) == 3 and d.journal_waits == 1
    assert capsys.readouterr().out.splitlines() == [
        "[clawray] sample journal: step 2's batch cannot be recorded (No space left on device); training "
        "waits for the disk, retrying every 0.01 s",
        "[clawray] sample journal: step 2's batch recorded after 0 s",
    ]

    def broken():
        raise ValueError("not a disk error")

    with pytest.raises(ValueError):
        resume.Checkpoints.mark(d, broken, "x")


@pytest.mark.parametrize(
    "keep_last, checkpoints, forgets",
    [
        (2, [1, 3], [1]),  # the previous kept checkpoint (step 1) may still be resumed from
        (0, [1, 3, 5], [3]),
        (1, [3], [3]),  # nothing older is kept: the newest covers it all
        (2, [3], [3]),  # the first checkpoint
    ],
)
def test_the_journal_forgets_only_what_no_kept_checkpoint_needs(tmp_path, monkeypatch, keep_last, checkpoints, forgets):
    """bench/chaos.py damaged-files lost 7 acknowledged samples: the journal let go of the batches up to
    the newest checkpoint's step, so a fallback to the older one could not queue them again."""
    from types import SimpleNamespace

    import clawray.resume as resume

    monkeypatch.setattr(resume.ray, "get", lambda v: v)
    for i, step in enumerate(checkpoints):
        folder = tmp_path / f"ckpt-{i + 1:06d}"
        folder.mkdir()
        (folder / "driver.json").write_text(json.dumps({"steps_done": step}))
    forgot = []
    d = SimpleNamespace(
        dir=str(tmp_path),
        cfg=SimpleNamespace(checkpoint=SimpleNamespace(keep_last=keep_last)),
        actors=SimpleNamespace(queue=SimpleNamespace(forget=SimpleNamespace(remote=forgot.append))),
    )
    resume.Checkpoints.forget_covered(d, checkpoints[-1])
    assert forgot == forgets

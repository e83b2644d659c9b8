"""Append-only JSONL records with size-based rotation.

Owns: rotation, the whole-or-nothing append (:func:`append_whole`, which the journals and the metrics
log use too), the reading of such a file (:func:`read_jsonl`: a torn last line skipped) and the
``judgments.jsonl`` rows (a ``turns.jsonl`` row is
:meth:`~clawray.types.Turn.record`'s). Must not: fsync or promise durability (:mod:`clawray.journal`
does) or fail the request that made a record: a refused row is counted and left out whole.

A record file is only ever appended to; when a row would grow it past ``max_bytes`` the file is
rotated (``name`` -> ``name.1`` -> ``name.2`` ...; the oldest beyond ``keep_files`` is deleted) and
a fresh one is started. Files are created with mode 0600: they hold users' conversations.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable


class DamagedFileError(RuntimeError):
    """A file a resume needs is damaged or unreadable; the message names the file (and line) and
    what was found, never a traceback."""


def _line_end(fd: int, size: int, chunk: int = 1 << 16) -> int:
    """The length of the file at ``fd`` up to and including its last ``"\n"`` (0 when it has none)."""
    end = size
    while end > 0:
        start = max(0, end - chunk)
        block = os.pread(fd, end - start, start)
        at = block.rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


def append_whole(fd: int, data: bytes) -> None:
    """Append ``data`` (whole lines) to the file open at ``fd`` (``O_RDWR | O_APPEND``) whole or not at
    all: when the disk refuses part of it (ENOSPC, EIO, a quota), the file is cut back to its size
    before the write, so a reader never meets a torn line and a later append starts on a line
    boundary. A torn last line left by a process killed mid-write (a line without its ``"\n"``, which
    readers skip as never acknowledged) is cut first, so the new line is not glued onto it (it would be
    lost with it, and the damaged line would no longer be the last: a damaged file).

    Raises:
        OSError: the write failed (nothing of ``data`` stays in the file), or ``fd`` is not readable.
    """
    start = os.fstat(fd).st_size
    if start and os.pread(fd, 1, start - 1) != b"\n":
        start = _line_end(fd, start)
        os.ftruncate(fd, start)
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        try:
            os.ftruncate(fd, start)
        except OSError:  # the write's own error is the one to report
            pass
        raise


def read_jsonl(
    path: str, label: str, report: Callable[[str], None] | None = None, skip_damaged: bool = False
) -> list[dict]:
    """Every complete JSON object line of ``path``, a file written by :func:`append_whole` (``[]`` when
    it does not exist). A torn last line (a write the process died in, never acknowledged) is skipped,
    and said through ``report`` when given; so is a damaged line elsewhere with ``skip_damaged`` (a
    log a run can go on without, such as ``metrics.jsonl``).

    Args:
        label: what the file is, for the messages ("journal", "metrics").

    Raises:
        DamagedFileError: a line other than the last one is not a JSON object (the file is damaged)
            and ``skip_damaged`` is False; the message names the file and the line.
    """
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not an object")
        except ValueError:
            if i >= len(lines) - 2:  # the last line (a file ends with "\n", so the split's last part is b"")
                if report is not None:
                    report(
                        f"[clawray] {label} {path}: line {i + 1}, the last, is torn (a write cut by the "
                        "process's end, never acknowledged): ignored"
                    )
                break
            if skip_damaged:
                if report is not None:
                    report(f"[clawray] {label} {path}: line {i + 1} is not a complete record: ignored")
                continue
            raise DamagedFileError(
                f"{label} {path}: line {i + 1} of {len(lines) - 1} is not a complete record (the file is "
                "damaged: restore it from a backup, or start afresh with resume=false)"
            ) from None
        out.append(rec)
    return out


class JsonlRecords:
    """One rotating JSONL record.

    Args:
        path: the live file (e.g. ``runs/x/records/turns.jsonl``); its folder is created.
        max_bytes: rotate before a row would make the file larger than this (bytes); a single
            larger row still gets written, alone in its file.
        keep_files: rotated files kept (``path.1`` newest .. ``path.N`` oldest); >= 0.

    Raises:
        ValueError: ``max_bytes`` <= 0 or ``keep_files`` < 0.
    """

    def __init__(self, path: str, max_bytes: int, keep_files: int):
        if max_bytes <= 0 or keep_files < 0:
            raise ValueError(f"max_bytes must be > 0 and keep_files >= 0, got {max_bytes}, {keep_files}")
        self.path, self.max_bytes, self.keep_files = path, max_bytes, keep_files
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.rotations = 0
        self.write_errors = 0  # rows the disk refused (each left out whole, never torn)
        self.error: str | None = None  # the last refusal, cleared by the next row written

    def append(self, row: dict[str, Any]) -> bool:
        """Write ``row`` as one JSON line (rotating first when needed); returns whether it was
        written. A record is observability, never a reason to fail the request that made it: when the
        disk refuses the row (ENOSPC, ...) it is left out whole (:func:`append_whole`), counted in
        ``write_errors`` and named in ``error`` until a row is written again."""
        # a lone surrogate (no UTF-8 form) is written as its JSON escape, which reads back the same
        line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8", errors="backslashreplace")
        try:
            try:
                size = os.path.getsize(self.path)
            except FileNotFoundError:
                size = 0
            if size and size + len(line) > self.max_bytes:
                self._rotate()
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.fchmod(fd, 0o600)
                append_whole(fd, line)
            finally:
                os.close(fd)
        except OSError as e:
            self.write_errors += 1
            self.error = f"{os.path.basename(self.path)}: {e.strerror or type(e).__name__}"
            return False
        self.error = None
        return True

    def _rotate(self) -> None:
        self.rotations += 1
        if self.keep_files == 0:
            os.remove(self.path)
            return
        oldest = f"{self.path}.{self.keep_files}"
        if os.path.exists(oldest):
            os.remove(oldest)
        for i in range(self.keep_files - 1, 0, -1):
            if os.path.exists(f"{self.path}.{i}"):
                os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")


class TurnRecords:
    """The SessionTracker's records: every served main-line turn (``turns.jsonl``, :meth:`Turn.record`)
    and every judged one (``judgments.jsonl``: votes, score, next state, why it was not trained).

    Args:
        folder: where both files go (``{run_dir}/records``); None = no records (every call a no-op).
        max_bytes, keep_files: each file's rotation (see :class:`JsonlRecords`).
    """

    def __init__(self, folder: str | None, max_bytes: int = 64 << 20, keep_files: int = 5):
        self.served = self.judged = None
        if folder:
            self.served = JsonlRecords(os.path.join(folder, "turns.jsonl"), max_bytes, keep_files)
            self.judged = JsonlRecords(os.path.join(folder, "judgments.jsonl"), max_bytes, keep_files)

    def failing(self) -> tuple[int, list[str]]:
        """``(rows the disk refused so far, the files refusing now)`` (see :meth:`JsonlRecords.append`)."""
        files = [f for f in (self.served, self.judged) if f is not None]
        return sum(f.write_errors for f in files), [f.error for f in files if f.error]

    def turn(self, turn: Any) -> None:
        """Append one served :class:`~clawray.types.Turn`."""
        if self.served is not None:
            self.served.append(turn.record())

    def judgement(self, turn: Any, next_state: list, result: Any, dropped: str | None, **extra: Any) -> None:
        """Append one judged turn: its next state, the judge's ``result`` (``score``, ``votes``,
        ``raw``; None when there is none), ``dropped`` (the reason it is not trained, or None) and the
        algorithm's ``extra`` fields (hints, teacher notes)."""
        if self.judged is None:
            return
        row = {
            **extra,
            "session_id": turn.session_id,
            "turn": turn.turn_index,
            "policy_version": turn.policy_version,
            "response": turn.response_message,
            "next_state": next_state,
            "score": getattr(result, "score", None),
            "votes": getattr(result, "votes", None),
            "raw_votes": getattr(result, "raw", None),
            "dropped": dropped,
        }
        self.judged.append(row)

    def session_outcome(self, session_id: str, result: Any, valid: int) -> None:
        """Append the outcome judge's score of a whole session (``kind: session_outcome``, ``turn``
        None; ``score`` None when no vote was valid)."""
        if self.judged is None:
            return
        row = {
            "session_id": session_id,
            "turn": None,
            "kind": "session_outcome",
            "score": result.score if valid else None,
            "votes": result.votes,
            "raw_votes": result.raw,
        }
        self.judged.append(row)

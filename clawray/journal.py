"""Durable journals: nothing acknowledged is lost, whatever process dies.

Owns: the two journals' records, their durability (the fsync policy), replay, compaction and the
at-most-once acknowledgement per ``(session_id, turn_index)``. Must not: import Ray or decide a
sample's or a turn's fate: each file's one writer (the queue, the tracker) decides; the journal
records and replays.

Two append-only JSON-lines files live in ``{run_dir}/journal/``:

* ``samples.jsonl`` (written by the TrajectoryQueue actor, :class:`SampleJournal`): a sample is
  *acknowledged* (counted in ``put`` and queued) only once its ``ack`` line (the whole
  :class:`~clawray.types.Sample` and its policy version) is written, flushed and fsync'ed. A training
  step marks the samples it consumed (``consume``: their sequence numbers and the driver step, trained
  or decided against); a stale drop is final (``drop``). A resume from the checkpoint taken after
  driver step S voids every ``consume`` mark of a step > S (those weights died with the run), so every
  acknowledged sample that the checkpoint's weights did not train is queued again, exactly once, with
  its original policy version; the queue's staleness rule applies to it as to any sample (drops
  counted).
* ``sessions.jsonl`` (written by the SessionTracker actor, :class:`SessionJournal`): recorded turns
  (the pending turns of each session, with their turn indexes), judgements started (turn + next
  state) and finished, 0-scored turns held for the at-least-one rule, judged turns waiting for their
  return (``trainer.credit`` discounted/outcome: the shaped sample, with the ``judged`` record), the
  session's explicit outcome (``outcome``), the emission of waiting turns (``released``), closes. A
  restarted tracker
  rebuilds its open sessions from it (a continuing session keeps its numbering and its pending turn is
  still judged) and restarts every judgement that had not finished.

Invariants and policies:

* fsync policy: ``fsync=True`` (the default, ``queue.journal_fsync``) fsyncs after every appended line
  before the caller is answered, so an acknowledged record survives a power loss; ``False`` only
  flushes to the OS (it survives a killed process, not a crashed machine). Cost: one fsync per sample
  and per turn (about 1-5 ms on a local disk).
* A line torn by a crash mid-write can only be the last one; it was never acknowledged and is ignored.
* A sample is acknowledged at most once per ``(session_id, turn_index)`` (a re-judged turn after a
  restart is not queued twice); samples without a session id are not deduplicated.
* Compaction rewrites a journal as the records that still matter (atomically: temporary file, fsync,
  rename), at a resume and when the file grows past ``compact_bytes`` after a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections import OrderedDict
from typing import Any, Callable, Iterable

from clawray.algos.credit_ledger import SessionCredit
from clawray.records import append_whole, read_jsonl
from clawray.types import Sample, Turn

SAMPLES_FILE = "samples.jsonl"
SESSIONS_FILE = "sessions.jsonl"


def journal_dir(run_dir: str) -> str:
    """``{run_dir}/journal``, the folder of the journals."""
    return os.path.join(run_dir, "journal")


def prepare_journals(
    run_dir: str, resume_step: int | None, report: Callable[[str], None] | None = None
) -> dict[str, str]:
    """Get the journals ready before the actors that write them start.

    Args:
        run_dir: the run folder.
        resume_step: the ``steps_done`` of the checkpoint being resumed, or None for a fresh run (its
            journals are removed: a fresh run in the same folder starts empty, like ``metrics.jsonl``).
        report: told of a torn last line (see :func:`read_records`).

    Returns:
        ``{"samples": path, "sessions": path}``.

    Raises:
        DamagedFileError: a journal line other than the last is damaged (file and line named).
    """
    folder = journal_dir(run_dir)
    if resume_step is None:
        shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    paths = {"samples": os.path.join(folder, SAMPLES_FILE), "sessions": os.path.join(folder, SESSIONS_FILE)}
    if resume_step is not None:
        read_records(paths["sessions"], report)  # checked here: a damaged file is named before any actor starts
        if os.path.exists(paths["samples"]):
            state = SampleState.from_records(read_records(paths["samples"], report), void_after_step=resume_step)
            write_atomic(paths["samples"], state.records())
    return paths


def read_records(path: str, report: Callable[[str], None] | None = None) -> list[dict]:
    """Every complete JSON line of a journal (:func:`clawray.records.read_jsonl`): a torn last line is
    skipped, and said through ``report`` when given.

    Raises:
        DamagedFileError: a line other than the last one is not a JSON object (the file is damaged);
            the message names the file and the line.
    """
    return read_jsonl(path, "journal", report)


def write_atomic(path: str, records: Iterable[dict]) -> None:
    """Replace ``path`` with ``records`` (one JSON line each): a temporary file, fsync, rename, fsync
    of the folder. A crash leaves the old file or the new one, never a mix."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            for rec in records:
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError:  # e.g. ENOSPC: the old file stands; no half-written temporary is left behind
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class AppendFile:
    """One append-only JSON-lines file; :meth:`append` returns once the line is durable.

    Args:
        path: the file (created 0600 when missing).
        fsync: fsync after each append (else flush only; see the module docstring).
    """

    def __init__(self, path: str, fsync: bool = True):
        self.path, self.fsync = path, fsync
        self._open()

    def _open(self) -> None:
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)

    def append(self, rec: dict) -> None:
        """Write ``rec`` as one line, whole or not at all (:func:`~clawray.records.append_whole`:
        no torn line, nothing left in a buffer for a later write), and fsync it when ``fsync`` is on.

        Raises:
            OSError: the disk refused the write (ENOSPC, ...): the record is NOT acknowledged and the
                file is as it was before.
        """
        if self._fd is None:
            self._open()
        append_whole(self._fd, (json.dumps(rec, separators=(",", ":")) + "\n").encode())
        if self.fsync:
            os.fsync(self._fd)

    def size(self) -> int:
        """The file's size in bytes."""
        return os.path.getsize(self.path)

    def rewrite(self, records: Iterable[dict]) -> None:
        """Replace the file's content by ``records`` atomically (:func:`write_atomic`).

        Raises:
            OSError: the new file could not be written (the old one stays, and stays open).
        """
        write_atomic(self.path, records)  # a failure leaves the old file, still open for appends
        self.close()
        self._open()

    def close(self) -> None:
        """Close the file (a later append opens it again)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ---------------------------------------------------------------------------------------------- samples
@dataclasses.dataclass
class SampleState:
    """What ``samples.jsonl`` says: the live (acknowledged, not consumed, not dropped) samples and
    the queue's counters.

    Attributes:
        live: ``{seq: (sample dict, policy version)}`` in acknowledgement order.
        consumed: ``{seq: (sample dict, version, step, trained)}`` of samples consumed by a step
            that a later resume may still void (kept until a checkpoint covers the step).
        put: samples acknowledged since the run started; taken: samples consumed by steps;
        dropped: ``{reason: count}`` (``stale``, ``too_long``).
        next_seq: the next sequence number; keys: ``(session_id, turn_index)`` already acknowledged.
        covered: the last step a checkpoint covered (``forget``): a resume needs that checkpoint, or
            a newer one; 0 before the first.
    """

    live: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    consumed: dict = dataclasses.field(default_factory=dict)
    put: int = 0
    taken: int = 0
    dropped: dict = dataclasses.field(default_factory=dict)
    next_seq: int = 1
    keys: set = dataclasses.field(default_factory=set)
    covered: int = 0

    @classmethod
    def from_records(cls, records: Iterable[dict], void_after_step: int | None = None) -> "SampleState":
        """Replay the records; ``consume`` marks of a step > ``void_after_step`` are voided (their
        samples are live again and not counted as taken)."""
        state = cls()
        for rec in records:
            state.apply(rec)
        if void_after_step is not None:
            state.void_after(void_after_step)
        return state

    def void_after(self, step: int) -> None:
        """Void the ``consume`` marks of steps > ``step``: their samples are live again (in
        acknowledgement order) and no longer counted as taken."""
        for seq in sorted(s for s, c in self.consumed.items() if c[2] > step):
            sample, version, _, _ = self.consumed.pop(seq)
            self.live[seq] = (sample, version)
            self.taken -= 1
        self.live = OrderedDict(sorted(self.live.items()))

    def apply(self, rec: dict) -> None:
        """Apply one record (the same code path for a live append and a replay)."""
        op = rec["op"]
        if op == "base":
            self.put, self.taken, self.dropped = rec["put"], rec["taken"], dict(rec["dropped"])
            self.next_seq = rec["next_seq"]
            self.keys = {tuple(k) for k in rec["keys"]}
            self.covered = int(rec.get("covered", 0))  # absent in journals of older versions
        elif op == "ack":
            self.live[rec["seq"]] = (rec["sample"], rec["version"])
            self.put += 1
            self.next_seq = max(self.next_seq, rec["seq"] + 1)
            if rec["sample"].get("session_id"):
                self.keys.add((rec["sample"]["session_id"], rec["sample"]["turn_index"]))
        elif op == "consume":
            for seq in rec["seqs"]:
                if seq in self.live:
                    sample, version = self.live.pop(seq)
                    self.consumed[seq] = (sample, version, rec["step"], rec["trained"])
                    self.taken += 1
        elif op == "drop":
            reason = rec["reason"]
            seqs = rec.get("seqs", [])
            for seq in seqs:
                self.live.pop(seq, None)
            self.dropped[reason] = self.dropped.get(reason, 0) + (len(seqs) or rec.get("n", 0))
        elif op == "restamp":  # a sample of a discarded version, at its distance through the fork
            if rec["seq"] in self.live:
                self.live[rec["seq"]] = (self.live[rec["seq"]][0], rec["version"])
        elif op == "rewind":  # the learners were rebuilt from the checkpoint of this step (clawray.recovery)
            self.void_after(rec["step"])
        elif op == "discard":  # trained into a version the gate rolled back: never replayed
            for seq in rec["seqs"]:
                self.consumed.pop(seq, None)
        elif op == "forget":  # a checkpoint covers these steps: their samples can never come back
            self.covered = max(self.covered, int(rec["step"]))
            for seq in [s for s, c in self.consumed.items() if c[2] <= rec["step"]]:
                del self.consumed[seq]
        else:
            raise ValueError(f"unknown sample-journal record {op!r}")

    def records(self) -> list[dict]:
        """The compacted journal: a ``base`` line, then the live and still-voidable samples."""
        out = [
            {
                "op": "base",
                "put": self.put - len(self.live) - len(self.consumed),
                "taken": self.taken - len(self.consumed),
                "dropped": self.dropped,
                "next_seq": self.next_seq,
                "keys": sorted(self.keys),
                "covered": self.covered,
            }
        ]
        # acks re-count themselves in put; consume marks re-count in taken
        rows = sorted(
            [(seq, s, v, None) for seq, (s, v) in self.live.items()]
            + [(seq, s, v, (st, tr)) for seq, (s, v, st, tr) in self.consumed.items()],
            key=lambda r: r[0],
        )
        for seq, sample, version, mark in rows:
            out.append({"op": "ack", "seq": seq, "version": version, "sample": sample})
            if mark is not None:
                out.append({"op": "consume", "seqs": [seq], "step": mark[0], "trained": mark[1]})
        return out


class SampleJournal:
    """The TrajectoryQueue's journal (one writer: the queue actor).

    Args:
        path: ``{run_dir}/journal/samples.jsonl`` (:func:`prepare_journals` already voided what a
            resume must replay).
        fsync: see the module docstring.
        compact_bytes: :meth:`forget` compacts the file once it is larger than this (0 = never).
    """

    def __init__(self, path: str, fsync: bool = True, compact_bytes: int = 64 << 20):
        self.state = SampleState.from_records(read_records(path))
        self.file = AppendFile(path, fsync)
        self.compact_bytes = compact_bytes

    def replay(self) -> list[tuple[int, Sample, int]]:
        """The live samples to queue again: ``[(seq, Sample, policy version)]``, oldest first."""
        return [(seq, Sample(**s), v) for seq, (s, v) in self.state.live.items()]

    def is_duplicate(self, sample: Sample) -> bool:
        """True when a sample of the same ``(session_id, turn_index)`` was already acknowledged."""
        return bool(sample.session_id) and (sample.session_id, sample.turn_index) in self.state.keys

    def ack(self, sample: Sample, policy_version: int) -> int:
        """Append the sample durably; returns its sequence number (the sample is acknowledged)."""
        rec = {
            "op": "ack",
            "seq": self.state.next_seq,
            "version": int(policy_version),
            "sample": dataclasses.asdict(sample),
        }
        self.file.append(rec)
        self.state.apply(rec)
        return rec["seq"]

    def consume(self, seqs: list[int], step: int, trained: bool) -> None:
        """Mark the samples that driver step ``step`` took (trained, or decided against)."""
        self._log({"op": "consume", "seqs": list(seqs), "step": int(step), "trained": bool(trained)})

    def drop(self, reason: str, seqs: list[int] | None = None, n: int = 0) -> None:
        """Count a final drop: queued samples ``seqs``, or ``n`` samples refused at admission."""
        self._log({"op": "drop", "reason": reason, "seqs": list(seqs or []), "n": n})

    def restamp(self, seq: int, version: int) -> None:
        """Live sample ``seq`` counts as made by ``version`` from now on (the queue's re-stamp of a
        sample of a discarded version, :meth:`~clawray.actors.queue.TrajectoryQueue._drop_stale`):
        a replay queues it with that version."""
        self._log({"op": "restamp", "seq": int(seq), "version": int(version)})

    def rewind(self, step: int) -> None:
        """The learners restart from the checkpoint of driver step ``step``: samples consumed by later
        steps are live again (see :meth:`SampleState.void_after`)."""
        self._log({"op": "rewind", "step": int(step)})

    def discard(self, seqs: list[int]) -> None:
        """The consumed samples ``seqs`` were trained into a version the promotion gate rolled back
        (:mod:`clawray.gate`): a rewind or resume to an earlier step never queues them again."""
        self._log({"op": "discard", "seqs": [int(s) for s in seqs]})

    def forget(self, step: int) -> None:
        """A checkpoint covers driver steps <= ``step``: their consumed samples may go (compacts the
        file when it is over ``compact_bytes``)."""
        self._log({"op": "forget", "step": int(step)})
        if self.compact_bytes and self.file.size() > self.compact_bytes:
            try:
                self.file.rewrite(self.state.records())
            except OSError:  # compaction only saves space: the appended file stays valid as it is
                pass

    def _log(self, rec: dict) -> None:
        self.file.append(rec)
        self.state.apply(rec)


# --------------------------------------------------------------------------------------------- sessions
def turn_to_dict(turn: Turn) -> dict:
    """A :class:`Turn` as a JSON-able dict (every field)."""
    return dict(turn.__dict__)


@dataclasses.dataclass
class SessionRecord:
    """One session as ``sessions.jsonl`` knows it.

    Attributes:
        turns: the last turn index given; pending: the pending turns (dicts); effective: a turn was
        emitted as a sample; held: ``[(turn or sample dict, mean vote)]`` 0-scored turns (a sample
        dict: a zero-return turn released by the credit rule); closed: closed (awaiting its
        at-least-one finalisation while ``held``, ``waiting`` or judgements remain); waiting: sample
        dicts awaiting their return; outcome: the session's outcome (explicit or judged) or None;
        transcript: the messages the outcome judge reads (kept from the close, only when it will be asked);
        base: the last turn index of the id's previous session (this session's turns are ``base + 1 ..
        turns``); opening: the session's opening key (``trainer.group_by: session_prefix``); requests:
        the main-line requests recorded in it (``credit/session_turns`` counts them at its close).
    """

    turns: int = 0
    pending: list = dataclasses.field(default_factory=list)
    effective: bool = False
    held: list = dataclasses.field(default_factory=list)
    closed: bool = False
    waiting: list = dataclasses.field(default_factory=list)
    outcome: float | None = None
    transcript: list = dataclasses.field(default_factory=list)
    base: int = 0
    opening: str = ""
    requests: int = 0

    def holds(self, turn_index: int) -> bool:
        """Whether ``turn_index`` is one of this session's turns."""
        return self.base < turn_index <= self.turns


class SessionState:
    """Replay of ``sessions.jsonl``: sessions by id, judgements not finished, closed turn counts.

    A closed id used again starts a new session while the closed one may still await its finalisation
    (judgements running, held or waiting turns): the closed one moves to ``superseded`` and records
    are routed to the session that holds their turn index (``judge``, ``judged``, ``released``) or
    whose last turn index they name (``last`` of ``outcome`` and ``finalized``); a record that names
    neither goes to the id's current session.
    """

    def __init__(self, max_closed: int = 100_000):
        self.sessions: dict[str, SessionRecord] = {}
        self.superseded: list[tuple[str, SessionRecord]] = []  # closed sessions whose id was used again
        self.jobs: OrderedDict = OrderedDict()  # (sid, turn_index) -> (turn dict, next_state)
        self.closed_turns: OrderedDict = OrderedDict()  # sid -> last turn index of a finished session
        # attribution key of an idle-closed session's pending turn -> its id (SessionBook.closed_index)
        self.closed_index: OrderedDict = OrderedDict()
        self.max_closed = max_closed
        self.counts: dict = {}  # the tracker's counters at its last record (a restart continues from them)

    def _find(self, sid: str, turn_index: int | None = None, last: int | None = None) -> SessionRecord | None:
        """The session of ``sid`` holding ``turn_index`` (or whose last turn index is ``last``); the
        current one when neither is given or none matches."""
        if turn_index is not None or last is not None:
            for s in [self.sessions.get(sid), *(r for i, r in self.superseded if i == sid)]:
                if s is not None and (s.holds(turn_index) if turn_index is not None else s.turns == last):
                    return s
        return self.sessions.get(sid)

    def apply(self, rec: dict) -> None:
        """Apply one record (the same code path for a live append and a replay)."""
        op, sid = rec["op"], rec.get("sid")
        if "counts" in rec:
            self.counts = rec["counts"]
        if op == "session":  # compacted form (an id's superseded sessions come before its current one)
            self._supersede(sid)
            self.sessions[sid] = SessionRecord(
                rec["turns"],
                rec["pending"],
                rec["effective"],
                [tuple(h) for h in rec["held"]],
                rec["closed"],
                rec.get("waiting", []),
                rec.get("outcome"),
                rec.get("transcript") or [],
                rec.get("base", 0),
                rec.get("opening", ""),
                rec.get("requests", 0),
            )
        elif op == "closed_turns":
            self.closed_turns = OrderedDict(rec["items"])
            self.closed_index = OrderedDict(rec.get("index", []))
        elif op == "turns":
            s = self.sessions.get(sid)
            if s is None or s.closed:
                self._supersede(sid)
                base = self.closed_turns.pop(sid, 0)
                s = self.sessions[sid] = SessionRecord(turns=base, base=base)
                for key in [k for k, v in self.closed_index.items() if v == sid] if base else ():
                    del self.closed_index[key]  # reopened: its idle-closed keys are history now
            s.pending = rec["turns"]
            s.turns = max(t["turn_index"] for t in rec["turns"])
            s.opening = rec.get("opening", s.opening)
            s.requests += 1
        elif op == "judge":
            s = self._find(sid, rec["turn"]["turn_index"])
            if s is not None:
                s.pending = []
            self.jobs[(sid, rec["turn"]["turn_index"])] = (rec["turn"], rec["next_state"])
        elif op == "judged":
            self.jobs.pop((sid, rec["turn_index"]), None)
            s = self._find(sid, rec["turn_index"])
            if s is not None:
                if rec.get("effective"):
                    s.effective = True
                if rec.get("held") is not None:
                    s.held.append((rec["turn"], rec["held"]))
                if rec.get("waiting") is not None:
                    s.waiting.append(rec["waiting"])
                self._maybe_forget(sid, s)
        elif op == "outcome":
            s = self._find(sid, last=rec.get("last"))
            if s is not None:
                s.outcome = rec["value"]
        elif op == "released":
            s = self._find(sid, min(rec["turn_indexes"], default=None))
            if s is not None:
                gone = set(rec["turn_indexes"])
                s.waiting = [w for w in s.waiting if w["turn_index"] not in gone]
                s.held.extend(tuple(h) for h in rec.get("held", []))
                self._maybe_forget(sid, s)
        elif op == "close":
            s = self.sessions.get(sid)
            if s is not None:
                s.closed, s.pending = True, []
                s.transcript = rec.get("transcript") or []
                self.closed_turns[sid] = s.turns
                while len(self.closed_turns) > self.max_closed:
                    self.closed_turns.popitem(last=False)
                for key in rec.get("idle_keys", []):
                    self.closed_index[key] = sid
                while len(self.closed_index) > self.max_closed:
                    self.closed_index.popitem(last=False)
                self._maybe_forget(sid, s)
        elif op == "finalized":
            s = self._find(sid, last=rec.get("last"))
            if s is not None and s.closed:
                self._forget(sid, s)
        else:
            raise ValueError(f"unknown session-journal record {op!r}")

    def _supersede(self, sid: str) -> None:
        """Move ``sid``'s closed session aside (its id is used again)."""
        s = self.sessions.pop(sid, None)
        if s is not None:
            self.superseded.append((sid, s))

    def _forget(self, sid: str, s: SessionRecord) -> None:
        if self.sessions.get(sid) is s:
            del self.sessions[sid]
        else:
            self.superseded = [(i, r) for i, r in self.superseded if r is not s]

    def _maybe_forget(self, sid: str, s: SessionRecord) -> None:
        if s.closed and not s.held and not s.waiting and not any(k[0] == sid and s.holds(k[1]) for k in self.jobs):
            self._forget(sid, s)

    def records(self) -> list[dict]:
        """The compacted journal (one line per unfinished judgement and per session). The judgements
        come first: replayed, a ``judge`` line empties its session's pending turns (live, it came
        before the next request's turns), so after the sessions it would drop a newer pending turn.
        An id's superseded sessions come before its current one."""
        out: list[dict] = [
            {
                "op": "closed_turns",
                "items": list(self.closed_turns.items()),
                "index": list(self.closed_index.items()),
                "counts": self.counts,
            }
        ]
        out += [{"op": "judge", "sid": sid, "turn": t, "next_state": ns} for (sid, _), (t, ns) in self.jobs.items()]
        out += [
            {
                "op": "session",
                "sid": sid,
                "turns": s.turns,
                "pending": s.pending,
                "effective": s.effective,
                "held": [list(h) for h in s.held],
                "closed": s.closed,
                "waiting": s.waiting,
                "outcome": s.outcome,
                "transcript": s.transcript,
                "base": s.base,
                "opening": s.opening,
                "requests": s.requests,
            }
            for sid, s in [*self.superseded, *self.sessions.items()]
        ]
        return out


class SessionJournal:
    """The SessionTracker's journal (one writer: the tracker actor). Loading compacts the file.

    Args:
        path: ``{run_dir}/journal/sessions.jsonl``.
        fsync: see the module docstring.
        compact_bytes: compact when the file grows past this many bytes (checked on close; 0 = never).
    """

    def __init__(self, path: str, fsync: bool = True, compact_bytes: int = 64 << 20, max_closed: int = 100_000):
        self.state = SessionState(max_closed)
        for rec in read_records(path):
            self.state.apply(rec)
        write_atomic(path, self.state.records())
        self.file = AppendFile(path, fsync)
        self.compact_bytes = compact_bytes

    def log(self, op: str, **fields: Any) -> None:
        """Append one record durably (turn objects are converted to dicts by the caller)."""
        rec = {"op": op, **fields}
        self.file.append(rec)
        self.state.apply(rec)
        if op == "close" and self.compact_bytes and self.file.size() > self.compact_bytes:
            try:
                self.file.rewrite(self.state.records())
            except OSError:  # compaction only saves space: the appended file stays valid as it is
                pass

    def turns(self, turns: list[Turn], counts: dict, opening: str = "") -> None:
        """``turns``: a request's new turns, with their indexes (durable before they are answered),
        and the session's ``opening`` key."""
        sid = turns[0].session_id
        self.log("turns", sid=sid, turns=[turn_to_dict(t) for t in turns], opening=opening, counts=counts)

    def judge(self, turn: Turn, next_state: list, counts: dict) -> None:
        """``judge``: a judgement about to start (durable before it starts; a restart relaunches it)."""
        self.log("judge", sid=turn.session_id, turn=turn_to_dict(turn), next_state=next_state, counts=counts)

    def judged(self, session: Any, turn: Turn, counts: dict) -> None:
        """``judged``: what the judgement of ``turn`` left in its tracker ``session``: held for the
        at-least-one rule (the turn and its mean vote), waiting for its return (the sample), or done."""
        held = session.held[-1][1] if session.held and session.held[-1][0] is turn else None
        waiting = next((w for w in session.credit.waiting if w.turn_index == turn.turn_index), None)
        self.log(
            "judged",
            sid=turn.session_id,
            turn_index=turn.turn_index,
            effective=session.effective,
            held=held,
            turn=turn_to_dict(turn) if held is not None else None,
            waiting=dataclasses.asdict(waiting) if waiting is not None else None,
            counts=counts,
        )


@dataclasses.dataclass
class RestoredSessions:
    """What a session journal's state restores (:func:`restore_sessions`), for the SessionTracker
    to apply through its own methods.

    Attributes:
        open: the sessions still open, to go back into the tracker's book.
        closed: closed sessions whose finalisation must run (at least once).
        jobs: ``(session, turn, next_state)`` of each judgement that had not ended.
        closed_turns: ``{session id: turns}`` of the sessions closed and remembered.
        closed_index: ``{attribution key: session id}`` of idle-closed sessions' pending turns.
        credits: every restored session's :class:`~clawray.algos.credit.SessionCredit`.
    """

    open: list
    closed: list
    jobs: list
    closed_turns: dict
    credits: list
    closed_index: dict = dataclasses.field(default_factory=dict)


def restore_sessions(state: Any) -> RestoredSessions:
    """The sessions of a loaded :class:`SessionJournal`'s ``state``: each rebuilt as a
    :class:`~clawray.session_book.Session` (its pending turns, held samples, credit and opening), and
    each unfinished judgement with the session holding its turn (a stand-in session when that one was
    forgotten: closed, nothing held). A closed session whose id was used again is restored beside the
    id's current one, to be finalised."""
    from clawray.session_book import Session

    def rebuild(sid: str, rec: SessionRecord) -> Any:
        return Session(
            turns=rec.turns,
            pending=[Turn(**t) for t in rec.pending],
            effective=rec.effective,
            held=[(Sample(**t) if "tokens" in t else Turn(**t), m) for t, m in rec.held],
            sid=sid,
            credit=SessionCredit(
                waiting=[Sample(**w) for w in rec.waiting], outcome=rec.outcome, transcript=rec.transcript
            ),
            opening=rec.opening,
            requests=rec.requests,
        )

    every = [(sid, rec, rebuild(sid, rec)) for sid, rec in [*state.superseded, *state.sessions.items()]]
    jobs = []
    for (sid, index), (turn, next_state) in state.jobs.items():
        session = next((s for i, rec, s in every if i == sid and rec.holds(index)), None)
        if session is None:  # its session was forgotten (closed, nothing held): judge it on a stand-in
            session = Session(turns=index, sid=sid)
        jobs.append((session, Turn(**turn), next_state))
    return RestoredSessions(
        open=[s for _, rec, s in every if not rec.closed],
        closed=[s for _, rec, s in every if rec.closed],
        jobs=jobs,
        closed_turns=dict(state.closed_turns),
        closed_index=dict(state.closed_index),
        credits=[s.credit for _, _, s in every],
    )

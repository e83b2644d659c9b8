"""TrajectoryQueue: samples stream from the session tracker to the learner through the object store.

Owns: the queued refs and their metadata, the ``stale`` and ``too_long`` drops, which fresh samples a batch
takes and in what order, and when a ``put`` is acknowledged. Must not: decide on a batch beyond freshness
(:mod:`clawray.batching`), fetch a sample except to journal it or compute its metadata, or define the
journal's format (:mod:`clawray.journal`).

Samples stay in the Ray object store; the queue holds only their ``ObjectRef`` and, beside it, the
sample's :class:`~clawray.types.SampleMeta` (policy version, reward, token counts, prompt key, origin).
A batch hands both to the driver, which decides on the batch (all-masked samples, advantages, metrics)
from the metadata alone and passes the refs on: only the learners fetch sample payloads.
When the learner takes a batch for the update that will produce version ``v_next``, every queued
sample with ``staleness = v_next - sample.policy_version > max_staleness`` is dropped and counted
(reason ``stale``). With ``max_staleness = 1`` a sample generated at v3 is trained by the update
that produces v4 and dropped if it would only be trained by the one producing v5.

Batch size and which samples are taken (the effective sample rate): ``get_batch(batch_size, ...,
max_batch_size)`` waits until at least ``batch_size`` fresh samples are queued, then takes every fresh
sample up to ``max_batch_size``, the OLDEST policy version first (FIFO within a version). When the
learner is the bottleneck, samples pile up during an update; taking them all (up to the cap) instead
of exactly ``batch_size`` means none expires while it waits, and taking the oldest first means that
the samples nearest their staleness cap are the ones trained when the cap binds (earliest deadline
first), so a sample is dropped as stale only when more samples arrive per update than
``max_batch_size``. The cost: batches of varying size, and a mean staleness up to one version higher
than a freshest-first order (never above ``max_staleness``, which the PPO clip is sized for). The
driver logs ``inv/effective_sample_rate`` = samples trained / (samples taken + samples dropped as
``stale``): the share of the queue's decided samples that reached an optimizer step.

Version numbers are reused after a rollback (a rejected candidate, a resume from an older checkpoint,
a learner group rebuilt from one): a queued sample stamped by a version the update producing
``v_next`` cannot follow (staleness < 1) came from the discarded versions; its staleness becomes its
distance to the trained policy through their common ancestor (see ``_drop_stale``), and past the cap
it is dropped as ``rolled_back``: never trained as fresher than on-policy, and within the cap still
trained (an acknowledged user turn is not lost to a crash).

A sample longer than the learner's micro-batch budget (``max_tokens``) is rejected at ``put``
(reason ``too_long``): it would not fit in one forward pass.

Durability (``journal``, see :mod:`clawray.journal`): with a journal path, ``put`` returns (the sample
is acknowledged, counted in ``put`` and queued) only after the sample is appended to
``journal/samples.jsonl`` and flushed; :meth:`TrajectoryQueue.consumed` marks what a training step
took, stale drops are journaled, and a new queue (a resume, or Ray restarting this actor) queues
every live journaled sample again with its policy version. Checkpoints do not carry the queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter, deque

import ray

from clawray.types import Sample, SampleMeta


class TrajectoryQueue:
    """Sample refs with a staleness cap; batches take every fresh sample, oldest version first.

    Args:
        max_staleness: the largest staleness a trained sample may have (>= 1).
        max_tokens: the longest admitted sample in tokens (prompt + response); 0 = no limit.
    """

    def __init__(self, max_staleness: int, max_tokens: int = 0, journal: dict | None = None):
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1, got {max_staleness}")
        self.max_staleness = max_staleness
        self.max_tokens = int(max_tokens)
        self._items: deque[tuple[ray.ObjectRef, SampleMeta, int]] = deque()  # (ref, metadata, journal seq)
        self._cond = asyncio.Condition()
        self.num_put = 0
        self.num_taken = 0
        self.dropped: Counter[str] = Counter()
        self.rewards: dict[int, list[float]] = {}  # per policy version: [n, sum, sum of squares] of rewards put
        self.journal = None  # [journal hook] clawray.journal.SampleJournal; replays its live samples
        # queued samples re-stamped by _drop_stale (see _key): the version where each one's branch
        # leaves the trained lineage (its common ancestor with the policy)
        self._forks: dict[int, int] = {}
        if journal:
            self._open_journal(**journal)

    def _open_journal(self, path: str, fsync: bool = True, compact_bytes: int = 64 << 20) -> None:
        """[journal hook] Load ``path`` and queue its live samples again (oldest first, each with its
        policy version); one longer than this queue's ``max_tokens`` is dropped as ``too_long``."""
        from clawray.journal import SampleJournal

        self.journal = SampleJournal(path, fsync, compact_bytes)
        st = self.journal.state
        self.num_put, self.num_taken, self.dropped = st.put, st.taken, Counter(st.dropped)
        self.replayed = 0
        for seq, sample, version in self.journal.replay():
            if 0 < self.max_tokens < len(sample.tokens):  # a smaller budget than the journaled run's
                self.dropped["too_long"] += 1
                self.journal.drop("too_long", [seq])
                continue
            self._items.append(self._journaled(sample, version, seq))
            self.replayed += 1

    def _journaled(self, sample: Sample, version: int, seq: int) -> tuple:
        """The queue item of journaled sample ``seq`` held at ``version``; a re-stamped one (``version``
        below the sample's own, ``2A - s``) keeps its fork ``A`` (see :meth:`_drop_stale`)."""
        meta = dataclasses.replace(SampleMeta.of(sample), policy_version=int(version))
        if meta.policy_version < sample.policy_version:
            self._forks[seq] = (meta.policy_version + int(sample.policy_version)) // 2
        return (ray.put(sample), meta, seq)

    async def put(self, sample_ref: list[ray.ObjectRef], meta: SampleMeta | None = None) -> int:
        """Enqueue one sample; ``sample_ref`` is ``[ref]`` (wrapped so Ray does not fetch it).

        Args:
            meta: the sample's :meth:`SampleMeta.of` (its ``policy_version`` decides staleness, its
                ``num_tokens`` the ``too_long`` check); the queue fetches the sample and computes it
                when None. With a journal the queue fetches the sample anyway (it journals and owns a copy).

        Returns:
            the queue length after the put (unchanged when the sample is rejected as ``too_long``,
            or is a duplicate of an acknowledged ``(session_id, turn_index)`` with a journal).

        Raises:
            OSError: the journal could not be written (the sample is not acknowledged).
        """
        sample = await sample_ref[0] if self.journal is not None or meta is None else None
        if meta is None:
            meta = SampleMeta.of(sample)
        async with self._cond:
            if self.journal is not None and self.journal.is_duplicate(sample):  # [journal hook] counted once
                return len(self._items)
            if 0 < self.max_tokens < meta.num_tokens:
                self.dropped["too_long"] += 1
                if self.journal is not None:  # [journal hook]
                    self.journal.drop("too_long", n=1)
                return len(self._items)
            seq = 0
            if self.journal is not None:  # [journal hook] acknowledged only once durable
                seq = self.journal.ack(sample, meta.policy_version)
                # the queue owns its copy: a sample put by a tracker that dies later stays readable
                sample_ref = [ray.put(sample)]
            self._items.append((sample_ref[0], meta, seq))
            self.num_put += 1
            if meta.reward is not None:
                tally = self.rewards.setdefault(meta.policy_version, [0.0, 0.0, 0.0])
                tally[0], tally[1], tally[2] = tally[0] + 1, tally[1] + meta.reward, tally[2] + meta.reward**2
            self._cond.notify_all()
            return len(self._items)

    def _drop_stale(self, next_version: int) -> None:
        """Before the update producing ``next_version`` takes a batch: re-stamp every queued sample of
        a discarded version, then drop (count, and journal as final) every sample past its
        staleness cap: ``stale``, or ``rolled_back`` for a re-stamped one.

        Version numbers are reused after a rollback (a gate rejection, a resume from an older
        checkpoint, a learner group rebuilt from one): the learners are back at ``V = next_version - 1``
        and a sample stamped ``s >= next_version`` came from the discarded versions ``V+1..``, ``s - V``
        updates past ``V`` on a branch that no longer exists. Its distance to the policy being
        trained, through their common ancestor ``V``, is ``(s - V) + 1``: it is re-stamped
        ``2V - s`` (mirrored around the fork), so its staleness is that distance now and grows with
        each later update like any sample's. (Taken as stamped, its staleness was 0 or negative: never
        dropped, trained as fresher than on-policy.) A sample re-stamped at fork ``A`` whose lineage is
        cut again below it, at ``V < A`` (a resume from a checkpoint older than the gate's fork), hangs
        from ``V`` now: ``2V - s``, its stamp lowered by ``2(A - V)``. The re-stamp is journaled (a
        restarted queue replays it, fork included); the sample itself keeps the version that made it."""
        fork = next_version - 1
        for i, (ref, meta, seq) in enumerate(self._items):
            key = _key(meta, seq)
            ancestor = self._forks.get(key, meta.policy_version)  # itself while on the lineage
            if ancestor > fork:
                self._forks.pop(key, None)  # without a journal the key is the meta's id, which changes
                meta = dataclasses.replace(meta, policy_version=meta.policy_version - 2 * (ancestor - fork))
                self._items[i] = (ref, meta, seq)
                self._forks[_key(meta, seq)] = fork
                if self.journal is not None:  # [journal hook] a restarted queue replays the re-stamp
                    self.journal.restamp(seq, meta.policy_version)
        verdict = {"stale": [], "rolled_back": []}
        kept = deque()
        for item in self._items:
            if next_version - item[1].policy_version <= self.max_staleness:
                kept.append(item)
                continue
            key = _key(item[1], item[2])
            verdict["rolled_back" if key in self._forks else "stale"].append(item[2])
            self._forks.pop(key, None)
        for reason, seqs in verdict.items():
            if seqs:
                self.dropped[reason] += len(seqs)
                if self.journal is not None:  # [journal hook] a stale drop is final
                    self.journal.drop(reason, seqs)
        self._items = kept

    async def get_batch(
        self, batch_size: int, next_version: int, timeout_s: float | None = None, max_batch_size: int = 0
    ) -> dict | None:
        """Wait for at least ``batch_size`` fresh samples for the update producing ``next_version``,
        then take up to ``max_batch_size`` of them (0 = exactly ``batch_size``), oldest policy
        version first, FIFO within a version.

        Returns:
            ``{"refs": [ref, ...], "meta": [SampleMeta, ...], "versions": [int, ...], "staleness": [int, ...],
            "seqs": [int, ...]}`` in the order taken (``seqs``: journal sequence numbers for :meth:`consumed`,
            0 without a journal), or ``None`` when ``timeout_s`` passes first (nothing is removed then).

        Raises:
            ValueError: ``max_batch_size`` is neither 0 nor >= ``batch_size``.
        """
        if max_batch_size and max_batch_size < batch_size:
            raise ValueError(f"max_batch_size {max_batch_size} < batch_size {batch_size}")
        take_max = max_batch_size or batch_size
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        async with self._cond:
            while True:
                self._drop_stale(next_version)
                if len(self._items) >= batch_size:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                try:
                    await asyncio.wait_for(self._cond.wait(), timeout=remaining)
                except asyncio.TimeoutError:
                    pass
            # stable: FIFO per version
            order = sorted(range(len(self._items)), key=lambda i: self._items[i][1].policy_version)
            chosen = set(order[:take_max])
            batch = [self._items[i] for i in order[:take_max]]
            for _, m, q in batch:
                self._forks.pop(_key(m, q), None)
            self._items = deque(item for i, item in enumerate(self._items) if i not in chosen)
            self.num_taken += len(batch)
            return {
                "refs": [r for r, _, _ in batch],
                "meta": [m for _, m, _ in batch],
                "versions": [m.policy_version for _, m, _ in batch],
                "staleness": [next_version - m.policy_version for _, m, _ in batch],
                "seqs": [q for _, _, q in batch],
            }

    async def count_drop(self, reason: str, n: int = 1) -> None:
        """Count samples dropped upstream (before they were enqueued) under ``reason``."""
        self.dropped[reason] += n

    async def consumed(self, seqs: list[int], step: int, trained: bool = True) -> None:
        """[journal hook] Journal that driver step ``step`` took the samples ``seqs`` (from
        :meth:`get_batch`): trained, or decided against (degenerate, non-finite, all-masked). A resume
        from a checkpoint older than ``step`` replays them. A batch an earlier incarnation of this actor
        handed out (queued again from the journal when Ray restarted it) leaves the queue now and counts
        as taken. No-op without a journal."""
        if self.journal is not None:
            self.journal.consume(seqs, step, trained)
            # a batch taken from an earlier incarnation of this actor (Ray restarted it) was queued
            # again from the journal: it is consumed now, so it leaves the queue
            gone = set(seqs)
            async with self._cond:
                n = len(self._items)
                self._items = deque(item for item in self._items if item[2] not in gone)
                self.num_taken += n - len(self._items)  # taken by that incarnation: counted now

    async def rewind(self, step: int) -> int:
        """[recovery hook] The learner group was rebuilt from the checkpoint of driver step ``step``
        (or, with ``step`` = the steps done, a step aborted before it trained its batch): queue again every journaled sample that checkpoint did not train, each exactly once: those
        consumed by later steps, and a batch taken by :meth:`get_batch` but never marked
        :meth:`consumed` (the step in flight when a learner died). The queue then holds exactly the
        journal's live samples, oldest first; ``taken`` is re-based on the journal. Returns the
        queue length.

        Raises:
            RuntimeError: the queue has no journal (nothing to re-queue from).
        """
        if self.journal is None:
            raise RuntimeError("the queue has no journal: samples taken since the checkpoint cannot be re-queued")
        async with self._cond:
            self.journal.rewind(step)
            queued = {seq: (ref, meta) for ref, meta, seq in self._items}
            items = deque()
            for seq, (sample, version) in self.journal.state.live.items():
                if seq in queued:
                    items.append((*queued[seq], seq))
                    continue
                items.append(self._journaled(Sample(**sample), version, seq))
            self._items = items
            self.num_taken = self.journal.state.taken
            self._cond.notify_all()
            return len(self._items)

    async def discard(self, seqs: list[int]) -> None:
        """[journal hook] The samples ``seqs`` (consumed by trained steps) went with a candidate the
        promotion gate rolled back: a later rewind or resume never revives them (:meth:`SampleJournal.discard`).
        No-op without a journal."""
        if self.journal is not None:
            self.journal.discard(seqs)

    async def forget(self, step: int) -> None:
        """[journal hook] A committed checkpoint covers driver steps <= ``step``: the journal may drop
        their consumed samples (it compacts itself when large). No-op without a journal."""
        if self.journal is not None:
            self.journal.forget(step)

    async def reward_tallies(self) -> dict[int, tuple[float, float, float]]:
        """Per policy version, ``(n, sum, sum of squares)`` of the rewards of every sample put since
        this queue started (the live rewards the promotion gate's canary compares, :mod:`clawray.canary`;
        journal replays and rejected puts not counted)."""
        return {v: (t[0], t[1], t[2]) for v, t in self.rewards.items()}

    async def stats(self) -> dict:
        """``{"size", "put", "taken", "dropped": {reason: count}}`` (plus ``replayed``: samples queued
        again from the journal when this queue started)."""
        out = {"size": len(self._items), "put": self.num_put, "taken": self.num_taken, "dropped": dict(self.dropped)}
        if self.journal is not None:
            out["replayed"] = self.replayed
        return out


def _key(meta: SampleMeta, seq: int) -> int:
    """A queued sample's key in ``TrajectoryQueue._forks``: its journal seq, else its (re-stamped,
    queued) metadata object's id, alive while it is queued."""
    return seq if seq else id(meta)


# The Ray actor class. The plain class above stays importable, so Ray pickles it by reference.
TrajectoryQueueActor = ray.remote(TrajectoryQueue)

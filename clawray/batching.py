"""Taking a batch from the trajectory queue: the samples a step trains, decided on metadata alone.

Owns: which taken samples a step keeps (all-masked samples dropped, DAPO dynamic sampling) and the
batch in flight on the :class:`~clawray.resume.LoopState`. Must not: fetch a sample (only the learners
do) or train.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import ray

from clawray.recovery import wait_batch
from clawray.run_actors import RunActors


def sample_groups(metas: list, group_by: str) -> list:
    """The group key of each sample (:class:`~clawray.types.SampleMeta`) under ``trainer.group_by``
    (:func:`clawray.algos.rejection.group_keys`)."""
    from clawray.algos.rejection import group_keys

    return group_keys(
        group_by, [m.prompt_key for m in metas], [m.opening_key for m in metas], [m.turn_index for m in metas]
    )


def take_batch(
    trainer: Any, actors: RunActors, state: Any, next_version: int, why: Callable[[], list[str]]
) -> tuple[dict, list, list]:
    """The next batch from the queue (``trainer.batch_size`` .. ``max_batch_size`` samples), without
    its all-masked samples (they only cost compute; counted in ``state.all_masked_dropped``):
    ``(batch, refs, metas)``, the kept samples' object refs and :class:`~clawray.types.SampleMeta`.
    The batch is in flight (``state.in_flight``, requeued by a checkpoint) until the step has decided
    on it. ``why``: the reasons samples may not come, said while waiting (:func:`~clawray.recovery.wait_batch`).

    Raises:
        TimeoutError: no full batch arrived within ``trainer.batch_timeout_s``.
        ActorLost: an actor died for good while waiting.
    """
    tr = trainer
    timeout = tr.batch_timeout_s or None  # 0 waits for as long as it takes
    desc = f"step {state.steps_done + 1}/{tr.num_steps}: samples"
    batch = wait_batch(
        actors, state.version, tr.batch_size, next_version, timeout, tr.max_batch_size, desc=desc, why=why
    )
    if batch is None:
        raise TimeoutError(
            f"no batch of {tr.batch_size} samples within {tr.batch_timeout_s}s "
            f"(queue: {ray.get(actors.queue.stats.remote())}, sessions: {ray.get(actors.tracker.stats.remote())})"
        )
    state.in_flight = {"next_version": next_version, "metas": batch["meta"], "seqs": batch["seqs"]}
    rejected: set[int] = set()
    if tr.dynamic_sampling:
        batch, rejected = fill_dynamic(tr, actors, state, batch, next_version)
        state.in_flight.update(metas=batch["meta"], seqs=batch["seqs"])
    candidates = [(i, m) for i, m in enumerate(batch["meta"]) if i not in rejected]
    keep = [i for i, m in candidates if m.trainable_tokens > 0]
    state.all_masked_dropped += len(candidates) - len(keep)
    refs, metas = [batch["refs"][i] for i in keep], [batch["meta"][i] for i in keep]
    state.in_flight = {"next_version": next_version, "metas": metas, "seqs": batch["seqs"]}
    return batch, refs, metas


def fill_dynamic(trainer: Any, actors: RunActors, state: Any, batch: dict, next_version: int) -> tuple[dict, set[int]]:
    """DAPO dynamic sampling (:mod:`clawray.algos.rejection`): while fewer than
    ``trainer.batch_size`` samples lie in groups with reward variance, take more from the queue
    (at least one sample at a time, up to ``max_batch_size`` each), for at most
    ``trainer.dynamic_sampling_wait_s`` seconds; returns ``(merged batch, indexes of the rejected
    zero-variance samples)``, decided on the samples' metadata, counted in
    ``state.zero_variance_dropped``. Every taken sample stays in the batch's journal marks (consumed
    by this step, rejected or trained). A refill never repeats a sample the batch holds (a queue that
    Ray restarted meanwhile queues the batch's samples again from its journal)."""
    from clawray.algos.rejection import zero_variance

    tr = trainer
    deadline = time.monotonic() + tr.dynamic_sampling_wait_s
    while True:
        metas = batch["meta"]
        rejected = set(zero_variance(sample_groups(metas, tr.group_by), [m.reward for m in metas]))
        remaining = deadline - time.monotonic()
        if len(metas) - len(rejected) >= tr.batch_size or remaining <= 0:
            break
        more = wait_batch(actors, state.version, 1, next_version, remaining, tr.max_batch_size)
        if more is None:
            continue
        batch = _merge(batch, more)
    state.zero_variance_dropped += len(rejected)
    return batch, rejected


def _merge(batch: dict, more: dict) -> dict:
    """``batch`` followed by the samples of ``more`` it does not hold yet, told apart by journal
    sequence number (0, no journal: every sample is new)."""
    held = {q for q in batch["seqs"] if q}
    new = [i for i, q in enumerate(more["seqs"]) if not q or q not in held]
    return {k: batch[k] + [more[k][i] for i in new] for k in ("refs", "meta", "versions", "staleness", "seqs")}

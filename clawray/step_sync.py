"""A step's weight sync: whether and how the learners' new weights reach the rollout engines.

Owns: the choice between the plain sync, the promotion gate's candidate sync (``deploy.gate``) and
no sync (a skipped step with every engine in step; a version the gate does not probe), the catch-up
of lagging or restarted engines, and the on-policy-gap probe launched after a sync that reached every
engine. Must not: move weights (:class:`~clawray.weight_sync.WeightSyncController`), judge a candidate
(:mod:`clawray.gate`) or advance the policy version (:mod:`clawray.driver`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from clawray.gate import PromotionGate
from clawray.mismatch_probe import MismatchProbe
from clawray.recovery import restarted_engines
from clawray.weight_sync import WeightSyncController


@dataclasses.dataclass
class SyncOutcome:
    """What a step's sync did.

    Attributes:
        seconds: the whole sync, wall (a group rebuild, and the gate's probe, included); 0 without one.
        error: one line when a sync failed, else None.
        metrics: ``sync/*``, ``timing/weight_sync_s``, ``engine_version/*`` (and ``deploy/*`` with the gate).
        rolled_back: the gate rejected or withdrew the candidate: the learners are back on the
            promoted version.
    """

    seconds: float
    error: str | None
    metrics: dict[str, float]
    rolled_back: bool = False


def sync_step(
    actors: Any,
    gate: PromotionGate,
    probe: MismatchProbe,
    model_path: str,
    version: int,
    next_version: int,
    skipped: str,
    refs: list,
    metas: list,
    seqs: list[int] | None = None,
) -> SyncOutcome:
    """Broadcast the weights after a trained step (``next_version``; or, after a ``skipped`` one, the
    learners' ``version`` while an engine is behind or was restarted). With ``deploy.gate`` a trained
    version reaches the engines only through :meth:`~clawray.gate.PromotionGate.sync_candidate`, and
    only when :meth:`~clawray.gate.PromotionGate.due`. After a sync that reached every engine, engine 0
    samples the on-policy-gap probe (:class:`~clawray.mismatch_probe.MismatchProbe`) to the prompt of
    one of the batch's samples (``refs``, ``metas``; ``seqs``: their journal sequence numbers, which
    the gate discards with a rolled-back candidate).

    ``timing/weight_sync_s`` = the whole sync (a group rebuild included); ``sync/pause_s`` = pause ->
    resume of the engines: gather, broadcast and load, plus, with ``sync.mode: drain``, the engines
    finishing the generations already running (``interrupt`` stops them at their current token and
    continues them after the load instead). A failed sync never stops training: the engines are
    resumed on their old version, and the next sync (even on a skipped step) rebuilds the group and
    sends the newest weights. A restarted engine rejoins a rebuilt group.
    """
    launch = lambda v: probe.launch(actors.engines[0], refs, metas, v, model_path) if actors.engines else None  # noqa: E731
    if gate.enabled:  # [deploy.gate] a trained version reaches the engines only through the probe
        if not skipped:
            gate.trained(metas, seqs)
        if not skipped and gate.due(next_version):
            out = gate.sync_candidate(actors, next_version, model_path)
            if out.error is None:
                launch(gate.promoted if out.rolled_back else next_version)
            return SyncOutcome(out.seconds, out.error, out.metrics, out.rolled_back)
        if not skipped or not gate.settled(version):  # the learners hold an unprobed version
            return SyncOutcome(0.0, None, {**WeightSyncController.idle_metrics(), **gate.metrics(None, 0.0)})
    sync, sync_s, sync_error = actors.weight_sync, 0.0, None
    metrics = WeightSyncController.idle_metrics()
    restarted = restarted_engines(actors)
    if not skipped or sync.behind or restarted:
        target = next_version if not skipped else version
        result = sync.resync(target) if restarted else sync.sync(target)
        sync_s = result["seconds"]
        metrics.update(WeightSyncController.metrics(result, sync.failures))
        if result["ok"]:
            launch(target)
        else:
            sync_error = result["error"]
            print(
                f"[clawray] {sync_error}; engines resumed at versions {result['versions']}; the sync group "
                "is rebuilt and the newest weights re-sent at the next sync",
                flush=True,
            )
    if not any(k.startswith("engine_version/") for k in metrics):
        versions = sync.engine_versions()
        metrics.update({f"engine_version/{n}": (-1 if v is None else v) for n, v in versions.items()})
    return SyncOutcome(sync_s, sync_error, metrics)

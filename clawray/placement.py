"""Where the actors run, and what follows from it: the weight-sync transport across hosts.

Owns: where each actor runs as the run sees it (:func:`actor_locations`) and the weight-sync
transport that follows from it (:func:`resolve_transport`). Must not: place an actor (Ray does, from
the config's resources) or build a transport (:class:`~clawray.weight_sync.controller.WeightSyncController`).

Placement itself is Ray's: ``learner.resources`` and ``rollout.resources`` (custom Ray resources, e.g.
``{learner_node: 1}``) make each learner rank / policy engine request resources that only the nodes
started with them offer (``ray start --resources='{"learner_node": 8}'``), so learners and engines
land on their own node groups with config changes only. This module answers the questions that
placement raises at run time:

* :func:`actor_locations`: the Ray node address (and GPU ids) each actor runs on, asked inside the
  actor (``ray.util.get_node_ip_address()``), so no actor class needs a method for it;
* :func:`resolve_transport`: ``sync.transport: auto`` becomes ``ipc`` when every engine shares the
  sender's (learner rank 0's) host (and, on GPU, its GPU; on CPU, room in its ``/dev/shm``), else
  ``collective``; a forced ``ipc``
  across hosts is refused with the engines and hosts named (shared-memory files and CUDA IPC handles
  do not cross machines).

Invariant: a *host* is a node address; two Ray nodes with one address share a machine (and its
``/dev/shm``), so ``ipc`` works between them.
"""

from __future__ import annotations

from typing import Any


def _location(_actor: Any) -> tuple[str, tuple[str, ...]]:
    import ray

    from clawray.ray_env import node_ip

    return node_ip(), tuple(str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", []))


def actor_locations(actors: dict[str, Any], timeout_s: float = 60.0) -> dict[str, tuple[str, tuple[str, ...]]]:
    """``{name: (Ray node address, GPU ids Ray assigned)}`` of each actor handle, asked inside the
    actor (``__ray_call__``, queued behind the calls the actor is running: call it when the actors
    are idle).

    Raises:
        ray.exceptions.GetTimeoutError: an actor did not answer in ``timeout_s`` seconds.
        ray.exceptions.RayActorError: an actor is dead.
    """
    import ray

    refs = {name: a.__ray_call__.remote(_location) for name, a in actors.items()}
    found = ray.get(list(refs.values()), timeout=timeout_s)
    return {name: (ip, tuple(gpus)) for name, (ip, gpus) in zip(refs, found)}


def actor_node_ips(actors: dict[str, Any], timeout_s: float = 60.0) -> dict[str, str]:
    """``{name: Ray node address}`` of each actor handle (see :func:`actor_locations`)."""
    return {name: loc[0] for name, loc in actor_locations(actors, timeout_s).items()}


IPC_SHM_ROOM = 1.5  # auto picks ipc on CPU only when /dev/shm has this many times the weights' bytes free


def shm_free_bytes(_actor: Any = None) -> int | None:
    """Free bytes in ``/dev/shm`` where this runs (None without one): where ipc's CPU buffers live.
    Takes (and ignores) an actor, so that ``__ray_call__`` can ask it inside one."""
    import shutil

    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return None


def resolve_transport(
    requested: str,
    sender: tuple[str, tuple[str, ...]],
    receivers: dict[str, tuple[str, tuple[str, ...]]],
    shm_free: int | None = None,
    payload: int = 0,
) -> str:
    """The weight-sync transport to build for this placement.

    Args:
        requested: ``sync.transport`` (``"auto"``, ``"ipc"``, ``"collective"``, ``"object_store"``).
        sender: ``(node address, GPU ids)`` of the sender (learner rank 0; no GPU ids on CPU).
        receivers: ``{engine name: (node address, GPU ids)}``.
        shm_free: free bytes in the sender's ``/dev/shm`` (:func:`shm_free_bytes`; None: unknown).
        payload: bytes of one copy of the weights (:func:`clawray.weight_sync.plan.plan_bytes`).

    Returns:
        for ``auto``: ``"ipc"`` when every receiver is on the sender's host and, if the sender holds
        GPUs, was given the same GPUs (CUDA IPC handles open only on a device the receiver sees; Ray
        hides the others), and, on CPU, the sender's ``/dev/shm`` has :data:`IPC_SHM_ROOM` times
        ``payload`` free (ipc keeps one packed copy of the weights there; Docker's default
        ``/dev/shm`` is 64 MiB); else ``"collective"``. Any other request unchanged.

    Raises:
        ValueError: ``ipc`` was requested but some engine runs on another host (names them).
    """
    sender_ip, sender_gpus = sender
    away = {n: ip for n, (ip, _) in receivers.items() if ip != sender_ip}
    if requested == "auto":
        other_gpu = any(sender_gpus and tuple(gpus) != tuple(sender_gpus) for _, gpus in receivers.values())
        no_room = not sender_gpus and shm_free is not None and shm_free < IPC_SHM_ROOM * payload
        return "collective" if away or other_gpu or no_room else "ipc"
    if requested == "ipc" and away:
        where = ", ".join(f"{n} on {ip}" for n, ip in away.items())
        raise ValueError(
            f"sync.transport=ipc needs every engine on the sender's host, but learner rank 0 runs on "
            f"{sender_ip} and {where}: use sync.transport=auto or collective, or place the engines "
            "with the learners (rollout.resources / learner.resources)"
        )
    return requested

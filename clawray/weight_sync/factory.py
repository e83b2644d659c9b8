"""Build one end of a transport from a :class:`~clawray.weight_sync.transport.TransportSpec`.

Owns: the mapping from a spec's ``kind`` to its implementation (the only module that knows them all,
so they import the interface and never each other: no import loop) and the ipc sender's device. Must
not: build a spec or choose the transport (:class:`~clawray.weight_sync.controller.WeightSyncController`).
"""

from __future__ import annotations


from clawray.ray_env import compute_device
from clawray.weight_sync.collective import CollectiveTransport
from clawray.weight_sync.ipc import IpcTransport
from clawray.weight_sync.object_store import ObjectStoreTransport
from clawray.weight_sync.transport import TransportSpec, WeightTransport


def make_transport(spec: TransportSpec, rank: int, name: str = "") -> WeightTransport:
    """Build end ``rank`` of the transport ``spec`` describes (rank 0 sends, the others receive).

    ``name`` (the receiver's name, e.g. ``"rollout-1"``) is used by ipc in the sender's errors. The
    ipc sender packs on this process's accelerator when it has one (CUDA, like the learner), else on
    CPU. Blocks until every collective member joined.

    A collective's ``spec.host``/``spec.port`` are the rendezvous rank 0 published: its node's
    address and a port bound there (:meth:`WeightSyncController.connect`).

    Raises:
        ValueError: an object_store or ipc spec without a mailbox; a collective without host and port.
    """
    if spec.kind == "collective":
        if not spec.host or not spec.port:
            raise ValueError("the collective transport needs the rendezvous host and port that rank 0 published")
        return CollectiveTransport(
            rank, spec.world_size, spec.host, spec.port, spec.plan, spec.bucket_bytes, spec.timeout_s, spec.backend
        )
    if spec.mailbox is None:
        raise ValueError(f"the {spec.kind} transport needs a WeightMailboxActor handle")
    if spec.kind == "object_store":
        return ObjectStoreTransport(rank, spec.plan, spec.bucket_bytes, spec.timeout_s, spec.mailbox)
    device = compute_device()
    return IpcTransport(
        rank, spec.world_size, spec.plan, spec.bucket_bytes, spec.timeout_s, spec.mailbox, device=device, name=name
    )

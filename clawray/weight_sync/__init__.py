"""Learner -> rollout weight transport: flat, versioned buckets behind one small interface.

Must not: hold code of its own: it only re-exports the parts below.

One file per part, imported in this order (each imports only the ones above it):

* ``plan.py``: the ordered weight plan, its buckets, digest and wire metadata, ``WeightSyncError``.
* ``transport.py``: the interface (:class:`WeightTransport`), the sync header and
  :class:`TransportSpec`, what every member of one group is built from.
* ``collective.py``: :class:`CollectiveTransport`, a stand-alone process group (gloo/NCCL); buckets
  are broadcast from rank 0, packing the next one while the current one is on the wire.
* ``mailbox.py``: :class:`WeightMailbox`, the Ray actor the two mailbox transports post to.
* ``object_store.py``: :class:`ObjectStoreTransport`, the naive ``ray.put`` baseline.
* ``shm.py``: named shared-memory files for ipc on CPU, removed once their creator is gone.
* ``ipc.py``: :class:`IpcTransport`, same host: handles to the sender's buffers (CUDA IPC or shared
  memory), no copy; the colocated path for one GPU.
* ``factory.py``: :func:`make_transport` (spec + rank -> one end).
* ``controller.py``: :class:`WeightSyncController`, the driver's side: build the group, pause the
  engines, sync under a deadline, always resume, name the failed members, rebuild after a failure.

Invariants: a receiver checks the header (version, plan digest) before it yields any weight; a
failed sync never leaves an engine paused; after any failure the next sync rebuilds the group.
"""

from clawray.weight_sync.plan import (
    Bucket,
    WeightSyncError,
    check_plan,
    decode_plan,
    encode_plan,
    plan_buckets,
    plan_diff,
    plan_digest,
)
from clawray.weight_sync.transport import TRANSPORTS, SyncHeader, TransportSpec, WeightTransport
from clawray.weight_sync.collective import CollectiveTransport
from clawray.weight_sync.mailbox import WeightMailbox, WeightMailboxActor
from clawray.weight_sync.object_store import ObjectStoreTransport
from clawray.weight_sync.ipc import IpcTransport, release_buffers
from clawray.weight_sync.factory import make_transport
from clawray.weight_sync.controller import WeightSyncController

__all__ = [
    "TRANSPORTS",
    "Bucket",
    "CollectiveTransport",
    "IpcTransport",
    "ObjectStoreTransport",
    "SyncHeader",
    "TransportSpec",
    "WeightMailbox",
    "WeightMailboxActor",
    "WeightSyncController",
    "WeightSyncError",
    "WeightTransport",
    "check_plan",
    "decode_plan",
    "encode_plan",
    "make_transport",
    "plan_buckets",
    "plan_diff",
    "release_buffers",
    "plan_digest",
]

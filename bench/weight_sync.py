"""Effective weight-sync bandwidth: clawray's CollectiveTransport (flat buckets) against baselines.

One sender and two receivers, each a Ray actor (separate processes), on this machine (gloo over
loopback on CPU). For each state dict the script times one sync as (latest receiver done) - (sender
start) with the system-wide monotonic clock, after one warm-up, and reports the median of ``--reps``:

* ``clawray``: :class:`clawray.weight_sync.CollectiveTransport`, flat buckets of ``--bucket-mb``
  (header + plan metadata + pipelined bucket broadcasts; receivers get per-tensor views).
* ``flat``: one ``broadcast`` of one pre-allocated tensor holding the same bytes (this machine's
  limit: no packing, no header, one collective).
* ``per_tensor``: one ``broadcast`` per tensor, each waited for (the naive sync).
* ``object_store``: :class:`clawray.weight_sync.ObjectStoreTransport` (``ray.put`` per bucket,
  receivers ``ray.get``), same buckets and metadata check.
* ``ipc``: :class:`clawray.weight_sync.IpcTransport` (same host: the sender packs into shared-memory
  buffers and posts handles; receivers map them, no copy, and ack); a receiver is done after its ack.
  Like the others it excludes the engine's load, which copies out of the received buffers either way.

State dicts: the tiny test model, SmolLM2-135M (``~/.cache/clawray/models/smollm2-135m-instruct``,
skipped with a message when absent) and a synthetic ~1 GB bf16 state with Qwen2.5-1.5B layer shapes.
GB/s is payload bytes (sent once) / 1e9 / seconds.

Usage: ``PYTHONPATH=. python bench/weight_sync.py [--reps 3] [--bucket-mb 64] [--only tiny,smollm2,synthetic-1gb]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import ray
import torch

from clawray.engines.base import WeightSpec

SMOLLM2 = os.path.expanduser("~/.cache/clawray/models/smollm2-135m-instruct")
METHODS = ("clawray", "flat", "per_tensor", "object_store", "ipc")


def synthetic_shapes(target_bytes: int = 1 << 30) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2.5-1.5B-like bf16 shapes (hidden 1536, MLP 8960, vocab 151936, GQA 2 KV heads), layers
    added until the state reaches ``target_bytes``: embedding + N decoder layers + final norm."""
    h, inter, kv, vocab = 1536, 8960, 256, 151936
    shapes = [("model.embed_tokens.weight", (vocab, h))]
    layer = [
        ("input_layernorm.weight", (h,)),
        ("self_attn.q_proj.weight", (h, h)),
        ("self_attn.q_proj.bias", (h,)),
        ("self_attn.k_proj.weight", (kv, h)),
        ("self_attn.k_proj.bias", (kv,)),
        ("self_attn.v_proj.weight", (kv, h)),
        ("self_attn.v_proj.bias", (kv,)),
        ("self_attn.o_proj.weight", (h, h)),
        ("post_attention_layernorm.weight", (h,)),
        ("mlp.gate_proj.weight", (inter, h)),
        ("mlp.up_proj.weight", (inter, h)),
        ("mlp.down_proj.weight", (h, inter)),
    ]
    total, i = vocab * h * 2, 0
    while total < target_bytes:
        for name, shape in layer:
            shapes.append((f"model.layers.{i}.{name}", shape))
            total += torch.Size(shape).numel() * 2
        i += 1
    shapes.append(("model.norm.weight", (h,)))
    return shapes


def load_state(which: str, tiny_dir: str) -> dict[str, torch.Tensor]:
    """The named state dict, built inside the sender (so it never travels through Ray)."""
    if which == "synthetic-1gb":
        gen = torch.Generator().manual_seed(0)
        return {n: torch.randn(s, generator=gen, dtype=torch.float32).to(torch.bfloat16) for n, s in synthetic_shapes()}
    from safetensors.torch import load_file

    path = tiny_dir if which == "tiny" else SMOLLM2
    state = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, f)))
    return dict(sorted(state.items()))


class Peer:
    """One process of the benchmark group (rank 0 sends)."""

    def __init__(self, rank: int, world: int):
        torch.set_num_threads(1)
        self.rank, self.world = rank, world
        self.state: dict[str, torch.Tensor] = {}

    def where(self) -> str:
        """Path of the clawray package this process imports."""
        import clawray

        return clawray.__file__

    def load(self, which: str, tiny_dir: str) -> list[WeightSpec]:
        """Build the state (sender) and return its plan."""
        state = load_state(which, tiny_dir)
        if self.rank == 0:
            self.state = state
        return [WeightSpec(k, tuple(v.shape), str(v.dtype)) for k, v in state.items()]

    def connect(self, plan, bucket_bytes: int, port_t: int, port_raw: int, mailbox, ipc_mailbox) -> None:
        """Build clawray's transports and a raw gloo group (for the baselines) on two ports."""
        from datetime import timedelta

        import torch.distributed as dist

        from clawray.weight_sync import CollectiveTransport, IpcTransport, ObjectStoreTransport

        self.plan = plan
        self.coll = CollectiveTransport(self.rank, self.world, "127.0.0.1", port_t, plan, bucket_bytes, timeout_s=300)
        self.obj = ObjectStoreTransport(self.rank, plan, bucket_bytes, 300, mailbox)
        self.ipc = IpcTransport(self.rank, self.world, plan, bucket_bytes, 300, ipc_mailbox, name=f"peer-{self.rank}")
        td = timedelta(seconds=300)
        self._store = dist.TCPStore("127.0.0.1", port_raw, self.world, is_master=self.rank == 0, timeout=td)
        self.pg = dist.ProcessGroupGloo(self._store, self.rank, self.world, td)
        total = sum(torch.Size(s.shape).numel() * getattr(torch, s.dtype[6:]).itemsize for s in plan)
        self.flat = torch.zeros(total, dtype=torch.uint8)  # the one-tensor baseline's buffer
        self.version = 0

    def run(self, method: str) -> float:
        """One sync by ``method``; returns the monotonic time the sender started / a receiver finished."""
        self.version += 1
        if self.rank == 0:
            t = time.monotonic()
            if method == "clawray":
                self.coll.send(self.state, self.version)
            elif method == "object_store":
                self.obj.send(self.state, self.version)
            elif method == "ipc":
                self.ipc.send(self.state, self.version)
            elif method == "flat":
                self.pg.broadcast(self.flat, 0).wait()
            else:
                for s in self.plan:
                    self.pg.broadcast(self.state[s.name], 0).wait()
            return t
        if method in ("clawray", "object_store"):
            tr = self.coll if method == "clawray" else self.obj
            got = [t for _, t in tr.receive(self.version)]
            assert len(got) == len(self.plan)
        elif method == "ipc":
            got = [t for _, t in self.ipc.receive(self.version)]
            assert len(got) == len(self.plan)
            del got
            self.ipc.done()
        elif method == "flat":
            self.pg.broadcast(self.flat, 0).wait()
        else:
            for s in self.plan:
                self.pg.broadcast(torch.empty(s.shape, dtype=getattr(torch, s.dtype[6:])), 0).wait()
        return time.monotonic()


PeerActor = ray.remote(Peer)


def bench_state(which: str, tiny_dir: str, reps: int, bucket_mb: int) -> dict[str, float] | None:
    from clawray.ray_env import free_port
    from clawray.weight_sync import WeightMailboxActor

    peers = [PeerActor.options(num_cpus=0.1).remote(r, 3) for r in range(3)]
    mailbox = WeightMailboxActor.options(num_cpus=0).remote()
    ipc_mailbox = WeightMailboxActor.options(num_cpus=0).remote()  # its own post numbering
    try:
        plan = ray.get([p.load.remote(which, tiny_dir) for p in peers])[0]
        nbytes = sum(torch.Size(s.shape).numel() * getattr(torch, s.dtype[6:]).itemsize for s in plan)
        pt, praw = free_port(), free_port()
        ray.get([p.connect.remote(plan, bucket_mb << 20, pt, praw, mailbox, ipc_mailbox) for p in peers])
        row = {"bytes": nbytes, "tensors": len(plan)}
        for method in METHODS:
            times = []
            for i in range(reps + 1):  # the first is a warm-up
                # receivers first, so that they wait in their collective / fetch before the sender starts
                refs = [p.run.remote(method) for p in peers[1:]]
                time.sleep(0.05)
                t_send = ray.get(peers[0].run.remote(method))
                t_done = max(ray.get(refs))
                if i:
                    times.append(t_done - t_send)
            row[method] = statistics.median(times)
        return row
    finally:
        for a in peers + [mailbox, ipc_mailbox]:
            ray.kill(a)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--only", default="tiny,smollm2,synthetic-1gb")
    ap.add_argument("--json", default="", help="also write the figures as JSON here (bench/summary.py)")
    args = ap.parse_args(argv)

    from clawray.model_folders import build_tiny_model
    from clawray.ray_env import apply_loopback_env

    apply_loopback_env()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # a fresh local instance ("local"), never someone else's running cluster
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=3 << 30,
        log_to_driver=True,
    )
    probe = PeerActor.options(num_cpus=0.1).remote(0, 1)
    print(f"[bench] clawray imported by the actors from {ray.get(probe.where.remote())}", flush=True)
    ray.kill(probe)
    tiny_dir = build_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"))
    rows = {}
    for which in args.only.split(","):
        if which == "smollm2" and not os.path.exists(os.path.join(SMOLLM2, "config.json")):
            print(f"[bench] skipping smollm2: no model at {SMOLLM2} (build it with clawray's model.build=smollm2)")
            continue
        t0 = time.perf_counter()
        rows[which] = bench_state(which, tiny_dir, args.reps, args.bucket_mb)
        print(f"[bench] {which}: done in {time.perf_counter() - t0:.1f}s", flush=True)

    print(
        f"\n1 sender -> 2 receivers, gloo on loopback (CPU), buckets {args.bucket_mb} MiB, median of {args.reps}; "
        "GB/s = payload bytes / 1e9 / seconds"
    )
    head = (
        "| state | tensors | MB | "
        + " | ".join(f"{m} s (GB/s)" for m in METHODS)
        + " | clawray / flat | clawray vs per_tensor | clawray vs object_store | ipc vs clawray |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for which, r in rows.items():
        gb = r["bytes"] / 1e9
        cells = " | ".join(f"{r[m]:.4f} ({gb / r[m]:.2f})" for m in METHODS)
        print(
            f"| {which} | {r['tensors']} | {r['bytes'] / 1e6:.1f} | {cells} | {r['flat'] / r['clawray']:.2f}x "
            f"| {r['per_tensor'] / r['clawray']:.2f}x | {r['object_store'] / r['clawray']:.2f}x "
            f"| {r['clawray'] / r['ipc']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())

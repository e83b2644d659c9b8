"""LearnerGroup: N LearnerWorker actors forming one torch.distributed group, the model under FSDP2.

Owns: the policy's weights, optimizer, scheduler and version, the split of a batch over mini-batches, ranks
and micro-batches, and when an optimizer step is skipped. Must not: choose a batch's samples or advantages
(the driver, :mod:`clawray.batching`), define the loss (:mod:`clawray.algos.losses`), decide when weights
sync (:mod:`clawray.weight_sync`) or commit a checkpoint folder (:mod:`clawray.checkpoint`).

Each call of :meth:`LearnerWorker.train_step` consumes one batch of :class:`~clawray.types.Sample`
refs and takes ``steps_per_batch`` optimizer steps (the batch splits into that many contiguous
mini-batches). A mini-batch's samples are split over the N ranks by padded cost (:func:`balance_ranks`),
each rank's share packed into padded
micro-batches of at most ``max_tokens_per_micro_batch`` tokens (rows x longest sequence) with
gradients accumulated over them. Every rank runs the same number of forward/backward passes
(padding with zero-weight passes) because FSDP2 all-gathers and reduce-scatters in every pass. The
loss is the token-mean over the *mini-batch's* ``loss_mask`` tokens across all ranks; since FSDP2
averages gradients over the N ranks, each rank scales its masked sum by ``N / global_tokens``, which
makes the gradient independent of how samples are packed. ``fsdp_size`` (:func:`data_parallel_mesh`)
shards over all ranks (ZeRO-3), over groups of ranks replicated across the groups (HSDP), or not at
all (every rank holds the whole model; gradients all-reduced): each rank still takes its own share.

Optional: LoRA adapters through peft (only adapters train; weight sync and the HF export carry the
merged weights under the base model's names), activation checkpointing, mixed precision
(``learner.compute_dtype``: bf16 on CUDA and fp32 on CPU by default; fp32 master weights), a constant or cosine learning-rate schedule with linear warmup.

Invariants:
  * Every log-prob forward (policy, proximal, reference) is deterministic, as in the rollout engine:
    the models stay in eval mode, so no dropout (LoRA, attention, hidden) or other stochastic layer
    acts; gradients flow as usual. Activation checkpointing therefore does not rely on the training
    flag (HF's does): each decoder layer's forward runs under ``torch.utils.checkpoint``. Samples made
    by the learner's own weights give ratio 1 and zero mismatch KL (up to fp rounding).
  * ``ratio_anchor: proximal`` (decoupled PPO): the proximal log-probs are those of the weights
    before the batch's first optimizer step. Mini-batch 1 runs on those weights, so its own detached
    log-probs are the anchor; mini-batches 2.. use log-probs computed once per batch by a no-grad
    forward before the first step. The trust region thus acts on every later mini-batch.
"""

from __future__ import annotations

import copy
import dataclasses

import functools
import math
import os
import time
import types
from datetime import timedelta
from typing import TYPE_CHECKING

import ray
import torch

from clawray.actors.learner_checkpoint import load_learner_state, save_hf_folder, save_learner_state
from clawray.checkpoint import learner_compute_dtype
from clawray.algos.losses import (
    SUM_METRICS,
    LossSettings,
    SampleLossInputs,
    batch_loss_metrics,
    sample_loss,
    sequence_logprobs,
    token_entropy,
)
from clawray.algos.schedule import lr_factor
from clawray.config import LearnerConfig, section
from clawray.ray_env import compute_device, reserve_rendezvous, tcp_store, use_node_gloo
from clawray.types import Sample

if TYPE_CHECKING:
    from clawray.weight_sync import TransportSpec


def pack_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sample indices into padded micro-batches of at most ``max_tokens`` tokens.

    A micro-batch costs ``rows * longest`` tokens (the padded ``[B, T]`` input). Samples are taken
    longest first and added to the open micro-batch while the cost stays within the budget (first
    fit on the sorted lengths, which keeps padding low). A sample longer than the budget gets a
    micro-batch of its own (the queue rejects such samples before they reach the learner).

    Args:
        lengths: tokens (prompt + response) per sample.
        max_tokens: the budget in tokens; <= 0 means no limit (one micro-batch).

    Returns:
        lists of indices into ``lengths``; every index appears exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if max_tokens <= 0:
        return [order] if order else []
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def padded_cost(lengths: list[int], max_tokens: int) -> int:
    """The padded ``[B, T]`` slots of :func:`pack_micro_batches`' micro-batches of ``lengths``:
    ``sum(rows * longest)`` over them (the tokens a forward and backward compute)."""
    return sum(len(g) * lengths[g[0]] for g in pack_micro_batches(lengths, max_tokens))


def balance_ranks(lengths: list[int], world_size: int, max_tokens: int) -> list[list[int]]:
    """Split one mini-batch's samples over ``world_size`` ranks so that the slowest rank's work, its
    :func:`padded_cost`, is as small as a split into runs of the length-sorted samples allows.

    A step waits for its slowest rank (every pass is collective), and a rank's forward and backward
    cost its padded slots, so each rank takes a run of similar lengths (little padding) sized to the
    cost. The runs follow the samples sorted longest first; the smallest feasible cap on a rank's
    cost is found by bisection, a run being extended while its cost stays within the cap (a longer
    run of the sorted samples never costs less). When a rank's share needs several micro-batches,
    runs are not always best: dealing sample ``r, r + N, ...`` to rank ``r`` is kept where its slowest
    rank costs less (ties: the smaller total). The same aim as verl's ``balance_batch``
    (Karmarkar-Karp on sequence lengths), here on padded cost since a rank's micro-batches are padded.
    Dealing can cost the slowest rank much more: for lengths ``[133, 80, 110, 93, 82, 102, 87, 77]``
    on 2 ranks it gives 532 and 408 slots, runs 399 and 465.

    Args:
        lengths: tokens (prompt + response) per sample.
        world_size: ranks, >= 1.
        max_tokens: the micro-batch budget (:func:`pack_micro_batches`).

    Returns:
        ``world_size`` lists of indices into ``lengths`` (a rank's list may be empty); every index
        appears exactly once. Deterministic: every rank computes the same split.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))

    def runs(cap: int) -> list[list[int]]:
        out: list[list[int]] = []
        cost = head = rows = 0  # the open run's cost, and its last micro-batch's longest and rows
        for i in order:
            n = lengths[i]
            fits = out and (max_tokens <= 0 or (rows + 1) * head <= max_tokens)
            extra = head if fits else n  # joins the open micro-batch, or opens one of its own
            if out and cost + extra <= cap:
                cost, rows = cost + extra, rows + 1 if fits else 1
                head = head if fits else n
                out[-1].append(i)
            else:
                out.append([i])
                cost, head, rows = n, n, 1
        return out

    if world_size <= 1 or len(order) <= 1:
        return [order] + [[] for _ in range(world_size - 1)]
    lo, hi = max(lengths), padded_cost(lengths, max_tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(runs(mid)) <= world_size:
            hi = mid
        else:
            lo = mid + 1
    split = runs(lo)
    split += [[] for _ in range(world_size - len(split))]
    dealt = [list(range(r, len(lengths), world_size)) for r in range(world_size)]

    def slowest(ranks: list[list[int]]) -> tuple[int, int]:
        costs = [padded_cost([lengths[i] for i in r], max_tokens) for r in ranks]
        return max(costs), sum(costs)

    return min((split, dealt), key=slowest)  # runs can lose to dealing when a rank needs several micro-batches


def response_logits(model: torch.nn.Module, samples: list[Sample], device: torch.device) -> list[torch.Tensor]:
    """Each sample's response logits ``[R_b, V]`` (the positions whose next token is a response token:
    ``prompt_len - 1 .. len(tokens) - 2``) from one forward of the right-padded batch ``[B, T]``.

    Only the response positions reach the vocabulary projection: a forward pre-hook on the model's
    output embedding (``lm_head``) hands it the gathered hidden states ``[1, sum R_b, H]`` in place of
    ``[B, K, H]``. The projection is the costliest matmul of a small model (SmolLM2-135M's 49152 x 576
    is a fifth of its weights), and of the ``B x T`` padded positions the responses are a fifth in the
    demo's samples; its backward likewise touches only the response rows. A model without an output
    embedding, or whose head sees another shape, projects the positions from the shortest prompt's last
    token on (``logits_to_keep``) and the rows are gathered from the logits. Right padding with causal
    attention leaves every real position's values unchanged, so one sample alone and the same sample
    in a padded batch give the same logits (up to fp rounding).
    """
    longest = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : len(s.tokens)] = torch.tensor(s.tokens)
        mask[b, : len(s.tokens)] = 1
    start = min(s.prompt_len for s in samples) - 1  # the first position any sample's loss reads
    keep = torch.arange(start, longest - 1, device=device)
    lengths = [s.response_len for s in samples]
    rows = torch.cat([torch.full((r,), b, dtype=torch.long) for b, r in enumerate(lengths)]).to(device)
    cols = torch.cat([torch.arange(s.prompt_len - 1 - start, len(s.tokens) - 1 - start) for s in samples]).to(device)
    gathered = []

    def response_rows_only(_head: torch.nn.Module, args: tuple) -> tuple | None:
        hidden = args[0]
        if gathered or hidden.dim() != 3 or tuple(hidden.shape[:2]) != (len(samples), len(keep)):
            return None  # not the shape this gather expects: the logits are gathered below
        gathered.append(True)
        return (hidden[rows, cols].unsqueeze(0), *args[1:])

    kwargs = {"input_ids": ids.to(device), "logits_to_keep": keep}
    if len(samples) > 1:
        kwargs["attention_mask"] = mask.to(device)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    handle = head.register_forward_pre_hook(response_rows_only) if head is not None else None
    try:
        logits = model(**kwargs).logits  # [1, sum R_b, V] gathered, else [B, K, V]
    finally:
        if handle is not None:
            handle.remove()
    flat = logits[0] if gathered else logits[rows, cols]  # [sum R_b, V]
    return list(torch.split(flat, lengths))


def mixed_precision(device_type: str, compute_dtype: str = "auto"):
    """FSDP2's mixed-precision policy for a learner on ``device_type`` (``"cuda"`` or ``"cpu"``) computing
    in ``compute_dtype`` (``learner.compute_dtype``; ``auto``: bfloat16 on CUDA, float32 on CPU): that
    dtype for the forward and backward, fp32 master weights, gradient reduction and optimizer. None
    when it computes in float32 (no casts)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = learner_compute_dtype(1.0 if device_type == "cuda" else 0.0, compute_dtype)
    if dtype == "float32":
        return None
    return MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)


def merge_lora_state_dict(
    state: dict[str, torch.Tensor], scalings: dict[str, float], fan_in_fan_out: set[str], adapter: str = "default"
) -> dict[str, torch.Tensor]:
    """The base model's state dict with LoRA deltas merged in, from a peft model's full state dict.

    For every LoRA-wrapped linear ``m``: ``W = W_base + scaling * B @ A`` (LoRA, Hu et al.,
    arXiv 2106.09685, eq. 3) with ``A: [r, in]``, ``B: [out, r]``, ``scaling = alpha / r``
    (transposed for ``fan_in_fan_out`` layers). Names lose peft's ``base_model.model.`` prefix and
    ``.base_layer`` infix, so they equal the base model's names; adapter tensors are dropped. The
    input tensors are not modified.

    Args:
        state: the peft model's full (unsharded) state dict.
        scalings: module name (peft naming) -> its LoRA scaling.
        fan_in_fan_out: module names whose weight is stored ``[in, out]``.
        adapter: the adapter's name.

    Raises:
        ValueError: a DoRA magnitude vector (not supported) or an adapter tensor without its pair.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".lora_magnitude_vector" in name:
            raise ValueError(f"DoRA weights ({name}) cannot be merged here")
        if ".lora_" in name:
            continue
        value = tensor
        if name.endswith(".base_layer.weight"):
            module = name[: -len(".base_layer.weight")]
            if module in scalings:
                a_name, b_name = f"{module}.lora_A.{adapter}.weight", f"{module}.lora_B.{adapter}.weight"
                if a_name not in state or b_name not in state:
                    raise ValueError(f"LoRA module {module} lacks {a_name} or {b_name}")
                delta = state[b_name].float() @ state[a_name].float() * scalings[module]
                if module in fan_in_fan_out:
                    delta = delta.T
                value = (tensor.float() + delta).to(tensor.dtype)
        base = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        out[base] = value
    return out


# A CPU learner's environment: every thread allocates from glibc's main heap, which
# :func:`keep_freed_memory` keeps. Another arena's heap holds at most 64 MiB, so a larger block
# allocated by one of gloo's threads (a 113 MB buffer of SmolLM2's embedding-sized collective, every
# step) was mapped afresh and zero-filled each time: 27,648 page faults per step and rank. Set when the
# process starts (glibc reads it once); the few threads that allocate seldom contend for the heap's lock.
ONE_HEAP = {"MALLOC_ARENA_MAX": "1"}

# ``learner.optimizer_impl`` -> torch.optim.AdamW's keyword (torch picks for-loop on CPU by default).
OPTIMIZER_IMPLS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def data_parallel_mesh(device_type: str, world_size: int, fsdp_size: int):
    """The FSDP2 device mesh of ``world_size`` data-parallel ranks sharded in groups of ``fsdp_size``
    (verl's ``fsdp_size``): ``-1`` or ``world_size`` gives a 1-D mesh (full sharding, ZeRO-3), a
    smaller size the 2-D mesh ``("replicate", "shard")`` of shape ``[world_size / fsdp_size, fsdp_size]``
    (HSDP: each group of ``fsdp_size`` ranks holds one sharded copy, the groups' gradients are
    all-reduced). ``fsdp_size`` 1 replicates the model on every rank like DDP: no all-gather, and one
    all-reduce of the gradients per pass instead of a reduce-scatter; each rank keeps the full weights,
    gradients and AdamW states (16 bytes per parameter in fp32).

    Raises:
        ValueError: ``fsdp_size`` is neither -1 nor a divisor of ``world_size``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    size = world_size if fsdp_size == -1 else fsdp_size
    if size < 1 or world_size % size:
        raise ValueError(f"learner.fsdp_size={fsdp_size} must be -1 or divide learner.num_workers={world_size}")
    if size == world_size:
        return init_device_mesh(device_type, (world_size,))
    return init_device_mesh(device_type, (world_size // size, size), mesh_dim_names=("replicate", "shard"))


def keep_freed_memory(limit: int = 1 << 30) -> bool:
    """Keep freed heap memory in this process for reuse instead of returning it to the kernel (glibc
    ``mallopt``): blocks of up to ``limit`` bytes come from the heap (``M_MMAP_THRESHOLD``), and the
    heap is never trimmed (``M_TRIM_THRESHOLD`` -1).

    A CPU learner step allocates and frees the same large buffers every step (FSDP2's gathered
    weights and gradient buffers, activations, vocabulary-sized gradients). glibc serves a block over
    its mmap threshold (32 MiB at most) with fresh pages that the kernel zero-fills on first touch:
    SmolLM2's 2-rank steps 3-5 took 0.03-0.28 M page faults per rank, 1 rank's 0.16-0.18 M; with the
    blocks kept, 28 k and none (1 rank's system time 0.2-0.28 s per step -> 0.0-0.07 s). And glibc
    returns the heap's free top once it exceeds the trim threshold: with a 1 GiB threshold one rank
    of two, whose step frees more than that at the top, took 0.26-0.36 M page faults every step
    (2-7 s of system time on this VM), none once the heap is not trimmed. The process keeps its peak
    heap. Returns False where there is no glibc ``mallopt`` (nothing changes there).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, limit)) and bool(mallopt(m_trim_threshold, -1))  # -1: never


def prefetch_all_gathers(root, layers: list, depth: int) -> None:
    """Issue each FSDP2 layer's all-gather ``depth`` layers ahead, asynchronously (explicit prefetch).

    FSDP2's implicit prefetch overlaps an all-gather with compute through separate CUDA streams; on
    CPU there are none and the all-gather is issued blocking, so each layer waited for its weights
    (0.5-0.6 s of SmolLM2's 2-rank step on gloo). Here the root prefetches the first ``depth``
    layers and layer ``i`` the next ``depth`` in forward (the previous ``depth`` in backward, which
    gathers again when layers are resharded after forward), with ``async_op=True`` unshards: gloo's
    thread moves them while this layer computes (``FSDPModule.set_modules_to_forward_prefetch``, as
    torchtitan sets it). ``depth`` 0 keeps FSDP2's defaults. Call after every ``fully_shard``.
    """
    if depth <= 0:
        return
    root._set_unshard_async_op(True)
    root.set_modules_to_forward_prefetch(layers[:depth])
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + depth])
        layer.set_modules_to_backward_prefetch(layers[max(i - depth, 0) : i][::-1])


class AsyncReduceScatter:
    """FSDP2's gradient reduce-scatter, and HSDP's all-reduce across replicas, issued asynchronously;
    :meth:`wait` before reading gradients.

    FSDP2 overlaps its reduce-scatter with the backward through a CUDA stream; on CPU it issues the
    collective and waits for it at once, so each layer's backward stalled on gloo (0.7-1.0 s of
    SmolLM2's 2-rank step). Installed with :meth:`install` on every FSDP2 module, this comm issues it
    with ``async_op=True`` and keeps the work with its input and output buffers (FSDP2 drops its
    reference to the input when the next layer reduces; gloo may still be reading it) until the work
    completes, and :meth:`wait` waits for all.

    Exact only while FSDP2 reads no reduced value inside the backward: its post-reduce then only makes
    views of the output (reduce dtype fp32 or bf16 and no ``gradient_divide_factor``: the mean is the
    collective's ``AVG``, no post-division). It *adds* the output to a sharded gradient that already
    exists (accumulation over micro-batches), so set :attr:`overlap` False for a backward that runs
    while gradients exist: the collective is then issued blocking, as FSDP2's default.

    HSDP (``fsdp_size`` below the ranks: a 2-D mesh) all-reduces each layer's reduced gradient across
    the replicas after its reduce-scatter, also blocking without CUDA streams (replicated, 13% of
    SmolLM2's 2-rank step); FSDP2 takes no custom all-reduce, so :meth:`install` points its collectives
    module's ``dist`` at a view of ``torch.distributed`` whose ``all_reduce`` is :meth:`all_reduce`
    (process-wide; FSDP2 calls no other all-reduce). Its post-reduce reads the output under the same
    conditions as above.
    """

    def __init__(self) -> None:
        self.overlap = True
        self._pending: list[tuple] = []  # (work, input, output): the buffers live until the work ends

    def install(self, modules: list) -> None:
        """Make this comm the reduce-scatter of every FSDP2 module in ``modules``
        (``FSDPModule.set_custom_reduce_scatter``)."""
        for module in modules:
            module.set_custom_reduce_scatter(self)
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        _fsdp_collectives.dist = _DistWithAllReduce(self)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of ``size`` for FSDP2 to reduce into or from (``torch.empty``)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        """Reduce-scatter ``input_tensor`` (``[world * n]``) into ``output_tensor`` (``[n]``) over
        ``group`` with ``op``; asynchronous while :attr:`overlap` is True. Returns the work."""
        import torch.distributed as dist

        work = dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=self.overlap
        )
        if self.overlap:
            self._keep(work, input_tensor, output_tensor)
        return work

    def all_reduce(self, tensor, group=None, op=None, async_op: bool = False):
        """All-reduce ``tensor`` in place over ``group`` with ``op`` (``torch.distributed.all_reduce``);
        asynchronous while :attr:`overlap` is True (the caller's ``async_op`` as well). Returns the work."""
        import torch.distributed as dist

        work = dist.all_reduce(tensor, group=group, op=op or dist.ReduceOp.SUM, async_op=async_op or self.overlap)
        if self.overlap and not async_op:
            self._keep(work, tensor, tensor)
        return work

    def _keep(self, work, input_tensor, output_tensor) -> None:
        """Hold ``work`` and its buffers until :meth:`wait`, dropping those of the finished ones (the
        step's peak memory stays FSDP2's)."""
        self._pending = [w for w in self._pending if not w[0].is_completed()]
        self._pending.append((work, input_tensor, output_tensor))

    def wait(self) -> None:
        """Wait for every collective issued since the last call: the sharded gradients are final.
        Raises what the collective raised (a peer gone, ``dist_timeout_s``)."""
        pending, self._pending = self._pending, []
        for work, _, _ in pending:
            work.wait()


class _DistWithAllReduce(types.ModuleType):
    """``torch.distributed`` with ``all_reduce`` routed to an :class:`AsyncReduceScatter`."""

    def __init__(self, comm: AsyncReduceScatter) -> None:
        super().__init__("torch.distributed")
        self.all_reduce = comm.all_reduce

    def __getattr__(self, name: str):
        import torch.distributed as dist

        return getattr(dist, name)


def checkpoint_layers(layers) -> None:
    """Activation checkpointing of each layer, whatever the module's training flag.

    Each layer's ``forward`` is replaced (on the instance; parameter names do not change) by
    ``torch.utils.checkpoint.checkpoint(forward, ..., use_reentrant=False)``: its activations are
    recomputed in the backward pass instead of stored. Non-reentrant checkpointing works with frozen
    inputs (LoRA) and with FSDP2's per-layer hooks, which stay outside the checkpointed region (the
    layer's parameters are all-gathered again before the recompute). HF's own checkpointing acts only
    in train mode, which would also switch on dropout.
    """
    from torch.utils.checkpoint import checkpoint

    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


class LearnerWorker:
    """One FSDP2 rank.

    Two-phase start (addresses come from where the ranks run): the constructor only reserves, on
    rank 0, the group's rendezvous socket on rank 0's own node (:func:`clawray.ray_env.reserve_rendezvous`:
    the node's Ray address, 127.0.0.1 in a local run); :meth:`rendezvous_address` publishes it and
    :meth:`join` (every rank, with that address) forms the process group and shards the model.

    Args:
        rank, world_size: position in the learner group.
        master_port: TCP port rank 0 binds its rendezvous to on its node; 0 = a free one.
        model_path: HF folder of the initial policy.
        cfg: the ``learner`` config section (:class:`clawray.config.LearnerConfig`; a mapping of some
            of its keys is completed with the schema's defaults, :func:`clawray.config.section`).
        loss_weights: the algorithm's advantage mix ``{"w_rl", "w_opd", "opd_adv_clip"}`` (defaults
            1, 1, 0 = no clip; see :func:`clawray.algos.losses.sample_loss`).

    Raises:
        OSError: (rank 0) ``master_port`` is taken on its node.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_port: int,
        model_path: str,
        cfg: LearnerConfig | dict,
        loss_weights: dict | None = None,
    ):
        cfg = section(LearnerConfig, cfg)
        self.rank, self.world_size, self.cfg, self.model_path = rank, world_size, cfg, model_path
        self._loss_weights = loss_weights
        self.master_address = reserve_rendezvous("", master_port) if rank == 0 else None
        self.model = None

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: ``(node address, port)`` of the group's rendezvous, bound on this rank's node."""
        assert self.master_address is not None, "only rank 0 hosts the rendezvous"
        return self.master_address

    def join(self, master_host: str, master_port: int) -> int:
        """Join the learner group at rank 0's published rendezvous ``master_host:master_port`` (gloo
        pairs on loopback when that address is loopback, else on this node's cluster interface; NCCL
        on GPU), load the initial policy and shard it with FSDP2. Returns the rank.

        Raises:
            torch.distributed.DistStoreError: the rendezvous timed out (``dist_timeout_s``).
        """
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        cfg, rank, world_size, model_path, loss_weights = (
            self.cfg,
            self.rank,
            self.world_size,
            self.model_path,
            self._loss_weights,
        )
        torch.set_num_threads(cfg.torch_threads)
        self.device = torch.device(compute_device())  # the GPU only when Ray gave this rank one
        if self.device.type == "cpu":
            keep_freed_memory()
        # on CUDA, NCCL for the model's tensors and gloo for the CPU tensors the step all-reduces
        # (its counts, the non-finite flag, the metric sums): a group of NCCL alone refuses CPU tensors
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=cfg.dist_timeout_s)
        use_node_gloo(master_host)
        self.master_address = (master_host, master_port)
        dist.init_process_group(
            backend,
            store=tcp_store(master_host, master_port, world_size, rank == 0, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        torch.manual_seed(0)  # same seed on every rank: LoRA's A matrices start identical everywhere
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        model.config.use_cache = False
        if cfg.activation_checkpointing:
            checkpoint_layers(self._hf_model(model).model.layers)
        model = self._with_lora(model)
        if cfg.freeze_embeddings:
            hf = self._hf_model(model)
            hf.get_input_embeddings().requires_grad_(False)
            if hf.get_output_embeddings() is not None:
                hf.get_output_embeddings().requires_grad_(False)
        mesh = data_parallel_mesh(self.device.type, world_size, cfg.fsdp_size)
        shard_kwargs: dict = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
        policy = mixed_precision(self.device.type, cfg.compute_dtype)
        if policy is not None:
            shard_kwargs["mp_policy"] = policy
        layers = list(self._hf_model(model).model.layers)
        for layer in layers:
            fully_shard(layer, **shard_kwargs)
        fully_shard(model, **shard_kwargs)  # after get_peft_model: the adapters are sharded with their layer
        self._reduce_scatter = None
        if self.device.type == "cpu":
            prefetch_all_gathers(model, layers, cfg.prefetch_layers)
            if cfg.async_reduce_scatter and world_size > 1:
                self._reduce_scatter = AsyncReduceScatter()
                self._reduce_scatter.install([*layers, model])
        self.model = model.eval()  # deterministic log-probs: no dropout (see the module docstring)
        self.ref_model = None
        if cfg.kl_coef > 0:  # a frozen full copy of the initial policy, only when KL is on
            # computing in the policy's compute dtype: an fp32 reference beside a bf16 policy made the KL
            # non-zero before any update
            ref_dtype = getattr(torch, learner_compute_dtype(float(self.device.type == "cuda"), cfg.compute_dtype))
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=ref_dtype).to(self.device)
            self.ref_model.eval().requires_grad_(False)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self._build_optimizer(loss_weights)
        self.version = 0
        self._transport = None
        self._staged: tuple[int, dict | None] | None = None  # (version, rank 0's full weights): stage_weights
        self.skipped_steps = 0
        self.optimizer_steps = 0

    def _with_lora(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` wrapped with LoRA adapters (``lora.rank`` > 0, peft), else ``model``; records
        each adapter's scaling and fan-in/fan-out layout for the merged weights sent to the engines."""
        lora = self.cfg.lora
        self.lora_rank = lora.rank
        self._lora_scalings: dict[str, float] = {}
        self._lora_fan_in_fan_out: set[str] = set()
        if self.lora_rank <= 0:
            return model
        from peft import LoraConfig, get_peft_model
        from peft.tuners.lora import LoraLayer

        config = LoraConfig(
            r=self.lora_rank,
            lora_alpha=float(lora.alpha),
            lora_dropout=float(lora.dropout),
            target_modules=list(lora.target_modules),
            bias="none",
        )
        model = get_peft_model(model, config)
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer) and "default" in module.scaling:
                self._lora_scalings[name] = float(module.scaling["default"])
                if getattr(module, "fan_in_fan_out", False):
                    self._lora_fan_in_fan_out.add(name)
        return model

    def _build_optimizer(self, loss_weights: dict | None) -> None:
        """AdamW over the trainable parameters, the learning-rate schedule and the loss settings
        (PPO clip, KL, aggregation; ``loss_weights``: the algorithm's ``w_rl``, ``w_opd``,
        ``opd_adv_clip``).

        Raises:
            ValueError: a learning-rate schedule that :func:`lr_factor` refuses.
        """
        cfg = self.cfg
        self.optimizer = torch.optim.AdamW(
            self.trainable,
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            weight_decay=cfg.weight_decay,
            **OPTIMIZER_IMPLS[cfg.optimizer_impl],
        )
        schedule = (cfg.lr_schedule, cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio)
        lr_factor(0, *schedule)  # raises on a bad schedule here rather than at the first step
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(step, *schedule))
        weights = {"w_rl": 1.0, "w_opd": 1.0, "opd_adv_clip": 0.0, **(loss_weights or {})}
        self.loss_settings = LossSettings(
            eps=cfg.eps,
            eps_high=cfg.eps_high,
            dual_clip=cfg.dual_clip or None,
            tis_cap=cfg.tis_cap or None,
            proximal=cfg.ratio_anchor == "proximal",
            agg_mode=cfg.agg_mode,
            kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator,
            w_rl=weights["w_rl"],
            w_opd=weights["w_opd"],
            opd_adv_clip=weights["opd_adv_clip"] or None,
        )

    @staticmethod
    def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
        """The transformers model inside a peft wrapper (the model itself without LoRA)."""
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def ready(self) -> int:
        """Rank (after :meth:`join`, once the model is sharded, since actor calls run in order)."""
        return self.rank

    def _full_state_dict(self, merged: bool = True) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict on rank 0, CPU; empty on other ranks. Collective.

        With LoRA and ``merged`` it is the *merged* weights under the base model's names
        (:func:`merge_lora_state_dict`), computed from copies: the training weights are not touched.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if merged and self.lora_rank > 0 and self.rank == 0:
            state = merge_lora_state_dict(state, self._lora_scalings, self._lora_fan_in_fan_out)
        return state

    def state_dict(self, merged: bool = True) -> dict[str, torch.Tensor]:
        """Full CPU state dict on rank 0 (``{}`` elsewhere); ``merged=False`` keeps peft's names and
        adapter tensors. Collective: call on every rank."""
        return self._full_state_dict(merged)

    def gradients(self) -> dict[str, torch.Tensor]:
        """The full gradients left by the last optimizer step (peft names), on rank 0; ``{}`` elsewhere.
        For tests and debugging. Collective: call on every rank."""
        out = {}
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().cpu().clone()
        return out if self.rank == 0 else {}

    # ------------------------------------------------------------------ training
    def _forward(self, samples: list[Sample], model: torch.nn.Module) -> list[torch.Tensor]:
        """Each sample's response logits ``[R_b, V]``: :func:`response_logits` on this rank's device."""
        return response_logits(model, samples, self.device)

    def _padding_pass(self) -> torch.Tensor:
        """A one-token forward whose loss is 0 (with zero gradients): FSDP2 needs every rank in every
        collective, so a rank with fewer micro-batches runs these."""
        return self.model(input_ids=torch.tensor([[0]], device=self.device)).logits.sum() * 0.0

    @torch.no_grad()
    def _proximal_logprobs(
        self, fetched: dict[int, Sample], packs: list[list[list[int]]], passes: torch.Tensor
    ) -> dict[int, torch.Tensor]:
        """Log-probs ``[R]`` (response tokens, float32, at the sample's temperature) of the current
        weights for the samples of mini-batches 2.. (``packs[1:]``), keyed by batch index.

        Called once per batch before the first optimizer step, so these are the proximal policy's
        log-probs of decoupled PPO (Hilton et al., arXiv 2110.00641; AReaL, arXiv 2505.24298). One
        no-grad forward per sample, in the same micro-batches (and padding passes: collective) as
        training; mini-batch 1 needs none (it trains on these very weights).
        """
        out: dict[int, torch.Tensor] = {}
        for j in range(1, len(packs)):
            for p in range(int(passes[j])):
                if p >= len(packs[j]):
                    self._padding_pass()
                    continue
                samples = [fetched[i] for i in packs[j][p]]
                logits_all = self._forward(samples, self.model)
                for b, (i, s) in enumerate(zip(packs[j][p], samples)):
                    targets = torch.tensor(s.tokens[s.prompt_len :], device=self.device)
                    out[i] = sequence_logprobs(logits_all[b], targets, s.temperature)
        return out

    def _micro_batch_loss(
        self,
        samples: list[Sample],
        advs: list[float],
        norm_tokens: float,
        norm_seqs: float,
        entropy_coef: float,
        fresh: list[bool],
        proximal: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """Sum of the samples' losses (:func:`clawray.algos.losses.sample_loss`, each already
        normalised by the global mini-batch size) and each sample's metrics by name.

        ``fresh``: per sample, whether these weights sampled it (its mismatch counts in
        ``inv/logprob_mismatch_kl``). ``proximal``: with the proximal anchor, each sample's proximal log-probs ``[R]``
        (:meth:`_proximal_logprobs`); None in the first mini-batch, where the current weights are the
        proximal ones and the forward's own detached log-probs serve.
        """
        logits_all = self._forward(samples, self.model)
        ref_all = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_all = self._forward(samples, self.ref_model)
        total = torch.zeros((), device=self.device)
        metrics = []
        for b, s in enumerate(samples):
            out = sample_loss(
                self._loss_inputs(
                    s, logits_all, ref_all, b, advs[b], norm_tokens, norm_seqs, entropy_coef, fresh[b], proximal
                ),
                self.loss_settings,
            )
            total = total + out.loss
            metrics.append(out.metrics)
        return total, metrics

    def _loss_inputs(
        self,
        s: Sample,
        logits_all: list[torch.Tensor],
        ref_all: list[torch.Tensor] | None,
        b: int,
        adv: float,
        norm_tokens: float,
        norm_seqs: float,
        entropy_coef: float,
        fresh: bool,
        proximal: list[torch.Tensor] | None,
    ) -> SampleLossInputs:
        """Sample ``s`` (sample ``b`` of the micro-batch's response logits, :meth:`_forward`) as loss
        inputs (tensors on the learner's device)."""
        dev = self.device
        targets = torch.tensor(s.tokens[s.prompt_len :], device=dev)
        topk = s.teacher_topk_ids is not None
        return SampleLossInputs(
            logits=logits_all[b],
            targets=targets,
            loss_mask=torch.tensor(s.loss_mask, dtype=torch.float32, device=dev),
            rollout_logprobs=torch.tensor(s.rollout_logprobs, dtype=torch.float32, device=dev),
            advantage=adv,
            temperature=s.temperature,
            num_tokens=norm_tokens,
            num_seqs=norm_seqs,
            entropy_coef=entropy_coef,
            teacher_logprobs=(
                None
                if s.teacher_logprobs is None
                else torch.tensor(s.teacher_logprobs, dtype=torch.float32, device=dev)
            ),
            teacher_topk_logprobs=torch.tensor(s.teacher_topk_logprobs, device=dev) if topk else None,
            teacher_topk_ids=torch.tensor(s.teacher_topk_ids, device=dev) if topk else None,
            ref_logprobs=(None if ref_all is None else sequence_logprobs(ref_all[b], targets, s.temperature)),
            proximal_logprobs=None if proximal is None else proximal[b],
            fresh=fresh,
        )

    def train_step(
        self,
        sample_refs: list,
        version: int,
        advantages: list[float] | None = None,
        entropy_coef: float = 0.0,
        probe: list | None = None,
        probe_wait_s: float = 0.0,
        versions: list[int] | None = None,
        lengths: list[int] | None = None,
    ) -> dict:
        """``steps_per_batch`` optimizer steps on a batch; the step produces policy ``version``.

        The batch splits into ``steps_per_batch`` contiguous mini-batches (one optimizer step each,
        gradient-norm clipped at ``grad_clip``, learning rate from the schedule); the mini-batch is split
        over the ranks (:func:`balance_ranks`) and each rank packs its share into micro-batches (:func:`pack_micro_batches`) and accumulates their gradients. The
        per-sample loss (:meth:`_micro_batch_loss`) is normalised by the mini-batch's global token (or
        sequence) count: packing changes neither loss nor gradient. With ``ratio_anchor: proximal``
        and two or more mini-batches, the proximal log-probs of mini-batches 2.. are computed before
        any optimizer step (:meth:`_proximal_logprobs`, a no-grad forward per such sample).

        Args:
            sample_refs: the whole batch's ``ObjectRef[Sample]`` list (each rank takes its share).
            version: the policy version the updated weights will carry.
            advantages: one scalar per sample (after the driver's guards), or None for raw rewards.
            entropy_coef: the entropy-bonus coefficient for this step.
            probe: ``[ObjectRef]`` (a list: Ray does not wait for it) of a reply the engines sampled
                from this step's starting weights (:class:`~clawray.mismatch_probe.MismatchProbe`),
                awaited after the first mini-batch's backward (at most ``probe_wait_s`` s, logged as
                ``timing/probe_wait_s``) and scored before the first optimizer step (a no-grad forward
                per rank); skipped unless ready and of this learner's version on every rank.
            versions: per sample, the policy version the queue holds it at (re-stamped when its version
                was discarded by a rollback, a resume or a learner rebuild: the sample's own
                ``policy_version`` may then name a reused number); None: the samples' own. A sample of
                the first mini-batch at this learner's version was sampled by these weights: its
                mismatch counts in ``inv/logprob_mismatch_kl``.
            lengths: per sample, its tokens (``SampleMeta.num_tokens``), which split the batch over the
                ranks; None: every rank fetches every sample of the batch to read them.

        Returns:
            metrics reduced over ranks: ``loss``, ``pg_loss``, ``kl`` and ``grad_norm`` (means over
            mini-batches, before clipping), ``lr`` (of the last optimizer step), ``num_tokens``,
            ``num_samples``, ``micro_batches`` (passes per rank), ``perf/padding_frac`` (padding /
            padded ``[B, T]`` slots), ``optimizer_steps``, ``skipped`` (1: no optimizer step; a
            non-finite loss or gradient skips its mini-batch, and so does one without a loss token or
            with an all-zero gradient, ``no_gradient_mini_batches``: the weights stay bit-identical;
            ``nonfinite_mini_batches`` counts the former, whose samples leave every metric below;
            ``untrained_samples``: their batch indexes, a list)
            and the invariants ``inv/entropy``, ``inv/entropy_p10``, ``inv/entropy_min``,
            ``inv/adv_std``, ``inv/ratio_mean``, ``inv/ratio_max``, ``inv/clip_frac``,
            ``inv/is_weight_mean``, ``inv/effective_token_rate`` and ``inv/logprob_mismatch_kl`` (the
            probe's tokens and the first mini-batch's fresh samples': same weights on both sides;
            nan without any) over ``inv/mismatch_tokens`` (``inv/mismatch_probe_tokens`` the probe's).
        """
        t0 = time.perf_counter()
        self._staged = None  # the step changes the weights
        plan = self._plan(sample_refs, advantages, versions, lengths)
        self.model.eval()  # never train mode: dropout would make the log-probs stochastic
        probe_sums, probe_waited, proximal = (0.0, 0.0), 0.0, None  # proximal: mini-batches 2.. (see above)
        if self.loss_settings.proximal and plan.num_mini > 1:
            proximal = self._proximal_logprobs(plan.fetched, plan.packs, plan.passes)
        per_sample: list[dict[str, torch.Tensor]] = []  # sample_loss metrics by name, on the device
        grad_norms, lr = [], self.optimizer.param_groups[0]["lr"]
        no_gradient = nonfinite = 0  # mini-batches without an optimizer step (see Returns)
        untrained: list[int] = []  # batch indexes of the non-finite mini-batches' samples
        for j in range(plan.num_mini):
            start = len(per_sample)
            outcome = self._mini_batch(plan, j, entropy_coef, proximal if j > 0 else None, per_sample)
            if j == 0:  # the weights are still the ones the probe was sampled from
                probe_sums, probe_waited = self._probe_mismatch(probe, probe_wait_s)
            if outcome == "no_gradient":
                no_gradient += 1
            elif outcome == "nonfinite":  # its samples were not trained: their metrics are not the step's
                nonfinite += 1
                del per_sample[start:]
                untrained += range(plan.bounds[j], plan.bounds[j + 1])
            else:  # a finite gradient norm: the mini-batch's optimizer step
                grad_norms.append(outcome)
                lr = self._optimizer_step()
        skipped = not grad_norms
        if skipped:
            self.skipped_steps += 1
        else:
            self.version = version
        counts = plan.counts  # per mini-batch, over all ranks: [..., padded [B, T] slots, real tokens]
        return {
            **self._reduce_loss_metrics(per_sample, max(plan.num_mini - nonfinite, 1), probe_sums),
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else math.nan,
            "lr": lr,
            "micro_batches": float(plan.passes.sum().item()),
            "perf/padding_frac": 1.0 - float(counts[:, 3].sum()) / max(float(counts[:, 2].sum()), 1.0),
            "optimizer_steps": float(len(grad_norms)),
            "no_gradient_mini_batches": float(no_gradient),
            "nonfinite_mini_batches": float(nonfinite),
            "untrained_samples": untrained,
            "skipped": float(skipped),
            "train_s": time.perf_counter() - t0,
            "timing/probe_wait_s": probe_waited,
        }

    def _optimizer_step(self) -> float:
        """One AdamW step and one learning-rate schedule step; returns the learning rate it used."""
        lr = self.optimizer.param_groups[0]["lr"]
        self._drop_gathered()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1
        return lr

    def _drop_gathered(self) -> None:
        """Free every layer's gathered (unsharded) weights; called before the shards change.

        With ``reshard_after_forward: false`` a forward without a backward (the mismatch probe, the
        proximal log-probs, :meth:`probe_invariants`) leaves the gathered weights in place, and the
        next forward reuses them: after an optimizer step, a restore or a checkpoint load they would
        be the old weights. Not collective (it only frees memory)."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _plan(
        self, sample_refs: list, advantages: list[float] | None, versions: list[int] | None, lengths: list[int] | None
    ) -> "_StepPlan":
        """Fetch this rank's share of the batch and pack it: ``steps_per_batch`` contiguous
        mini-batches, each split over the ranks by :func:`balance_ranks` on ``lengths``, packed into
        micro-batches (:func:`pack_micro_batches`); the all-reduced counts of every mini-batch and the
        most micro-batches any rank runs in it (the others run padding passes). Collective."""
        import torch.distributed as dist

        cfg, n = self.cfg, self.world_size
        total = len(sample_refs)
        num_mini = max(1, min(cfg.steps_per_batch, total))
        bounds = [round(j * total / num_mini) for j in range(num_mini + 1)]
        fetched: dict = {}
        if lengths is None:  # read them from the samples: the whole batch on every rank
            fetched = dict(enumerate(ray.get(list(sample_refs)) if total else []))
            lengths = [len(fetched[i].tokens) for i in range(total)]
        budget = cfg.max_tokens_per_micro_batch
        mine = [
            [bounds[j] + k for k in balance_ranks(lengths[bounds[j] : bounds[j + 1]], n, budget)[self.rank]]
            for j in range(num_mini)
        ]
        flat = [i for idx in mine for i in idx]
        if fetched:
            fetched = {i: fetched[i] for i in flat}
        else:
            fetched = dict(zip(flat, ray.get([sample_refs[i] for i in flat]) if flat else []))
        adv_of = {i: float(advantages[i]) if advantages is not None else float(fetched[i].reward or 0.0) for i in flat}
        version_of = {i: int(versions[i]) if versions is not None else fetched[i].policy_version for i in flat}
        packs = [
            [[idx[k] for k in group] for group in pack_micro_batches([len(fetched[i].tokens) for i in idx], budget)]
            for idx in mine
        ]
        # global counts per mini-batch (sums): loss tokens, samples, and the micro-batches' padded
        # [B, T] slots and real tokens (perf/padding_frac); micro-batches: max over ranks
        counts = torch.tensor(
            [
                [
                    float(sum(sum(fetched[i].loss_mask) for i in idx)),
                    float(len(idx)),
                    float(sum(len(g) * len(fetched[g[0]].tokens) for g in packs[j])),
                    float(sum(len(fetched[i].tokens) for i in idx)),
                ]
                for j, idx in enumerate(mine)
            ],
            dtype=torch.float64,
        )
        dist.all_reduce(counts)
        passes = torch.tensor([len(p) for p in packs], dtype=torch.int64)
        dist.all_reduce(passes, op=dist.ReduceOp.MAX)
        return _StepPlan(num_mini, fetched, adv_of, version_of, packs, counts, passes, bounds)

    def _mini_batch(
        self, plan: "_StepPlan", j: int, entropy_coef: float, proximal: dict | None, per_sample: list
    ) -> float | str:
        """Accumulate mini-batch ``j``'s gradient over its micro-batches (padding passes where this
        rank has fewer) and clip it; appends the samples' loss metrics to ``per_sample``. Returns the
        gradient norm (before clipping) when the optimizer may step, ``"no_gradient"`` (no loss token
        on any rank, or an all-zero gradient: AdamW would still decay the weights and move its
        moments) or ``"nonfinite"`` (a non-finite loss or gradient on any rank); the gradient is
        cleared in both cases. Collective: every rank reaches the same answer."""
        import torch.distributed as dist

        counts, n = plan.counts, self.world_size
        if counts[j, 0].item() == 0:  # no loss token on any rank (counts is all-reduced: all ranks agree)
            return "no_gradient"
        norm_tokens, norm_seqs = max(counts[j, 0].item(), 1.0) / n, max(counts[j, 1].item(), 1.0) / n
        self.optimizer.zero_grad(set_to_none=True)
        nonfinite = torch.zeros((), dtype=torch.float64, device=self.device)  # no host sync per micro-batch
        for p in range(int(plan.passes[j])):
            if p < len(plan.packs[j]):
                group = plan.packs[j][p]
                samples, advs = [plan.fetched[i] for i in group], [plan.adv_of[i] for i in group]
                anchors = [proximal[i] for i in group] if proximal is not None else None
                # fresh: sampled by exactly these weights (later mini-batches run on updated weights)
                fresh = [j == 0 and plan.version_of[i] == self.version for i in group]
                loss, metrics = self._micro_batch_loss(
                    samples, advs, norm_tokens, norm_seqs, entropy_coef, fresh, anchors
                )
                per_sample += metrics
            else:  # padding pass: FSDP2 needs every rank in every collective; contributes zero grad
                loss = self._padding_pass()
            bad = ~torch.isfinite(loss)
            nonfinite += bad
            # a non-finite loss backpropagates as zero (the mini-batch is skipped anyway)
            self._backward(torch.where(bad, torch.nan_to_num(loss) * 0.0, loss), accumulating=p > 0)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        nonfinite = nonfinite.reshape(1).cpu()  # one host copy per mini-batch (gloo reduces on the CPU)
        dist.all_reduce(nonfinite)
        if nonfinite.item() > 0 or not torch.isfinite(grad_norm).item():
            self.optimizer.zero_grad(set_to_none=True)
            return "nonfinite"
        if grad_norm.item() == 0.0:  # e.g. every advantage 0 and no KL/entropy term: nothing to learn
            self.optimizer.zero_grad(set_to_none=True)
            return "no_gradient"
        return float(grad_norm.item())

    def _backward(self, loss: torch.Tensor, accumulating: bool) -> None:
        """``loss.backward()``; the gradients are final (all reduce-scatters done) when it returns.
        ``accumulating``: the sharded gradients already hold an earlier pass's (the reduce-scatter is
        then blocking: FSDP2 adds its output at once, see :class:`AsyncReduceScatter`)."""
        if self._reduce_scatter is None:
            loss.backward()
            return
        self._reduce_scatter.overlap = not accumulating
        try:
            loss.backward()
        finally:
            self._reduce_scatter.wait()

    @torch.no_grad()
    def _probe_mismatch(self, probe: list | None, wait_s: float) -> tuple[tuple[float, float], float]:
        """``((sum of k3 terms, tokens), seconds waited)``: the mismatch between the probe's rollout
        log-probs and these weights' (:func:`~clawray.algos.invariants.mismatch_kl_sum`, at the
        probe's temperature), counted on rank 0. Collective: the ranks agree (a MIN all-reduce) on
        whether every one of them holds a valid probe, then each runs the forward (FSDP2 gathers in
        it); ``(0, 0)`` when not."""
        import torch.distributed as dist

        from clawray.algos.invariants import mismatch_kl_sum

        t0, sample = time.perf_counter(), None
        if probe:
            ready, _ = ray.wait(list(probe), timeout=wait_s)
            if ready:
                try:
                    sample = ray.get(ready[0])
                except ray.exceptions.RayError:  # the engine failed or restarted: no probe this step
                    sample = None
        waited = time.perf_counter() - t0
        versions = [] if sample is None else (sample.token_versions or [sample.policy_version])
        valid = torch.tensor([float(sample is not None and all(v == self.version for v in versions))])
        dist.all_reduce(valid, op=dist.ReduceOp.MIN)
        if valid.item() == 0.0:
            return (0.0, 0.0), waited
        logits = self._forward([sample], self.model)[0]
        targets = torch.tensor(sample.tokens[sample.prompt_len :], device=self.device)
        learner = sequence_logprobs(logits, targets, sample.temperature)
        if self.rank != 0:
            return (0.0, 0.0), waited
        rollout = torch.tensor(sample.rollout_logprobs, dtype=torch.float32, device=self.device)
        return (float(mismatch_kl_sum(rollout, learner, torch.ones_like(rollout))), float(sample.response_len)), waited

    def _reduce_loss_metrics(
        self, per_sample: list[dict[str, torch.Tensor]], num_mini: int, probe: tuple[float, float] = (0.0, 0.0)
    ) -> dict[str, float]:
        """:func:`clawray.algos.losses.batch_loss_metrics` over every rank's samples, the probe's
        mismatch sums (:meth:`_probe_mismatch`) added. Collective: one host copy of the summed
        metrics per step, a sum and a max all-reduce and an entropy all-gather."""
        import torch.distributed as dist

        sums = torch.zeros(len(SUM_METRICS) + 1, dtype=torch.float64)
        ratio_max = torch.zeros(1, dtype=torch.float64)
        mine = torch.zeros(0, dtype=torch.float64)
        if per_sample:
            sums[:-1] = torch.stack([sum(m[k] for m in per_sample) for k in SUM_METRICS]).cpu()
            ratio_max = torch.stack([m["ratio_max"] for m in per_sample]).max().reshape(1).cpu()
            mine = torch.cat([m["token_entropy"] for m in per_sample]).cpu()
        sums[SUM_METRICS.index("mismatch_kl_sum")] += probe[0]
        sums[SUM_METRICS.index("mismatch_tokens")] += probe[1]
        sums[-1] = probe[1]
        dist.all_reduce(sums)
        dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        out = batch_loss_metrics(
            dict(zip(SUM_METRICS, sums.tolist())), ratio_max.item(), torch.cat(gathered), self.world_size, num_mini
        )
        out["inv/mismatch_tokens"] = float(sums[SUM_METRICS.index("mismatch_tokens")])
        out["inv/mismatch_probe_tokens"] = float(sums[-1])
        return out

    # ------------------------------------------------------------------ weight sync
    def sync_rendezvous(self, host: str = "") -> tuple[str, int]:
        """Rank 0: bind the weight-sync group's rendezvous on this node now (``host`` "" = this node's
        Ray address, :func:`clawray.ray_env.reserve_rendezvous`) and return ``(host, port)`` for the
        driver to publish; the next :meth:`init_weight_sender` with that address serves it."""
        assert self.rank == 0, "only rank 0 hosts the weight-sync rendezvous"
        return reserve_rendezvous(host, 0)

    def init_weight_sender(self, spec: TransportSpec, check: bool = True) -> None:
        """Rank 0 (re)joins the weight-sync transport ``spec`` describes as the sender; other ranks no-op.

        With ``check`` (the first time) every rank gathers the state dict (collective over the learner
        group) and rank 0 checks ``spec.plan`` against it; a rebuild after a failed sync passes
        ``check=False``. See :func:`clawray.weight_sync.make_transport`.

        Raises:
            WeightSyncError: the engines' plan names a weight the learner lacks or a different shape.
        """
        from clawray.weight_sync import check_plan, make_transport

        state = self._full_state_dict() if check else None
        if self.rank != 0:
            return
        if state is not None:
            check_plan(spec.plan, state)
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._transport = make_transport(spec, 0)

    def release_weight_sender(self) -> int:
        """Close the weight-sync sender and remove its ipc buffer files (before the rank is killed:
        :mod:`clawray.weight_sync.shm`); returns how many files were removed."""
        from clawray.weight_sync import release_buffers

        if self._transport is not None:
            self._transport.close()
            self._transport = None
        return release_buffers()

    def stage_weights(self, version: int) -> dict:
        """Gather the full weights (every rank, collective) for the sync to ``version`` ahead of it,
        while the engines still serve; rank 0 keeps them for :meth:`sync_weights`, which then only
        sends. A train step or a checkpoint load drops them.

        Returns:
            on rank 0 ``{"gather_s"}``; ``{}`` on other ranks.
        """
        t0 = time.perf_counter()
        state = self._full_state_dict()
        self._staged = (version, state if self.rank == 0 else None)
        return {"gather_s": time.perf_counter() - t0} if self.rank == 0 else {}

    def sync_weights(self, version: int) -> dict:
        """Broadcast the full weights from rank 0 stamped ``version``: those :meth:`stage_weights`
        gathered for ``version``, else gathered now (every rank).

        Returns:
            on rank 0 ``{"bytes", "gather_s", "send_s"}`` (``gather_s`` 0 when staged); ``{}`` on
            other ranks.
        """
        staged, self._staged = self._staged, None
        if staged is not None and staged[0] == version:
            state, gather_s = staged[1], 0.0
        else:
            t0 = time.perf_counter()
            state = self._full_state_dict()
            gather_s = time.perf_counter() - t0
        if self.rank != 0:
            return {}
        stats = self._transport.send(state, version)
        return {"bytes": stats["bytes"], "gather_s": gather_s, "send_s": stats["seconds"]}

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str) -> None:
        """Write the full model as an HF folder at ``path`` (collective; rank 0 writes): merged
        weights under the base names with LoRA, plus the initial folder's tokenizer and config files
        (:func:`~clawray.actors.learner_checkpoint.save_hf_folder`)."""
        state = self._full_state_dict()
        if self.rank == 0:
            save_hf_folder(self._hf_model(self.model), state, self.model_path, path)

    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> dict:
        """Write this learner's part of a checkpoint into the existing folder ``path``: ``model/``
        (:meth:`save`), then ``train_state/``, ``rng/`` and ``learner.pkl``
        (:mod:`clawray.actors.learner_checkpoint` has the layout). ``save_optimizer=False`` writes no
        ``train_state/`` (a model-only checkpoint, not resumable). Collective.

        Returns:
            ``{"version", "seconds"}`` on every rank.
        """
        t0 = time.perf_counter()
        self.save(os.path.join(path, "model"))
        meta = {
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "world_size": self.world_size,
            "lora_rank": self.lora_rank,
            "weights": "model" if self.lora_rank == 0 else "adapters",
        }
        save_learner_state(path, self.model, self.optimizer, self.rank, meta, save_optimizer)
        return {"version": self.version, "seconds": time.perf_counter() - t0}

    def load_checkpoint(self, path: str) -> dict:
        """Restore weights, optimizer, scheduler, version and this rank's RNG states from a checkpoint
        folder written by :meth:`save_checkpoint`
        (:func:`~clawray.actors.learner_checkpoint.load_learner_state`). Collective.

        Returns:
            ``{"version", "optimizer_steps", "lr", "base_lr"}`` (``base_lr``: the schedule's base
            rate, back-offs included: the checkpoint's, whatever this run's ``learner.lr``).

        Raises:
            FileNotFoundError: ``path`` lacks ``train_state/`` or ``learner.pkl``.
            ValueError: the checkpoint was made with a different LoRA rank.
        """
        self._staged = None  # gathered from the weights this replaces
        self._drop_gathered()
        hf = self._hf_model(self.model)
        meta = load_learner_state(path, self.model, hf, self.optimizer, self.rank, self.lora_rank)
        self.scheduler.load_state_dict(meta["scheduler"])
        self.version, self.optimizer_steps, self.skipped_steps = (
            meta["version"],
            meta["optimizer_steps"],
            meta["skipped_steps"],
        )
        return {
            "version": self.version,
            "optimizer_steps": self.optimizer_steps,
            "lr": self.optimizer.param_groups[0]["lr"],
            "base_lr": float(self.scheduler.base_lrs[0]),
        }

    # ------------------------------------------------------------------ promotion gate (rollback point)
    @torch.no_grad()
    def probe_invariants(self, samples: list[Sample]) -> dict:
        """The promotion gate's invariant guards (:mod:`clawray.gate`) at this version: the policy
        entropy and the engine/learner log-prob mismatch on replies the engines sampled from these very
        weights. Collective: every rank must call it with the same ``samples`` (one no-grad forward
        each; FSDP2 gathers in it). Samples with a token of another version are skipped alike on
        every rank.

        Args:
            samples: engine replies (``rollout_logprobs`` at the sample's temperature).

        Returns:
            ``{"entropy", "mismatch_kl", "tokens"}``: the mean token entropy of ``softmax(logits / T)``
            (nats, as ``inv/entropy``), the k3 estimate of ``KL(rollout || learner)`` per token (as
            ``inv/logprob_mismatch_kl``, :func:`~clawray.algos.invariants.mismatch_kl_sum`) and the
            tokens they are over; both nan without a usable reply.
        """
        from clawray.algos.invariants import mismatch_kl_sum

        entropy = kl = 0.0
        tokens = 0
        for s in samples:
            versions = s.token_versions or [s.policy_version]
            if s.response_len == 0 or any(v != self.version for v in versions):
                continue
            logits = self._forward([s], self.model)[0]  # [R, V]
            t = s.temperature if s.temperature > 0 else 1.0
            entropy += float(token_entropy(logits.float() / t).double().sum())
            targets = torch.tensor(s.tokens[s.prompt_len :], device=self.device)
            learner = sequence_logprobs(logits, targets, s.temperature)
            rollout = torch.tensor(s.rollout_logprobs, dtype=torch.float32, device=self.device)
            kl += float(mismatch_kl_sum(rollout, learner, torch.ones_like(rollout)))
            tokens += s.response_len
        if tokens == 0:
            return {"entropy": math.nan, "mismatch_kl": math.nan, "tokens": 0}
        return {"entropy": entropy / tokens, "mismatch_kl": kl / tokens, "tokens": tokens}

    def get_version(self) -> int:
        """The policy version these weights carry (the last step that updated them)."""
        return self.version

    def keep_promoted(self) -> dict:
        """Keep this rank's training state as the promoted version's rollback point, in host memory
        (:mod:`clawray.gate`): a CPU copy of its shard of every trainable parameter and of their AdamW
        moments, the scheduler's state, the learning rates, the version and step counters. Replaces
        the previous point.

        Returns:
            ``{"version", "bytes"}``: the point's version and this rank's bytes kept.
        """
        params = [_local(p).detach().to("cpu", copy=True) for p in self.trainable]
        moments = [
            {k: _local(v).detach().to("cpu", copy=True) for k, v in self.optimizer.state.get(p, {}).items()}
            for p in self.trainable
        ]
        self._promoted = {
            "params": params,
            "moments": moments,
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),
            "lrs": [g["lr"] for g in self.optimizer.param_groups],
            "counters": (self.version, self.optimizer_steps, self.skipped_steps),
            "backoff": 1.0,  # the product of the lr factors of the restores since this point
        }
        held = [*params, *(t for m in moments for t in m.values())]
        return {"version": self.version, "bytes": sum(t.numel() * t.element_size() for t in held)}

    def restore_promoted(self, lr_factor: float = 1.0) -> dict:
        """Return to the rollback point of :meth:`keep_promoted`: the weights, the AdamW moments
        (cleared where there were none), the scheduler, version and counters, bit for bit; then
        multiply the learning rate by ``lr_factor`` (the schedule's base rates too, so the back-off
        lasts). Back-offs since the point compound (two rejections at 0.5: x0.25) and a restore at
        1.0 keeps them. Collective only in the sense that every rank must call it.

        Returns:
            ``{"version", "lr"}`` after the restore.

        Raises:
            RuntimeError: no point was kept.
        """
        point = getattr(self, "_promoted", None)
        if point is None:
            raise RuntimeError("no promoted version kept (keep_promoted was never called)")
        self._staged = None  # gathered from the weights this replaces
        self._drop_gathered()
        with torch.no_grad():
            for p, saved in zip(self.trainable, point["params"]):
                _local(p).copy_(saved)
            for p, saved in zip(self.trainable, point["moments"]):
                if not saved:
                    self.optimizer.state.pop(p, None)
                    continue
                state = self.optimizer.state[p]
                for k, v in saved.items():
                    if k in state:
                        _local(state[k]).copy_(v)
                    else:
                        state[k] = v.clone().to(_local(p).device)
        # back-offs compound, and a restore at factor 1 (a withdrawn candidate) keeps the earlier ones
        point["backoff"] *= lr_factor
        self.scheduler.load_state_dict(copy.deepcopy(point["scheduler"]))
        self.scheduler.base_lrs = [b * point["backoff"] for b in self.scheduler.base_lrs]
        for g, lr in zip(self.optimizer.param_groups, point["lrs"]):
            g["lr"] = lr * point["backoff"]
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        self.version, self.optimizer_steps, self.skipped_steps = point["counters"]
        return {"version": self.version, "lr": self.optimizer.param_groups[0]["lr"]}


class LearnerStartError(RuntimeError):
    """The learner group could not start: its placement group was not granted in time, or a rank
    failed to start (a model it cannot load, a LoRA target the model lacks); one line with the cause."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter or optimizer state (a DTensor), else ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _cause(error: BaseException) -> str:
    """One line naming the original exception behind a Ray error (a worker's constructor raising
    surfaces as ``ActorDiedError`` whose text holds the traceback): the last line of its message
    that reads ``SomeError: ...``, else the first line."""
    text = str(error).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    named = [
        ln
        for ln in lines
        if ln.split(":", 1)[0].replace(".", "").isidentifier()
        and ":" in ln
        and ln.split(":", 1)[0].endswith(("Error", "Exception"))
    ]
    return named[-1] if named else (lines[0] if lines else type(error).__name__)


# The Ray actor class. The plain class above stays importable, so Ray pickles it by reference.
LearnerWorkerActor = ray.remote(LearnerWorker)


class LearnerGroup:
    """Driver-side handle of the N LearnerWorker actors, gang-scheduled in one placement group
    (one bundle per rank: ``num_cpus`` CPUs, on GPU ``num_gpus`` GPUs, plus the custom Ray resources
    of ``learner.resources``, which place the ranks on the nodes that offer them; strategy ``PACK``:
    one node when the ranks fit, else spread over several). Rank 0 binds the group's rendezvous on
    its own node and publishes it (``rendezvous``: ``(node address, port)``).

    Args:
        model_path: initial policy folder.
        cfg: the ``learner`` config section (:class:`clawray.config.LearnerConfig`, or a mapping of some
            of its keys).
        master_port: port rank 0 binds the FSDP group's rendezvous to on its node; 0 = a free one.
        placement_timeout_s: how long to wait for the cluster to grant the bundles.

    Raises:
        LearnerStartError: the placement group could not be scheduled in time (names the bundles and the
            cluster's resources), or a worker failed to start (names the rank and the cause, e.g. an
            exception in its constructor). Either way every worker created is killed and the
            placement group removed before raising: nothing stays reserved.
    """

    def __init__(
        self,
        model_path: str,
        cfg: LearnerConfig | dict,
        master_port: int = 0,
        placement_timeout_s: float = 120.0,
        loss_weights: dict | None = None,
    ):
        from ray.util.placement_group import placement_group

        cfg = section(LearnerConfig, cfg)
        n = cfg.num_workers
        bundle = {"CPU": float(cfg.num_cpus), **{k: float(v) for k, v in cfg.resources.items()}}
        if cfg.num_gpus:
            bundle["GPU"] = float(cfg.num_gpus)
        self.workers: list = []
        self.rendezvous: tuple[str, int] | None = None
        self.placement_group = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        try:
            try:
                ray.get(self.placement_group.ready(), timeout=placement_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise LearnerStartError(
                    f"the learner placement group ({n} x {bundle}) was not granted within "
                    f"{placement_timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}"
                ) from None
            self._start_workers(n, model_path, cfg, master_port, loss_weights)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(
        self, n: int, model_path: str, cfg: LearnerConfig, master_port: int, loss_weights: dict | None
    ) -> None:
        """Create the N workers in the placement group, get rank 0's rendezvous address (bound on its
        node) and wait until every rank has joined at it and sharded its model; the first failure
        raises at once (the other ranks may be blocked in a collective with it)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        for i in range(n):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i)
            self.workers.append(
                LearnerWorkerActor.options(
                    num_cpus=cfg.num_cpus,
                    num_gpus=cfg.num_gpus,
                    resources=dict(cfg.resources) or None,
                    name=None,
                    scheduling_strategy=strategy,
                    runtime_env=None if cfg.num_gpus else {"env_vars": ONE_HEAP},
                ).remote(i, n, master_port, model_path, cfg, loss_weights)
            )
        try:
            self.rendezvous = tuple(ray.get(self.workers[0].rendezvous_address.remote()))
        except ray.exceptions.RayError as e:
            raise LearnerStartError(f"learner rank 0 of {n} failed to start: {_cause(e)}") from e
        rank_of = {w.join.remote(*self.rendezvous): i for i, w in enumerate(self.workers)}
        pending = list(rank_of)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as e:
                raise LearnerStartError(f"learner rank {rank_of[done[0]]} of {n} failed to start: {_cause(e)}") from e

    def shutdown(self) -> None:
        """Kill the workers and release the placement group (idempotent). Rank 0 first removes its
        ipc buffer files (5 s at most: a rank stuck in a step is killed with them, and the next
        sender's :func:`~clawray.weight_sync.shm.sweep` removes them)."""
        try:
            ray.get([w.release_weight_sender.remote() for w in self.workers[:1]], timeout=5)
        except Exception:  # noqa: BLE001 - dead or busy: killed below all the same
            pass
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.workers = []
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None

    def train_step(
        self,
        sample_refs: list,
        version: int,
        advantages: list[float] | None = None,
        entropy_coef: float = 0.0,
        probe: list | None = None,
        probe_wait_s: float = 0.0,
        versions: list[int] | None = None,
        lengths: list[int] | None = None,
    ) -> dict:
        """Run one optimizer step on every rank (see :meth:`LearnerWorker.train_step`); returns rank 0's metrics."""
        args = (sample_refs, version, advantages, entropy_coef, probe, probe_wait_s, versions, lengths)
        return ray.get([w.train_step.remote(*args) for w in self.workers])[0]

    def init_weight_sender(self, spec: TransportSpec, check: bool = True) -> list:
        """Refs of every rank's :meth:`LearnerWorker.init_weight_sender` (run with the receivers)."""
        return [w.init_weight_sender.remote(spec, check) for w in self.workers]

    def stage_weights(self, version: int) -> list:
        """Refs of every rank's :meth:`LearnerWorker.stage_weights`; rank 0's result is first."""
        return [w.stage_weights.remote(version) for w in self.workers]

    def sync_weights(self, version: int) -> list:
        """Refs of every rank's :meth:`LearnerWorker.sync_weights`; rank 0's result is first."""
        return [w.sync_weights.remote(version) for w in self.workers]

    def version(self) -> int:
        """Rank 0's policy version (after any step still running on it: actor calls run in order)."""
        return ray.get(self.workers[0].get_version.remote())

    def keep_promoted(self) -> dict:
        """Every rank keeps its rollback point (:meth:`LearnerWorker.keep_promoted`); returns rank 0's
        result with ``bytes`` summed over ranks."""
        outs = ray.get([w.keep_promoted.remote() for w in self.workers])
        return {**outs[0], "bytes": sum(o["bytes"] for o in outs)}

    def probe_invariants(self, samples: list[Sample]) -> dict:
        """Every rank scores the gate's guard replies (:meth:`LearnerWorker.probe_invariants`); rank 0's result."""
        return ray.get([w.probe_invariants.remote(samples) for w in self.workers])[0]

    def restore_promoted(self, lr_factor: float = 1.0) -> dict:
        """Every rank returns to its rollback point (:meth:`LearnerWorker.restore_promoted`); rank 0's result."""
        return ray.get([w.restore_promoted.remote(lr_factor) for w in self.workers])[0]


@dataclasses.dataclass
class _StepPlan:
    """One rank's share of a train step (:meth:`LearnerWorker._plan`).

    Attributes:
        num_mini: mini-batches (optimizer steps at most).
        fetched: ``{batch index: Sample}`` of this rank's samples.
        adv_of: ``{batch index: advantage}``.
        version_of: ``{batch index: policy version}`` as the queue holds the sample (``train_step``'s
            ``versions``).
        packs: per mini-batch, this rank's micro-batches as lists of batch indexes.
        counts: ``[num_mini, 4]`` float64, all-reduced: loss tokens, samples, padded ``[B, T]`` slots,
            real tokens.
        passes: ``[num_mini]`` int64: the most micro-batches any rank runs in each mini-batch.
        bounds: ``num_mini + 1`` batch indexes: mini-batch ``j`` is ``bounds[j]:bounds[j + 1]``.
    """

    num_mini: int
    fetched: dict
    adv_of: dict
    version_of: dict
    packs: list
    counts: torch.Tensor
    passes: torch.Tensor
    bounds: list

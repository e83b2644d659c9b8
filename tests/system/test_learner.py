"""The learner: FSDP2 against a single-process reference, micro-batch packing invariance, the LR
schedule, LoRA (adapters only, merged weights under base names) on the tiny model."""

import math
import os
import subprocess
import sys

import pytest
import ray
import torch

from clawray.actors.learner import (
    AsyncReduceScatter,
    LearnerGroup,
    balance_ranks,
    merge_lora_state_dict,
    pack_micro_batches,
    padded_cost,
    prefetch_all_gathers,
)
from clawray.algos.losses import ppo_clip_loss, sequence_logprobs
from clawray.algos.schedule import lr_factor
from clawray.config import ConfigError, load_config
from clawray.ray_env import free_port
from clawray.types import Sample
from clawray.weight_sync import TransportSpec

LEARNER = dict(
    num_workers=2,
    num_cpus=0.25,
    torch_threads=1,
    lr=1e-3,
    weight_decay=0.0,
    betas=[0.9, 0.98],
    grad_clip=1.0,
    eps=0.2,
    eps_high=0.28,
    dist_timeout_s=60,
)


# ---------------------------------------------------------------- pure functions
def test_pack_micro_batches_by_padded_tokens():
    # longest first; a micro-batch costs rows x longest
    assert pack_micro_batches([5, 9, 3, 9], 18) == [[1, 3], [0, 2]]
    assert pack_micro_batches([5, 9, 3, 9], 8) == [[1], [3], [0], [2]]  # 9 > 8 runs alone
    assert pack_micro_batches([5, 9, 3, 9], 0) == [[1, 3, 0, 2]]  # no limit
    assert pack_micro_batches([], 10) == []


def test_balance_ranks_gives_each_rank_a_run_of_similar_lengths_sized_to_the_slowest_ranks_cost():
    lengths = [133, 80, 110, 93, 82, 102, 87, 77]  # bench/learner_throughput.py's batch
    split = balance_ranks(lengths, 2, 16384)
    assert split == [[0, 2, 5], [3, 6, 4, 1, 7]]  # 133, 110, 102 | 93, 87, 82, 80, 77
    assert [padded_cost([lengths[i] for i in r], 16384) for r in split] == [399, 465]  # 3 x 133, 5 x 93
    dealt = [[lengths[i] for i in range(r, 8, 2)] for r in range(2)]  # sample r, r + 2, ...: the old split
    assert [padded_cost(d, 16384) for d in dealt] == [532, 408]
    assert balance_ranks(lengths, 1, 0) == [[0, 2, 5, 3, 6, 4, 1, 7]]
    assert balance_ranks([5], 2, 0) == [[0], []]  # fewer samples than ranks: a rank runs padding passes
    assert balance_ranks([], 3, 0) == [[], [], []]
    # runs can lose when a rank's share needs several micro-batches (budget 10): runs 9 | 9, 3, 3
    # cost 9 and 9 + 3 + 3 = 15 (two 9s cannot share one), dealing 3, 9 | 3, 9 costs 12 and 12
    assert balance_ranks([3, 3, 9, 9], 2, 10) == [[0, 2], [1, 3]]


def test_balance_ranks_never_splits_worse_than_dealing_and_places_every_sample_once():
    import random

    rng = random.Random(0)
    for _ in range(500):
        n, ranks, budget = rng.randint(0, 12), rng.randint(1, 4), rng.choice([0, 20, 60, 1000])
        lengths = [rng.randint(1, 50) for _ in range(n)]
        split = balance_ranks(lengths, ranks, budget)
        assert len(split) == ranks and sorted(i for r in split for i in r) == list(range(n))
        slowest = max(padded_cost([lengths[i] for i in r], budget) for r in split)
        dealt = max(padded_cost(lengths[r::ranks], budget) for r in range(ranks))
        assert slowest <= dealt


def test_prefetch_all_gathers_sets_each_layer_the_next_layers_in_forward_and_the_previous_in_backward():
    """Depth 2 over 4 layers: the root prefetches layers 0-1, layer i the next two in forward and the
    previous two (nearest first) in backward, unshards asynchronous; depth 0 changes nothing."""

    class Module:
        def __init__(self, name):
            self.name, self.calls = name, []

        def _set_unshard_async_op(self, on):
            self.calls.append(("async", on))

        def set_modules_to_forward_prefetch(self, mods):
            self.calls.append(("forward", [m.name for m in mods]))

        def set_modules_to_backward_prefetch(self, mods):
            self.calls.append(("backward", [m.name for m in mods]))

    root, layers = Module("root"), [Module(i) for i in range(4)]
    prefetch_all_gathers(root, layers, 0)
    assert root.calls == [] and all(m.calls == [] for m in layers)
    prefetch_all_gathers(root, layers, 2)
    assert root.calls == [("async", True), ("forward", [0, 1])]
    assert [m.calls for m in layers] == [
        [("forward", [1, 2]), ("backward", [])],
        [("forward", [2, 3]), ("backward", [0])],
        [("forward", [3]), ("backward", [1, 0])],
        [("forward", []), ("backward", [2, 1])],
    ]


def test_async_reduce_scatter_keeps_in_flight_buffers_until_done_and_blocks_when_not_overlapping(monkeypatch):
    """Overlapping: each reduce-scatter is issued with ``async_op=True``; a finished one's buffers are
    dropped at the next call, the running ones kept until :meth:`wait`, which waits for each once.
    Not overlapping (a backward that accumulates): issued blocking, nothing kept. Installed on every
    module given, and as the all-reduce FSDP2's collectives call (HSDP across replicas), alike."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    class Work:
        def __init__(self, done):
            self.done, self.waits = done, 0

        def is_completed(self):
            return self.done

        def wait(self):
            self.waits += 1

    issued = []

    def reduce_scatter_single(output, input, group, op, async_op):
        issued.append((output, input, group, op, async_op))
        return Work(done=len(issued) == 1)  # the first finishes at once, the others run on

    def all_reduce(tensor, group, op, async_op):
        issued.append((tensor, tensor, group, op, async_op))
        return Work(done=False)

    monkeypatch.setattr(dist, "reduce_scatter_single", reduce_scatter_single)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(_fsdp_collectives, "dist", _fsdp_collectives.dist)  # restored after the test
    comm = AsyncReduceScatter()
    installed = []

    class Module:
        def set_custom_reduce_scatter(self, c):
            installed.append(c)

    comm.install([Module(), Module()])
    assert installed == [comm, comm]
    buf = comm.allocate((2, 3), dtype=torch.float64, device=torch.device("cpu"))
    assert buf.shape == (2, 3) and buf.dtype == torch.float64
    outs = [torch.zeros(2) for _ in range(3)]
    works = [comm(o, torch.ones(4), "g", "avg") for o in outs]
    assert [x[4] for x in issued] == [True, True, True] and issued[0][2:4] == ("g", "avg")
    assert [w for w, _, o in comm._pending] == works[1:]  # the finished first one's buffers dropped
    assert all(o is outs[k + 1] for k, (_, _, o) in enumerate(comm._pending))
    comm.wait()
    assert [w.waits for w in works] == [0, 1, 1] and comm._pending == []
    comm.overlap = False
    blocking = comm(torch.zeros(2), torch.ones(4), "g", "avg")
    assert issued[-1][4] is False and comm._pending == []
    comm.wait()
    assert blocking.waits == 0
    # FSDP2's collectives module sees torch.distributed with this all-reduce (and the rest unchanged)
    fsdp_dist = _fsdp_collectives.dist
    assert fsdp_dist.ReduceOp is dist.ReduceOp and fsdp_dist.reduce_scatter_single is reduce_scatter_single
    grad = torch.ones(3)
    comm.overlap = True
    reduced = fsdp_dist.all_reduce(grad, group="replicas", op="avg")
    assert issued[-1] == (grad, grad, "replicas", "avg", True) and comm._pending == [(reduced, grad, grad)]
    comm.wait()
    assert reduced.waits == 1 and comm._pending == []
    comm.overlap = False
    fsdp_dist.all_reduce(grad, group="replicas", op="avg")
    assert issued[-1][4] is False and comm._pending == []


_REALLOCATE = """
import sys, torch
from clawray.actors.learner import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
def step(n):  # a 100 MB block, freed at once, then two of 600 MB freed together (1.2 GB at the heap's top)
    torch.empty(25_000_000).fill_(n)
    a, b = torch.empty(150_000_000).fill_(n), torch.empty(150_000_000).fill_(n)
for n in range(2):  # glibc settles its heap in the first ones
    step(n)
before = faults()
for n in range(3):
    step(n)
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt and /proc")
def test_keep_freed_memory_reuses_a_freed_block_without_new_page_faults():
    """A freed 100 MB block and 1.2 GB freed at the heap's top are allocated again three times: by
    default glibc maps fresh pages each time (3 x (24,414 + 292,969) page faults of 4 KiB; a 1 GiB trim
    threshold still returned the 1.2 GB); with :func:`keep_freed_memory` the heap keeps them."""
    counts = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _REALLOCATE, mode], capture_output=True, text=True, check=True)
        counts[mode] = int(out.stdout.split()[-1])
    assert counts["default"] >= 3 * 310_000 and counts["keep"] < 1_000, counts


def test_lr_schedule_exact_values():
    assert [lr_factor(k, "constant", 4) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = [lr_factor(k, "cosine", 2, 6, 0.1) for k in range(10)]
    assert cos[:3] == [0.5, 1.0, 1.0]
    assert cos[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))  # 0.868198
    assert cos[3] == pytest.approx(0.8681980515)
    assert cos[4] == pytest.approx(0.55) and cos[6] == pytest.approx(0.1) and cos[9] == pytest.approx(0.1)
    assert lr_factor(0, "cosine", 0, 10) == 1.0 and lr_factor(5, "cosine", 0, 10) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="total_steps"):
        lr_factor(3, "cosine", 2, 2)
    with pytest.raises(ValueError, match="schedule"):
        lr_factor(0, "linear")


def test_learner_config_keys_and_checks():
    cfg = load_config(
        [],
        [
            "learner.lr_schedule=cosine",
            "learner.total_steps=100",
            "learner.warmup_steps=10",
            "learner.lora.rank=8",
            "learner.lora.target_modules=[q_proj]",
            "checkpoint.every_steps=5",
            "resume=true",
            "learner.max_tokens_per_micro_batch=4096",
            "learner.steps_per_batch=2",
        ],
    )
    assert (cfg.learner.lora.rank, list(cfg.learner.lora.target_modules), cfg.resume) == (8, ["q_proj"], True)
    assert cfg.checkpoint.every_steps == 5 and cfg.checkpoint.keep_last == 2 and cfg.checkpoint.dir == ""
    for bad, fragment in [
        ("learner.lr_schedule=linear", "lr_schedule"),
        ("learner.lr_schedule=cosine", "total_steps"),
        ("learner.max_tokens_per_micro_batch=0", "max_tokens_per_micro_batch"),
        ("learner.steps_per_batch=0", "steps_per_batch"),
        ("learner.lora.rank=-1", "lora"),
        ("checkpoint.keep_last=-1", "checkpoint"),
        ("learner.fsdp_size=0", "fsdp_size"),
        ("learner.fsdp_size=3", "must divide learner.num_workers=2"),
        ("learner.optimizer_impl=adam8bit", "optimizer_impl"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            load_config([], [bad])


def test_merge_lora_state_dict_names_and_values():
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    a, b = torch.randn(2, 4, generator=g), torch.randn(6, 2, generator=g)
    state = {
        "base_model.model.layer.q.base_layer.weight": w,
        "base_model.model.layer.q.base_layer.bias": bias,
        "base_model.model.layer.q.lora_A.default.weight": a,
        "base_model.model.layer.q.lora_B.default.weight": b,
        "base_model.model.norm.weight": torch.ones(4),
    }
    before = {k: v.clone() for k, v in state.items()}
    merged = merge_lora_state_dict(state, {"base_model.model.layer.q": 4.0}, set())
    assert set(merged) == {"layer.q.weight", "layer.q.bias", "norm.weight"}
    assert torch.allclose(merged["layer.q.weight"], w + 4.0 * b @ a)
    assert torch.equal(merged["layer.q.bias"], bias) and torch.equal(merged["norm.weight"], torch.ones(4))
    assert all(torch.equal(state[k], before[k]) for k in state)  # inputs untouched


# ---------------------------------------------------------------- FSDP2 learner (Ray)
def _samples(prompt_lens=(3, 5, 4, 6, 3), resp_lens=(4, 2, 7, 3, 5), logprobs=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        tokens = torch.randint(10, 1000, (p + r,), generator=g).tolist()
        out.append(
            Sample(
                tokens=tokens,
                prompt_len=p,
                loss_mask=[1] * (r - 1) + [k % 2],
                reward=(-1.0) ** k,
                rollout_logprobs=logprobs[k] if logprobs else [-6.9] * r,
                policy_version=0,
            )
        )
    return out


def _reference_step(model_dir, samples, lr):
    """One single-process step: plain model, same loss (token-mean PPO clip over all masked
    tokens), clip at 1.0, AdamW. Returns (loss, grad_norm, grads after clipping, new weights)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    tokens = sum(sum(s.loss_mask) for s in samples)
    loss = 0.0
    for s in samples:
        ids = torch.tensor([s.tokens])
        lp = sequence_logprobs(model(input_ids=ids).logits[0, s.prompt_len - 1 : -1], ids[0, s.prompt_len :])
        mask = torch.tensor(s.loss_mask, dtype=torch.float32)
        loss = (
            loss
            + ppo_clip_loss(
                lp, torch.tensor(s.rollout_logprobs), mask * s.reward, mask, 0.2, 0.28, normalizer=tokens
            ).loss
        )
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return loss.item(), norm.item(), grads, {k: v.clone() for k, v in model.state_dict().items()}


def _on_policy_logprobs(model_dir, samples):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens])
            out.append(
                sequence_logprobs(
                    model(input_ids=ids).logits[0, s.prompt_len - 1 : -1], ids[0, s.prompt_len :]
                ).tolist()
            )
    return out


def _step(group, refs, version):
    m = group.train_step(refs, version)
    grads = ray.get([w.gradients.remote() for w in group.workers])[0]
    weights = ray.get([w.state_dict.remote() for w in group.workers])[0]
    return m, grads, weights


@pytest.mark.slow
def test_fsdp2_two_ranks_equal_single_process_and_packing_invariance(ray_cluster, tiny_model):
    """Same batch (5 samples of different lengths, so one rank runs a padding pass): 2-rank FSDP2 with
    one micro-batch per rank and the gathered weights kept from forward to backward
    (``reshard_after_forward: false``), and 2-rank FSDP2 with one sample per pass plus activation
    checkpointing (all-gathers prefetched two layers ahead), all equal a single-process reference step
    (loss, grad norm, clipped gradients, updated weights) in fp32: the packed step with the gradient
    reduce-scatters asynchronous (the default: read only after the backward) and blocking (FSDP2's),
    the one-per-pass step asynchronous in its first pass and blocking in the passes that accumulate,
    and the one-per-pass step replicated on both ranks (``fsdp_size: 1``: gradients all-reduced across
    the replicas, HSDP's path, asynchronously in the first pass).
    AdamW is fused in the learner, torch's for-loop one in the reference."""
    base = _samples()
    samples = _samples(logprobs=_on_policy_logprobs(tiny_model, base))  # on-policy: ratio 1
    # hand-checked loss: ratio 1 => loss = -sum_i r_i * masked_tokens_i / all masked tokens
    masked = [sum(s.loss_mask) for s in samples]
    hand = -sum(s.reward * n for s, n in zip(samples, masked)) / sum(masked)
    assert masked == [3, 2, 6, 3, 4] and hand == pytest.approx(-(3 - 2 + 6 - 3 + 4) / 18)
    ref_loss, ref_norm, ref_grads, ref_weights = _reference_step(tiny_model, samples, LEARNER["lr"])
    assert ref_loss == pytest.approx(hand, abs=1e-6) and ref_norm > 1.0  # the clip is active

    refs = [ray.put(s) for s in samples]
    results, layouts = {}, {}
    for label, extra in [
        ("packed", {"max_tokens_per_micro_batch": 10_000, "reshard_after_forward": False}),
        (
            "blocking",
            {"max_tokens_per_micro_batch": 10_000, "reshard_after_forward": False, "async_reduce_scatter": False},
        ),
        ("one-per-pass", {"max_tokens_per_micro_batch": 1, "activation_checkpointing": True, "prefetch_layers": 2}),
        ("replicated", {"max_tokens_per_micro_batch": 1, "fsdp_size": 1}),
    ]:
        group = LearnerGroup(tiny_model, {**LEARNER, **extra}, free_port())
        try:
            if label == "packed":  # a CPU learner allocates from one heap (keep_freed_memory keeps it)
                env = ray.get(
                    [w.__ray_call__.remote(lambda _: os.environ.get("MALLOC_ARENA_MAX")) for w in group.workers]
                )
                assert env == ["1", "1"]
            # each rank's (local elements, global elements, mesh dims, fused AdamW): fsdp_size 1 holds every
            # parameter whole on each rank (a 2-D mesh: replicate x a shard group of 1), -1 shards them
            layouts[label] = ray.get(
                [
                    w.__ray_call__.remote(
                        lambda self: (
                            sum(p.to_local().numel() for p in self.model.parameters()),
                            sum(p.numel() for p in self.model.parameters()),
                            next(self.model.parameters()).device_mesh.ndim,
                            self.optimizer.defaults["fused"],
                        )
                    )
                    for w in group.workers
                ]
            )
            results[label] = _step(group, refs, 1)
        finally:
            group.shutdown()
    packed, single, blocking, replicated = (results[k] for k in ("packed", "one-per-pass", "blocking", "replicated"))
    (local0, total, dims, fused), (local1, *_) = layouts["packed"]
    assert local0 + local1 == total and 0 < local0 < total and dims == 1 and fused is True
    assert layouts["replicated"] == [(total, total, 2, True)] * 2
    # lengths 7, 7, 11, 9, 8 over the ranks by padded cost (balance_ranks): rank 0 takes [11, 9], rank 1
    # [8, 7, 7]; one packed micro-batch per rank, or one sample per pass: 2 + 1 padding pass and 3
    assert packed[0]["micro_batches"] == 1 and single[0]["micro_batches"] == replicated[0]["micro_batches"] == 3
    # rank 0 pads to 2 x 11, rank 1 to 3 x 8: 4 of 46 slots (dealing [7, 11, 8] | [7, 9]: 9 of 51)
    assert packed[0]["perf/padding_frac"] == pytest.approx(4 / 46) and single[0]["perf/padding_frac"] == 0.0
    for m, grads, weights in (packed, single, blocking, replicated):
        assert m["loss"] == pytest.approx(hand, abs=1e-6) and m["num_tokens"] == 18 and m["lr"] == 1e-3
        assert m["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
        assert set(grads) == set(ref_grads)
        for k in ref_grads:
            assert torch.allclose(grads[k], ref_grads[k], atol=1e-6, rtol=1e-4), k
        # AdamW's first update is lr * g / (|g| + 1e-8): fp32 summation order moves it only where
        # |g| is near 1e-8, so a handful of elements may differ by up to ~1% of lr, the rest by < 1e-6
        far = 0
        for k in ref_weights:
            assert torch.allclose(weights[k], ref_weights[k], atol=2e-2 * LEARNER["lr"]), k
            far += int(((weights[k] - ref_weights[k]).abs() > 1e-6).sum())
        assert far <= 20 and sum(v.numel() for v in ref_weights.values()) > 500_000
    for k in ref_grads:  # packing does not change the gradient
        assert torch.allclose(packed[1][k], single[1][k], atol=1e-7, rtol=1e-5), k


def _train_state_keys(path) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(path / "train_state")).read_metadata().state_dict_metadata)


def test_full_checkpoint_stores_weights_once_and_resumes_exactly(ray_cluster, tiny_model, tmp_path):
    """Full fine-tuning: ``train_state/`` holds the AdamW state but no weight (``model/`` has them in
    float32); a fresh 2-rank group (activation checkpointing: wrapped parameter names) loads the
    checkpoint and takes the same next step as the original, weight for weight."""
    refs = [ray.put(s) for s in _samples()]
    cfg = {**LEARNER, "activation_checkpointing": True}
    group, resumed = LearnerGroup(tiny_model, cfg, free_port()), None
    try:
        group.train_step(refs, 1, advantages=[1.0, -1.0, 1.0, -1.0, 1.0])
        ray.get([w.save_checkpoint.remote(str(tmp_path)) for w in group.workers])
        keys = _train_state_keys(tmp_path)
        assert keys and not [k for k in keys if k.startswith("model.")]  # optimizer state only
        assert any(k.startswith("optim.state.") and k.endswith(".exp_avg") for k in keys)
        resumed = LearnerGroup(tiny_model, cfg, free_port())
        loaded = ray.get([w.load_checkpoint.remote(str(tmp_path)) for w in resumed.workers])[0]
        assert loaded["version"] == 1 and loaded["optimizer_steps"] == 1
        before = [ray.get([w.state_dict.remote() for w in g.workers])[0] for g in (group, resumed)]
        for k in before[0]:  # the weights read back from model/ are the trained ones, bit for bit
            assert torch.equal(before[0][k], before[1][k]), k
        nxt = [g.train_step(refs, 2, advantages=[1.0, -1.0, 1.0, -1.0, 1.0]) for g in (group, resumed)]
        assert nxt[0]["loss"] == pytest.approx(nxt[1]["loss"], abs=1e-7)
        after = [ray.get([w.state_dict.remote() for w in g.workers])[0] for g in (group, resumed)]
        for k in after[0]:  # same Adam moments: the same update
            assert torch.allclose(after[0][k], after[1][k], atol=1e-7), k
    finally:
        for g in (group, resumed):
            if g is not None:
                g.shutdown()


@pytest.mark.slow
def test_lora_rl_opd_topk_adapters_only_merged_sync_and_schedule(ray_cluster, tiny_model, tmp_path):
    """LoRA on FSDP2 (2 ranks): rl, opd, combine and top-k samples train; only adapter tensors
    change; the merged state dict has exactly the base names and equals base + alpha/r * B @ A, and
    that is what the weight sync delivers to an engine; two optimizer steps per batch follow the
    cosine schedule; a checkpoint loaded into a fresh group continues exactly like the original."""
    from transformers import AutoModelForCausalLM

    from clawray.actors.rollout import RolloutEngineActor

    base_sd = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    cfg = {
        **LEARNER,
        "lr": 1e-2,
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        "steps_per_batch": 2,
        "lr_schedule": "cosine",
        "warmup_steps": 1,
        "total_steps": 5,
        "min_lr_ratio": 0.1,
        "max_tokens_per_micro_batch": 24,
    }
    p = [5, 6, 7]
    rl = Sample(
        tokens=p + [11, 12, 13],
        prompt_len=3,
        loss_mask=[1, 1, 1],
        rollout_logprobs=[-7.0] * 3,
        reward=1.0,
        policy_version=0,
    )
    opd = Sample(
        tokens=p + [21, 22, 23, 24],
        prompt_len=3,
        loss_mask=[1] * 4,
        rollout_logprobs=[-7.0] * 4,
        reward=None,
        policy_version=0,
        kind="opd",
        teacher_logprobs=[-5.0, -9.0, -6.0, -8.0],
    )
    combine = Sample(
        tokens=p + [31, 32],
        prompt_len=3,
        loss_mask=[1, 1],
        rollout_logprobs=[-7.0] * 2,
        reward=-1.0,
        policy_version=0,
        kind="combine",
        teacher_logprobs=[-6.0, -6.5],
    )
    topk = Sample(
        tokens=p + [41, 42],
        prompt_len=3,
        loss_mask=[1, 1],
        rollout_logprobs=[-7.0] * 2,
        reward=None,
        policy_version=0,
        kind="opd",
        teacher_topk_ids=[[41, 1, 2], [42, 3, 4]],
        teacher_topk_logprobs=[[-0.5, -2.0, -3.0], [-0.7, -1.5, -3.5]],
    )
    refs = [ray.put(s) for s in (rl, opd, combine, topk)]
    group = LearnerGroup(tiny_model, cfg, free_port())
    engine = RolloutEngineActor.options(num_cpus=0.25).remote(
        tiny_model, {"backend": "hf", "torch_threads": 1, "max_batch_size": 8}, name="rollout-lora"
    )
    resumed = None
    try:
        ray.get(engine.ready.remote())
        plan = ray.get(engine.weight_specs.remote())
        port = free_port()
        spec = TransportSpec("collective", 2, plan, bucket_bytes=1 << 20, timeout_s=60, port=port)
        ray.get(
            group.init_weight_sender(spec)  # checks the merged names against the engine's plan
            + [engine.init_weight_receiver.remote(1, spec)]
        )
        raw0 = ray.get([w.state_dict.remote(merged=False) for w in group.workers])[0]
        lora_keys = [k for k in raw0 if ".lora_" in k]
        assert len(lora_keys) == 2 * 3 * 2  # A and B x 3 modules x 2 layers
        lrs = []
        for version in (1, 2):
            m = group.train_step(refs, version, advantages=[1.0, 0.0, -1.0, 0.0])
            assert m["skipped"] == 0.0 and m["optimizer_steps"] == 2 and math.isfinite(m["loss"])
            lrs.append(m["lr"])
        # optimizer steps 0..3 have factors 1 (warmup), 1, 0.1 + 0.45 (1 + cos(pi/4)), 0.1 + 0.45; each
        # train_step reports the lr of its last optimizer step (1 and 3)
        assert lrs == pytest.approx([1e-2, 1e-2 * (0.1 + 0.9 * 0.5)])
        raw = ray.get([w.state_dict.remote(merged=False) for w in group.workers])[0]
        merged = ray.get([w.state_dict.remote() for w in group.workers])[0]
        ray.get(group.sync_weights(2) + [engine.receive_weights.remote(2)])
        prompt, response = [5, 6, 7, 8], [21, 22, 23]
        scored = ray.get(engine.logprobs.remote(prompt, response))

        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        ray.get([w.save_checkpoint.remote(str(ckpt)) for w in group.workers])
        assert {k for k in _train_state_keys(ckpt) if k.startswith("model.")} == {f"model.{k}" for k in lora_keys}
        resumed = LearnerGroup(tiny_model, cfg, free_port())
        loaded = ray.get([w.load_checkpoint.remote(str(ckpt)) for w in resumed.workers])[0]
        assert loaded["version"] == 2 and loaded["optimizer_steps"] == 4
        assert loaded["lr"] == pytest.approx(1e-2 * (0.1 + 0.45 * (1 + math.cos(3 * math.pi / 4))))
        nxt = [g.train_step(refs, 3, advantages=[1.0, 0.0, -1.0, 0.0]) for g in (group, resumed)]
        assert nxt[0]["loss"] == pytest.approx(nxt[1]["loss"], abs=1e-7) and nxt[0]["lr"] == nxt[1]["lr"]
        after = [ray.get([w.state_dict.remote(merged=False) for w in g.workers])[0] for g in (group, resumed)]
        for k in after[0]:  # same weights, Adam moments and schedule: the same update
            assert torch.allclose(after[0][k], after[1][k], atol=1e-7), k
    finally:
        for g in (group, resumed):
            if g is not None:
                g.shutdown()
        ray.kill(engine)
    for k in raw:
        if ".lora_" in k:
            assert not torch.equal(raw[k], raw0[k]), f"adapter {k} did not train"
        else:
            assert torch.equal(raw[k], raw0[k]), f"frozen {k} changed"
    assert set(merged) == set(base_sd)  # exactly the engine's (base) names
    scale = 8.0 / 4
    n_merged = 0
    for name, value in merged.items():
        module = "base_model.model." + name.removesuffix(".weight")
        a_key = f"{module}.lora_A.default.weight"
        expected = base_sd[name]
        if name.endswith(".weight") and a_key in raw:
            expected = base_sd[name] + scale * raw[f"{module}.lora_B.default.weight"] @ raw[a_key]
            n_merged += 1
            assert not torch.allclose(value, base_sd[name])
        assert torch.allclose(value, expected, atol=1e-6), name
    assert n_merged == 6
    # the engine received the merged weights: its log-probs equal a plain model loaded with them
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.load_state_dict(merged)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        expected_lp = sequence_logprobs(model(input_ids=ids).logits[0, 3:-1], ids[0, 4:]).tolist()
    assert scored == pytest.approx(expected_lp, abs=1e-5)

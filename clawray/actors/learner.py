"""LearnerGroup: N LearnerWorker actors forming one torch.distributed group, the model under FSDP2.

Each optimizer step consumes one batch of :class:`~clawray.types.Sample` refs. Rank ``r`` trains
samples ``r, r + N, ...``; every rank runs the same number of forward/backward passes (padding with
zero-weight passes) because FSDP2 all-gathers and reduce-scatters in every pass. The loss is the
token-mean over the *global* batch's ``loss_mask`` tokens; since FSDP2 averages gradients over the
N ranks, each rank scales its masked sum by ``N / global_tokens``.
"""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta

import ray
import torch

from clawray.algos.advantages import binary_advantages
from clawray.algos.losses import ppo_clip_loss, sequence_logprobs, token_entropy
from clawray.types import Sample


class LearnerWorker:
    """One FSDP2 rank.

    Args:
        rank, world_size: position in the learner group.
        master_port: TCP port of the group's rendezvous on 127.0.0.1 (rank 0 hosts it).
        model_path: HF folder of the initial policy.
        cfg: the ``learner`` section of the config, as a plain dict.
    """

    def __init__(self, rank: int, world_size: int, master_port: int, model_path: str, cfg: dict):
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        self.rank, self.world_size, self.cfg = rank, world_size, cfg
        torch.set_num_threads(max(1, int(cfg.get("torch_threads", 1))))
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{master_port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=cfg["dist_timeout_s"]))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        model.config.use_cache = False
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=tuple(cfg["betas"]),
                                           weight_decay=cfg["weight_decay"])
        self.version = 0
        self._transport = None
        self.skipped_steps = 0

    def ready(self) -> int:
        """Rank, once the model is sharded."""
        return self.rank

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict on rank 0, CPU; empty on other ranks. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def weight_names(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the full state dict (collective: call on every rank)."""
        return {k: tuple(v.shape) for k, v in self._full_state_dict().items()}

    # ------------------------------------------------------------------ training
    def _forward_logprobs(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([sample.tokens], device=self.device)
        logits = self.model(input_ids=ids).logits[0, sample.prompt_len - 1 : -1]  # [R, V]
        targets = ids[0, sample.prompt_len:]
        return sequence_logprobs(logits, targets, sample.temperature), logits

    def train_step(self, sample_refs: list, version: int) -> dict:
        """One optimizer step on a batch; the step produces policy ``version``.

        Args:
            sample_refs: the whole batch's ``ObjectRef[Sample]`` list (each rank takes its share).
            version: the policy version the updated weights will carry.

        Returns:
            metrics reduced over ranks (rank 0's dict is the batch's): ``loss``, ``pg_clipfrac``,
            ``ratio_mean``, ``ratio_max``, ``entropy``, ``logprob_abs_diff``, ``grad_norm``,
            ``num_tokens``, ``num_samples``, ``skipped`` (1 when a non-finite loss/grad skipped the step).
        """
        import torch.distributed as dist

        t0 = time.perf_counter()
        n = self.world_size
        mine = sample_refs[self.rank :: n]
        samples: list[Sample] = ray.get(mine) if mine else []
        passes = math.ceil(len(sample_refs) / n)
        local_tokens = float(sum(sum(s.loss_mask) for s in samples))
        totals = torch.tensor([local_tokens], dtype=torch.float64)
        dist.all_reduce(totals)
        global_tokens = max(totals.item(), 1.0)

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(8, dtype=torch.float64)  # loss, clipped, ratio_sum, tokens, entropy, absdiff, nonfinite, samples
        ratio_max = torch.zeros(1, dtype=torch.float64)
        for i in range(passes):
            if i < len(samples):
                s = samples[i]
                logprobs, logits = self._forward_logprobs(s)
                mask = torch.tensor(s.loss_mask, dtype=torch.float32, device=self.device)
                old = torch.tensor(s.rollout_logprobs, dtype=torch.float32, device=self.device)
                reward = torch.tensor([0.0 if s.reward is None else float(s.reward)], device=self.device)
                adv = binary_advantages(reward, mask[None])[0]
                out = ppo_clip_loss(logprobs, old, adv, mask, self.cfg["eps"], self.cfg["eps_high"],
                                    normalizer=global_tokens / n)
                loss = out.loss
                with torch.no_grad():
                    m = mask.bool()
                    ent = token_entropy(logits.detach())[m]
                    sums += torch.tensor([
                        out.loss.item() / n, out.clipped[m].sum().item(), out.ratio[m].sum().item(),
                        m.sum().item(), ent.sum().item(), (logprobs.detach() - old).abs()[m].sum().item(),
                        0.0, 1.0], dtype=torch.float64)
                    if m.any():
                        ratio_max = torch.maximum(ratio_max, out.ratio[m].max().double().reshape(1))
            else:  # padding pass: FSDP2 needs every rank in every collective; contributes zero grad
                ids = torch.tensor([[0]], device=self.device)
                loss = self.model(input_ids=ids).logits.sum() * 0.0
            if not torch.isfinite(loss):
                sums[6] += 1
                loss = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
            loss.backward()

        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["grad_clip"])
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        dist.all_reduce(sums)
        dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
        skipped = sums[6].item() > 0 or not torch.isfinite(grad_norm).item()
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
        else:
            self.optimizer.step()
        self.version = version
        tokens = max(sums[3].item(), 1.0)
        return {
            "loss": sums[0].item(),
            "pg_clipfrac": sums[1].item() / tokens,
            "ratio_mean": sums[2].item() / tokens,
            "ratio_max": ratio_max.item(),
            "entropy": sums[4].item() / tokens,
            "logprob_abs_diff": sums[5].item() / tokens,
            "grad_norm": float(grad_norm.item()),
            "num_tokens": sums[3].item(),
            "num_samples": sums[7].item(),
            "skipped": float(skipped),
            "train_s": time.perf_counter() - t0,
        }

    # ------------------------------------------------------------------ weight sync
    def init_weight_sender(self, world_size: int, host: str, port: int, plan: list, bucket_bytes: int,
                           timeout_s: float, backend: str = "gloo") -> None:
        """Rank 0 joins the weight-sync group as the sender and checks the plan; other ranks no-op.

        Collective over the learner group (every rank gathers the state dict for the check).

        Raises:
            WeightSyncError: the engines' plan names a weight the learner lacks or a different shape.
        """
        from clawray.weight_sync import CollectiveTransport, check_plan

        state = self._full_state_dict()
        if self.rank != 0:
            return
        check_plan(plan, state)
        self._transport = CollectiveTransport(0, world_size, host, port, plan, bucket_bytes, timeout_s, backend)

    def sync_weights(self, version: int) -> dict:
        """Gather the full weights (every rank) and broadcast them from rank 0 stamped ``version``.

        Returns:
            on rank 0 ``{"bytes", "gather_s", "send_s"}``; ``{}`` on other ranks.
        """
        t0 = time.perf_counter()
        state = self._full_state_dict()
        t1 = time.perf_counter()
        if self.rank != 0:
            return {}
        stats = self._transport.send(state, version)
        return {"bytes": stats["bytes"], "gather_s": t1 - t0, "send_s": stats["seconds"]}

    def save(self, path: str) -> None:
        """Write the full model as an HF folder at ``path`` (collective; rank 0 writes)."""
        state = self._full_state_dict()
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            self.model.save_pretrained(path, state_dict=state)


# The Ray actor class. The plain class above stays importable, so Ray pickles it by reference.
LearnerWorkerActor = ray.remote(LearnerWorker)


class LearnerGroup:
    """Driver-side handle of the N LearnerWorker actors.

    Args:
        model_path: initial policy folder.
        cfg: the ``learner`` config section (plain dict).
        master_port: rendezvous port for the FSDP group.
    """

    def __init__(self, model_path: str, cfg: dict, master_port: int):
        n = int(cfg["num_workers"])
        self.workers = [
            LearnerWorkerActor.options(num_cpus=cfg["num_cpus"], name=None).remote(i, n, master_port, model_path, cfg)
            for i in range(n)
        ]
        ray.get([w.ready.remote() for w in self.workers])

    def train_step(self, sample_refs: list, version: int) -> dict:
        """Run one optimizer step on every rank; returns rank 0's metrics."""
        return ray.get([w.train_step.remote(sample_refs, version) for w in self.workers])[0]

    def init_weight_sender(self, **kwargs) -> list:
        """Refs of every rank's :meth:`LearnerWorker.init_weight_sender` (run with the receivers)."""
        return [w.init_weight_sender.remote(**kwargs) for w in self.workers]

    def sync_weights(self, version: int) -> list:
        """Refs of every rank's :meth:`LearnerWorker.sync_weights`; rank 0's result is first."""
        return [w.sync_weights.remote(version) for w in self.workers]

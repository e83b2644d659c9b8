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

from clawray.algos.advantages import opd_advantages
from clawray.algos.losses import (aggregate, kl_penalty, ppo_clip_loss, sequence_logprobs, token_entropy,
                                  topk_reverse_kl)
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
        self.ref_model = None
        if cfg.get("kl_coef", 0.0) > 0:  # a frozen full copy of the initial policy, only when KL is on
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
            self.ref_model.eval().requires_grad_(False)
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

    # ------------------------------------------------------------------ training
    def _forward(self, sample: Sample, with_entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Learner log-probs ``[R]`` of the response tokens, per-token entropies ``[R]`` and the
        temperature-scaled logits ``[R, V]``."""
        ids = torch.tensor([sample.tokens], device=self.device)
        logits = self.model(input_ids=ids).logits[0, sample.prompt_len - 1 : -1]  # [R, V]
        t = sample.temperature if sample.temperature > 0 else 1.0
        logprobs = sequence_logprobs(logits, ids[0, sample.prompt_len:], t)
        scaled = logits / t
        entropy = token_entropy(scaled if with_entropy_grad else scaled.detach())
        return logprobs, entropy, scaled

    def _ref_logprobs(self, sample: Sample) -> torch.Tensor:
        ids = torch.tensor([sample.tokens], device=self.device)
        with torch.no_grad():
            logits = self.ref_model(input_ids=ids).logits[0, sample.prompt_len - 1 : -1]
        return sequence_logprobs(logits, ids[0, sample.prompt_len:], sample.temperature)

    def train_step(self, sample_refs: list, version: int, advantages: list[float] | None = None,
                   entropy_coef: float = 0.0) -> dict:
        """One optimizer step on a batch; the step produces policy ``version``.

        Per sample: token advantages ``A_t = w_rl * a * loss_mask_t`` (``a`` from ``advantages``,
        default the sample's reward) ``+ w_opd * clip(teacher_t - rollout_t)`` when the sample has
        teacher log-probs (OPD / Combine, OpenClaw-RL §4-5); loss = PPO clip (anchor: rollout log-probs, or the proximal policy
        with TIS weights, ``ratio_anchor``) + ``kl_coef`` * KL to the reference - ``entropy_coef`` *
        entropy, each aggregated by ``agg_mode`` over the *global* batch.

        Args:
            sample_refs: the whole batch's ``ObjectRef[Sample]`` list (each rank takes its share).
            version: the policy version the updated weights will carry.
            advantages: one scalar per sample (after the driver's guards), or None for raw rewards.
            entropy_coef: the entropy-bonus coefficient for this step.

        Returns:
            metrics reduced over ranks: ``loss``, ``pg_loss``, ``kl``, ``grad_norm``, ``num_tokens``,
            ``num_samples``, ``skipped`` (a non-finite loss or gradient skipped the step) and the
            invariants ``inv/entropy``, ``inv/entropy_p10``, ``inv/entropy_min``, ``inv/adv_std``,
            ``inv/ratio_mean``, ``inv/ratio_max``, ``inv/clip_frac``, ``inv/is_weight_mean``,
            ``inv/logprob_mismatch_kl`` (fresh samples only, same weights on both sides; nan when
            there are none), ``inv/effective_token_rate``.
        """
        import torch.distributed as dist

        t0 = time.perf_counter()
        cfg, n = self.cfg, self.world_size
        idx = list(range(self.rank, len(sample_refs), n))
        samples: list[Sample] = ray.get([sample_refs[i] for i in idx]) if idx else []
        advs = [float(advantages[i]) if advantages is not None else float(samples[k].reward or 0.0)
                for k, i in enumerate(idx)]
        passes = math.ceil(len(sample_refs) / n)
        totals = torch.tensor([float(sum(sum(s.loss_mask) for s in samples)), float(len(samples))], dtype=torch.float64)
        dist.all_reduce(totals)
        norm_tokens, norm_seqs = max(totals[0].item(), 1.0) / n, max(totals[1].item(), 1.0) / n
        proximal = cfg.get("ratio_anchor", "rollout") == "proximal"

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # sums: loss, pg_loss, kl, clipped, ratio, tokens, adv, adv^2, effective, resp_tokens, nonfinite,
        #       samples, is_weight, mismatch_kl_sum, mismatch_tokens, entropy
        sums = torch.zeros(16, dtype=torch.float64)
        ratio_max = torch.zeros(1, dtype=torch.float64)
        entropies: list[torch.Tensor] = []
        for i in range(passes):
            if i < len(samples):
                s = samples[i]
                logprobs, entropy, scaled = self._forward(s, with_entropy_grad=entropy_coef > 0)
                mask = torch.tensor(s.loss_mask, dtype=torch.float32, device=self.device)
                rollout = torch.tensor(s.rollout_logprobs, dtype=torch.float32, device=self.device)
                adv = mask * advs[i] * cfg.get("w_rl", 1.0)
                if s.teacher_logprobs is not None:  # OPD term (OPD / Combine samples with an accepted hint)
                    teacher = torch.tensor(s.teacher_logprobs, dtype=torch.float32, device=self.device)
                    adv = adv + cfg.get("w_opd", 1.0) * opd_advantages(teacher, rollout, mask,
                                                                       cfg.get("opd_adv_clip") or None)
                agg = dict(mode=cfg.get("agg_mode", "token-mean"), num_tokens=norm_tokens, num_seqs=norm_seqs)
                out = ppo_clip_loss(
                    logprobs, logprobs.detach() if proximal else rollout, adv, mask, cfg["eps"], cfg["eps_high"],
                    normalizer=norm_tokens, dual_clip=cfg.get("dual_clip") or None,
                    behaviour_logprobs=rollout if proximal else None, tis_cap=cfg.get("tis_cap") or None,
                    agg_mode=agg["mode"], num_seqs=norm_seqs)
                loss = out.loss
                if s.teacher_topk_ids is not None:  # top-k distillation replaces the PPO term
                    kl_t = topk_reverse_kl(scaled, torch.tensor(s.teacher_topk_logprobs, device=self.device),
                                           torch.tensor(s.teacher_topk_ids, device=self.device))
                    loss = aggregate(kl_t, mask, **agg)
                kl_value = torch.zeros(())
                if self.ref_model is not None:
                    kl_tok = kl_penalty(logprobs, self._ref_logprobs(s), cfg.get("kl_estimator", "k3"))
                    kl_value = aggregate(kl_tok, mask, **agg)
                    loss = loss + cfg["kl_coef"] * kl_value
                if entropy_coef > 0:
                    loss = loss - entropy_coef * aggregate(entropy, mask, **agg)
                with torch.no_grad():
                    m = mask.bool()
                    entropies.append(entropy.detach()[m].double())
                    fresh = s.policy_version == self.version  # generated by exactly these weights
                    log_r = (logprobs.detach() - rollout)[m].double()  # float64: tiny KLs do not cancel to 0
                    sums += torch.tensor([
                        loss.item(), out.loss.item(), kl_value.item(), out.clipped[m].sum().item(),
                        out.ratio[m].sum().item(), m.sum().item(), adv[m].sum().item(), adv[m].pow(2).sum().item(),
                        ((adv != 0) & m).sum().item(), len(s.loss_mask), 0.0, 1.0, out.is_weight[m].sum().item(),
                        (log_r.exp() - 1 - log_r).sum().item() if fresh else 0.0, m.sum().item() if fresh else 0.0,
                        entropy.detach()[m].sum().item()], dtype=torch.float64)
                    if m.any():
                        ratio_max = torch.maximum(ratio_max, out.ratio[m].max().double().reshape(1))
            else:  # padding pass: FSDP2 needs every rank in every collective; contributes zero grad
                loss = self.model(input_ids=torch.tensor([[0]], device=self.device)).logits.sum() * 0.0
            if not torch.isfinite(loss):
                sums[10] += 1
                loss = torch.nan_to_num(loss) * 0.0
            loss.backward()

        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg["grad_clip"])
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        dist.all_reduce(sums)
        dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
        gathered: list = [None] * n
        dist.all_gather_object(gathered, torch.cat(entropies) if entropies else torch.zeros(0, dtype=torch.float64))
        all_entropy = torch.cat(gathered)
        skipped = sums[10].item() > 0 or not torch.isfinite(grad_norm).item()
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
        else:
            self.optimizer.step()
            self.version = version
        tokens = max(sums[5].item(), 1.0)
        adv_mean = sums[6].item() / tokens
        return {
            "loss": sums[0].item() / n,
            "pg_loss": sums[1].item() / n,
            "kl": sums[2].item() / n,
            "grad_norm": float(grad_norm.item()),
            "num_tokens": sums[5].item(),
            "num_samples": sums[11].item(),
            "skipped": float(skipped),
            "train_s": time.perf_counter() - t0,
            "inv/entropy": sums[15].item() / tokens,
            "inv/entropy_p10": float(torch.quantile(all_entropy, 0.1)) if all_entropy.numel() else math.nan,
            "inv/entropy_min": float(all_entropy.min()) if all_entropy.numel() else math.nan,
            "inv/adv_std": math.sqrt(max(sums[7].item() / tokens - adv_mean**2, 0.0)),
            "inv/ratio_mean": sums[4].item() / tokens,
            "inv/ratio_max": ratio_max.item(),
            "inv/clip_frac": sums[3].item() / tokens,
            "inv/is_weight_mean": sums[12].item() / tokens,
            "inv/logprob_mismatch_kl": sums[13].item() / sums[14].item() if sums[14].item() else math.nan,
            "inv/effective_token_rate": sums[8].item() / max(sums[9].item(), 1.0),
        }

    # ------------------------------------------------------------------ weight sync
    def init_weight_sender(self, world_size: int, host: str, port: int, plan: list, bucket_bytes: int,
                           timeout_s: float, backend: str = "gloo", transport: str = "collective", mailbox=None,
                           check: bool = True) -> None:
        """Rank 0 (re)joins the weight-sync transport as the sender; other ranks no-op.

        With ``check`` (the first time) every rank gathers the state dict (collective over the learner
        group) and rank 0 checks the plan against it; a rebuild after a failed sync passes
        ``check=False``. ``transport``/``mailbox``: see :func:`clawray.weight_sync.make_transport`.

        Raises:
            WeightSyncError: the engines' plan names a weight the learner lacks or a different shape.
        """
        from clawray.weight_sync import check_plan, make_transport

        state = self._full_state_dict() if check else None
        if self.rank != 0:
            return
        if state is not None:
            check_plan(plan, state)
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._transport = make_transport(transport, 0, world_size, plan, bucket_bytes, timeout_s, host=host,
                                         port=port, backend=backend, mailbox=mailbox)

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

    def train_step(self, sample_refs: list, version: int, advantages: list[float] | None = None,
                   entropy_coef: float = 0.0) -> dict:
        """Run one optimizer step on every rank (see :meth:`LearnerWorker.train_step`); returns rank 0's metrics."""
        return ray.get([w.train_step.remote(sample_refs, version, advantages, entropy_coef) for w in self.workers])[0]

    def init_weight_sender(self, **kwargs) -> list:
        """Refs of every rank's :meth:`LearnerWorker.init_weight_sender` (run with the receivers)."""
        return [w.init_weight_sender.remote(**kwargs) for w in self.workers]

    def sync_weights(self, version: int) -> list:
        """Refs of every rank's :meth:`LearnerWorker.sync_weights`; rank 0's result is first."""
        return [w.sync_weights.remote(version) for w in self.workers]

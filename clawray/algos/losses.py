"""Policy losses and their aggregation.

Owns: the per-token losses (PPO clip, KL, top-k reverse KL, entropy), their aggregation, and one sample's
loss and metrics. Must not: import Ray, fetch samples or run collectives (the learner reduces across
ranks), or choose a sample's scalar advantage (:mod:`clawray.algos.advantages`, by the driver).

Shapes: per-token tensors share one shape, ``[N]`` or ``[B, T]``; ``loss_mask`` is 0/1. Log-probs
are natural-log probabilities of the sampled response tokens. Every loss returns per-token values;
:func:`aggregate` turns them into the scalar that is minimised.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# the largest |log-ratio| exponentiated (PPO ratio, k3 KL): e^20 ~ 4.9e8 is far past any clip, and finite
MAX_LOG_RATIO = 20.0


def aggregate(
    token_values: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce masked per-token values ``[B, T]`` (or ``[T]``, one sequence) to a scalar.

    Modes and their trade-off:
      * ``token-mean``: ``sum(v * m) / sum(m)``. Every trained token weighs the same, so long
        replies weigh more than short ones (DAPO, arXiv 2503.14476, §3.3); the default.
      * ``seq-mean-token-mean``: mean over sequences of each sequence's token mean. Every sequence
        weighs the same, so a token of a short reply counts more (original GRPO, arXiv 2402.03300);
        this biases toward short correct and long wrong replies.
      * ``seq-mean-token-sum``: mean over sequences of each sequence's token *sum*; no length
        normalisation inside a sequence (Dr. GRPO, arXiv 2503.20783, up to a constant); gradient
        scale grows with reply length.

    Args:
        token_values: per-token values.
        loss_mask: 0/1 mask of the same shape.
        mode: one of :data:`AGG_MODES`.
        num_tokens: token-mean normaliser override (e.g. the global token count across data-parallel
            ranks); default ``max(sum(mask), 1)``.
        num_seqs: sequence-mean normaliser override (global sequence count); default ``B``.

    Returns:
        a scalar; 0 (with finite zero gradients) when the mask is all zero.

    Raises:
        ValueError: unknown mode or mismatched shapes.
    """
    if token_values.shape != loss_mask.shape:
        raise ValueError(f"values {tuple(token_values.shape)} and mask {tuple(loss_mask.shape)} differ")
    mask = loss_mask.to(token_values.dtype)
    masked = torch.where(loss_mask.bool(), token_values, 0.0)  # not x * mask: inf * 0 is NaN
    if mode == "token-mean":
        denom = num_tokens if num_tokens is not None else torch.clamp(mask.sum(), min=1.0)
        return masked.sum() / denom
    if masked.dim() == 1:
        masked, mask = masked[None], mask[None]
    seqs = num_seqs if num_seqs is not None else masked.shape[0]
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / torch.clamp(mask.sum(-1), min=1.0)
        return per_seq.sum() / seqs
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).sum() / seqs
    raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGG_MODES}")


@dataclass
class PolicyLossOutput:
    """Result of a policy loss.

    Attributes:
        loss: the aggregated scalar to minimise.
        token_loss: per-token loss (importance weight applied), same shape as the inputs.
        clipped: per-token 0/1, 1 where the PPO clip (or the dual clip) bounded the surrogate.
        ratio: per-token ratio ``exp(logprobs - old_logprobs)`` (detached).
        is_weight: per-token behaviour importance weight (ones without a behaviour correction).
    """

    loss: torch.Tensor
    token_loss: torch.Tensor
    clipped: torch.Tensor
    ratio: torch.Tensor
    is_weight: torch.Tensor


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps: float = 0.2,
    eps_high: float | None = 0.28,
    normalizer: float | torch.Tensor | None = None,
    dual_clip: float | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    agg_mode: str = "token-mean",
    num_seqs: float | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with asymmetric clip, optional dual clip and behaviour correction.

    Per token (PPO, arXiv 1707.06347, eq. 7; clip-higher from DAPO, arXiv 2503.14476, eq. 10)::

        ratio  = exp(logprobs - old_logprobs)
        loss_t = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)
        if A < 0 and dual_clip:  loss_t = min(loss_t, -dual_clip * A)      # dual-clip PPO, arXiv 1912.09729

    ``old_logprobs`` is the anchor of the trust region: the behaviour (rollout) log-probs, so the clip
    acts on stale or engine-mismatched samples (OpenClaw-RL recomputes them and never clips), or a
    recomputed *proximal* policy. With ``behaviour_logprobs`` given (decoupled PPO, Hilton et al.,
    arXiv 2110.00641; AReaL, arXiv 2505.24298), each token is weighted by
    ``w = exp(old_logprobs - behaviour_logprobs)``, truncated at ``tis_cap`` (truncated importance
    sampling between the rollout engine and the learner, Yao et al. 2025, as in verl's TIS).

    Args:
        logprobs: current-policy log-probs, with grad.
        old_logprobs: the trust-region anchor (no grad needed).
        advantages: per-token advantages.
        loss_mask: 0/1 mask; masked tokens contribute nothing.
        eps: lower clip (ratio >= 1 - eps).
        eps_high: upper clip (ratio <= 1 + eps_high); None means ``eps``.
        normalizer: token-mean denominator override (global token count across ranks).
        dual_clip: the dual-clip constant c > 1 for negative advantages, or None.
        behaviour_logprobs: the rollout log-probs when ``old_logprobs`` is a proximal policy.
        tis_cap: truncation of the behaviour weight (None = untruncated).
        agg_mode, num_seqs: see :func:`aggregate`.

    Returns:
        :class:`PolicyLossOutput`.

    Raises:
        ValueError: the input shapes differ, or ``dual_clip <= 1``.
    """
    shapes = {tuple(t.shape) for t in (logprobs, old_logprobs, advantages, loss_mask)}
    if len(shapes) != 1:
        raise ValueError(f"ppo_clip_loss inputs must share one shape, got {sorted(shapes)}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    eps_high = eps if eps_high is None else eps_high
    # a masked token's inputs never reach the arithmetic (its neutral values: ratio 1, advantage 0,
    # weight 1): a non-finite one gave a NaN gradient through 0 * nan, though its loss is masked out
    m = loss_mask.bool()
    old_logprobs = torch.where(m, old_logprobs.detach(), logprobs.detach())
    advantages = torch.where(m, advantages, torch.zeros_like(advantages))
    # the log-ratio is clamped to +-MAX_LOG_RATIO before exp (as verl): a token whose ratio overflows
    # float32 sits in a clipped (constant) branch, but its backward 0 * inf made the step's gradient NaN
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    surrogate = ratio * advantages
    surrogate_clipped = torch.clamp(ratio, 1.0 - eps, 1.0 + eps_high) * advantages
    token_loss = -torch.minimum(surrogate, surrogate_clipped)
    clipped = surrogate_clipped < surrogate
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual = (advantages < 0) & (token_loss > bound)
        token_loss = torch.where(dual, bound, token_loss)
        clipped = clipped | dual
    is_weight = torch.ones_like(token_loss)
    if behaviour_logprobs is not None:
        log_w = torch.where(m, old_logprobs - behaviour_logprobs.detach(), 0.0)  # clamped before exp, as the ratio
        is_weight = torch.exp(torch.clamp(log_w, -MAX_LOG_RATIO, MAX_LOG_RATIO))
        if tis_cap is not None:
            is_weight = is_weight.clamp(max=tis_cap)
        token_loss = token_loss * is_weight
    loss = aggregate(token_loss, loss_mask, agg_mode, normalizer, num_seqs)
    return PolicyLossOutput(
        loss=loss,
        token_loss=token_loss,
        clipped=clipped.to(logprobs.dtype).detach(),
        ratio=ratio.detach(),
        is_weight=is_weight.detach(),
    )


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi``.

    With ``d = logprobs - ref_logprobs`` (Schulman, "Approximating KL divergence", 2020):
    ``k1 = d`` (unbiased, high variance, can be negative); ``k2 = d**2 / 2`` (biased, low variance);
    ``k3 = exp(-d) - 1 + d`` (unbiased, non-negative; GRPO's choice, arXiv 2402.03300 eq. 4).

    Raises:
        ValueError: unknown estimator, or the two shapes differ.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ")
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.pow(2)
    if estimator == "k3":  # exp's argument clamped to +-MAX_LOG_RATIO (as verl): finite, exact within it;
        # in float64: exp(-d) - 1 + d ~ d^2 / 2 cancels in float32 (negative values at |d| ~ 1e-3)
        d64 = d.double()
        return (torch.expm1(torch.clamp(-d64, -MAX_LOG_RATIO, MAX_LOG_RATIO)) + d64).to(d.dtype)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL-to-reference loss term: the value of :func:`kl_penalty`'s ``estimator``, the
    gradient of ``k2`` (straight-through). Differentiated through ``logprobs`` on tokens sampled from
    ``pi``, ``E[grad k2] = E[(log pi - log pi_ref) grad log pi] = grad KL(pi || pi_ref)``, whereas
    ``E[grad k1] = 0`` (no pull toward the reference at all) and ``E[grad k3] = grad KL(pi_ref || pi)``
    (the other direction): Tang & Munos 2025, arXiv 2506.09477, §3-4. A non-finite ``ref_logprobs``
    gives a NaN gradient there even when the token is masked later: :func:`sample_loss` puts a masked
    token's own log-prob in its place.

    Raises:
        ValueError: unknown estimator.
    """
    value = kl_penalty(logprobs, ref_logprobs, estimator)
    k2 = 0.5 * (logprobs - ref_logprobs).pow(2)
    return value.detach() + (k2 - k2.detach())


def topk_reverse_kl(
    student_logits: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-position reverse KL ``KL(student || teacher)`` over the teacher's top-k ids plus a tail bin.

    The student's distribution is restricted to the teacher's k ids and one tail bin holding the
    remaining mass, ``log(1 - sum_k p_k)``, for both models (the SDFT/SDPO top-k variant used by
    OpenClaw-RL's ``topk_distillation_loss``)::

        KL_t = sum_{j in k ids + tail} p_s(j) * (log p_s(j) - log p_t(j))

    Args:
        student_logits: ``[T, V]`` next-token logits (position t predicts response token t).
        teacher_topk_logprobs: ``[T, K]`` teacher log-probs of its top-k ids.
        teacher_topk_ids: ``[T, K]`` the ids.
        temperature: divides the student logits (0 means 1).

    Returns:
        ``[T]`` non-negative reverse-KL values (nats), differentiable w.r.t. ``student_logits``.
    """
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(student_logits.float() / t, dim=-1)
    s_k = logp.gather(-1, teacher_topk_ids.long())  # [T, K]
    t_k = teacher_topk_logprobs.float()
    s_tail = _log1m_exp(_logsumexp_masked(s_k))
    t_tail = _log1m_exp(_logsumexp_masked(t_k))
    s_all = torch.cat([s_k, s_tail[:, None]], dim=-1)
    t_all = torch.cat([t_k, t_tail[:, None]], dim=-1)
    return _plogp_sum(s_all, s_all - t_all)


def _logsumexp_masked(x: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` over the last dim whose gradient stays finite when every entry is -inf (a student
    that masks all of the teacher's top-k ids): the -inf entries count as ``finfo.min`` (mass 0, value
    ~``finfo.min``) and get no gradient, where torch's own backward computes ``exp(-inf - -inf)`` = NaN."""
    return torch.logsumexp(x.masked_fill(torch.isneginf(x), torch.finfo(x.dtype).min), dim=-1)


def _log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, clamped at ``x <= -1e-7`` so a full top-k mass stays finite."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution ``softmax(logits)`` at each position, in nats.

    Args:
        logits: ``[..., V]``.

    Returns:
        ``[...]`` entropies ``-sum_v p_v log p_v`` (a masked, -inf logit adds 0).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -_plogp_sum(logp, logp)


def _plogp_sum(logp: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """``sum_v exp(logp_v) * term_v`` over the last dim, a zero-probability entry (``logp`` = -inf, a
    masked logit) adding 0 (the limit ``p log p -> 0``) instead of ``0 * inf`` = NaN, in value and gradient."""
    zero = torch.isneginf(logp)
    return (logp.exp() * term.masked_fill(zero, 0.0)).sum(dim=-1)


def sequence_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of ``targets`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V]`` next-token logits aligned with ``targets`` (position t predicts target t).
        targets: ``[...]`` token ids.
        temperature: sampling temperature; 0 (greedy) is treated as 1.

    Returns:
        ``[...]`` float32 log-probs.
    """
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / t, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------- one sample
@dataclass
class LossSettings:
    """The loss's hyper-parameters (the ``learner`` config section plus the algorithm's weights).

    Attributes:
        eps, eps_high, dual_clip: PPO clip (see :func:`ppo_clip_loss`); ``dual_clip`` None = off.
        tis_cap: truncation of the behaviour weight with the proximal anchor (None = untruncated).
        proximal: ``ratio_anchor: proximal`` (decoupled PPO) instead of the rollout log-probs.
        agg_mode: see :func:`aggregate`.
        kl_coef, kl_estimator: the KL-to-reference term (see :func:`kl_loss`: the estimator's value,
            the gradient of ``KL(pi || pi_ref)``).
        w_rl, w_opd, opd_adv_clip: the advantage mix of :func:`~clawray.algos.advantages.combine_advantages`.
    """

    eps: float = 0.2
    eps_high: float | None = 0.28
    dual_clip: float | None = None
    tis_cap: float | None = None
    proximal: bool = False
    agg_mode: str = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    w_rl: float = 1.0
    w_opd: float = 1.0
    opd_adv_clip: float | None = None


@dataclass
class SampleLossInputs:
    """One sample's response positions (``R`` response tokens, ``V`` vocabulary size, ``K`` top-k).

    Attributes:
        logits: ``[R, V]`` next-token logits of the response positions (with grad; not yet divided by
            the temperature).
        targets: ``[R]`` the response token ids.
        loss_mask: ``[R]`` 0/1 float mask of trained tokens.
        rollout_logprobs: ``[R]`` the rollout engine's (behaviour) log-probs.
        advantage: the sample's scalar advantage (after the driver's guards / GRPO).
        temperature: the sampling temperature (0 = greedy, treated as 1).
        num_tokens, num_seqs: the global mini-batch normalisers (see :func:`aggregate`).
        entropy_coef: entropy-bonus coefficient (0: the entropy is only measured).
        teacher_logprobs: ``[R]`` teacher log-probs (OPD / Combine with an accepted hint), or None.
        teacher_topk_logprobs, teacher_topk_ids: ``[R, K]`` (top-k distillation), or None.
        ref_logprobs: ``[R]`` reference-policy log-probs (when ``kl_coef > 0``), or None.
        proximal_logprobs: ``[R]`` the proximal policy's log-probs; None with the proximal anchor
            means the current weights are the proximal ones (own detached log-probs).
        fresh: the sample was generated by exactly the current weights (feeds the mismatch KL).
    """

    logits: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantage: float
    temperature: float = 1.0
    num_tokens: float | None = None
    num_seqs: float | None = None
    entropy_coef: float = 0.0
    teacher_logprobs: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    proximal_logprobs: torch.Tensor | None = None
    fresh: bool = False


SUM_METRICS = (
    "loss",
    "pg_loss",
    "kl",
    "clipped",
    "ratio_sum",
    "tokens",
    "adv_sum",
    "adv_sq_sum",
    "effective_tokens",
    "response_tokens",
    "samples",
    "is_weight_sum",
    "mismatch_kl_sum",
    "mismatch_tokens",
    "entropy_sum",
    "adv_rl_abs_sum",
    "adv_opd_abs_sum",
    "opd_tokens",
    "topk_kl_sum",
    "topk_tokens",
)
"""The :class:`LossOutput` metrics that add up over samples (and ranks); ``ratio_max`` takes the max,
``token_entropy`` concatenates."""


@dataclass
class LossOutput:
    """One sample's loss and its metrics.

    Attributes:
        loss: the scalar to minimise (with grad), already normalised by the mini-batch size.
        metrics: detached float64 tensors by name, on the inputs' device (no host sync): the 0-dim
            :data:`SUM_METRICS` (``loss``, ``pg_loss``, ``kl``; token counts ``clipped``, ``tokens``,
            ``effective_tokens`` (mask 1 and advantage != 0; every masked token of a top-k
            distillation sample), ``response_tokens``, ``mismatch_tokens`` (masked tokens of a fresh
            sample), ``opd_tokens`` and ``topk_tokens`` (masked tokens with a teacher, with top-k);
            sums over masked tokens ``ratio_sum``, ``adv_sum``, ``adv_sq_sum``, ``is_weight_sum``,
            ``mismatch_kl_sum``, ``entropy_sum``, ``adv_rl_abs_sum``, ``adv_opd_abs_sum``,
            ``topk_kl_sum``; ``samples`` = 1),
            ``ratio_max`` (0-dim; 0 without masked tokens) and ``token_entropy`` (``[M]``, the masked
            tokens' entropies in nats).
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def sample_loss(inp: SampleLossInputs, cfg: LossSettings) -> LossOutput:
    """One sample's loss: advantage mix, PPO clip or top-k distillation, KL to the reference, entropy.

    Token advantages ``A_t = w_rl * a * mask_t + w_opd * clip(teacher_t - rollout_t)`` (the OPD term
    only with teacher log-probs; :func:`~clawray.algos.advantages.combine_advantages`, OpenClaw-RL
    §4-5). Loss = PPO clip (:func:`ppo_clip_loss`; anchor: the rollout log-probs, or the proximal
    policy with TIS weights) ``+ kl_coef * KL(pi || pi_ref)`` ``- entropy_coef * entropy``, each
    aggregated by ``agg_mode``. A top-k distillation sample (no teacher log-probs, so ``A_t = w_rl * a``)
    adds ``w_opd *`` :func:`topk_reverse_kl` as its teacher term: pure OPD (``a = 0``) trains the KL
    alone, Combine its reward term by PPO beside it.

    Raises:
        ValueError: mismatched shapes (from :func:`ppo_clip_loss`).
    """
    from clawray.algos.advantages import combine_advantages

    agg = dict(mode=cfg.agg_mode, num_tokens=inp.num_tokens, num_seqs=inp.num_seqs)
    t = inp.temperature if inp.temperature > 0 else 1.0
    logprobs = sequence_logprobs(inp.logits, inp.targets, t)
    scaled = inp.logits / t
    entropy = token_entropy(scaled if inp.entropy_coef > 0 else scaled.detach())
    mask, rollout = inp.loss_mask, inp.rollout_logprobs
    has_teacher = inp.teacher_logprobs is not None
    adv = combine_advantages(
        torch.tensor([inp.advantage], device=mask.device),
        (inp.teacher_logprobs if has_teacher else rollout)[None],
        rollout[None],
        mask[None],
        torch.tensor([has_teacher], device=mask.device),
        cfg.w_rl,
        cfg.w_opd,
        cfg.opd_adv_clip,
    )[0]
    anchor = rollout
    if cfg.proximal:  # decoupled PPO: trust region around the pre-update weights
        anchor = logprobs.detach() if inp.proximal_logprobs is None else inp.proximal_logprobs
    out = ppo_clip_loss(
        logprobs,
        anchor,
        adv,
        mask,
        cfg.eps,
        cfg.eps_high,
        normalizer=inp.num_tokens,
        dual_clip=cfg.dual_clip,
        behaviour_logprobs=rollout if cfg.proximal else None,
        tis_cap=cfg.tis_cap,
        agg_mode=cfg.agg_mode,
        num_seqs=inp.num_seqs,
    )
    loss, topk_kl = out.loss, None
    if inp.teacher_topk_ids is not None:  # the teacher term is the top-k KL; PPO keeps the reward term
        topk_kl = topk_reverse_kl(scaled, inp.teacher_topk_logprobs, inp.teacher_topk_ids)
        loss = loss + cfg.w_opd * aggregate(topk_kl, mask, **agg)
    kl_value = torch.zeros((), device=mask.device)
    if inp.ref_logprobs is not None:  # a masked token's reference is its own log-prob (KL 0, as in ppo_clip_loss)
        ref = torch.where(mask.bool(), inp.ref_logprobs, logprobs.detach())
        kl_value = aggregate(kl_loss(logprobs, ref, cfg.kl_estimator), mask, **agg)
        loss = loss + cfg.kl_coef * kl_value
    if inp.entropy_coef > 0:
        loss = loss - inp.entropy_coef * aggregate(entropy, mask, **agg)
    with torch.no_grad():
        metrics = _sample_metrics(loss, out, kl_value, adv, mask, logprobs, rollout, entropy, inp.fresh)
        rl_term = cfg.w_rl * inp.advantage * mask  # the reward term of adv; the rest is the OPD term
        metrics["adv_rl_abs_sum"] = rl_term.abs().sum().double()
        metrics["adv_opd_abs_sum"] = ((adv - rl_term) * mask).abs().sum().double()
        zero = torch.zeros((), dtype=torch.float64, device=mask.device)
        metrics["opd_tokens"] = metrics["tokens"] if has_teacher else zero
        if topk_kl is not None:  # every masked token learns from the teacher's top-k, whatever its advantage
            metrics["effective_tokens"] = metrics["tokens"]
        metrics["topk_kl_sum"] = zero if topk_kl is None else topk_kl.detach()[mask.bool()].sum().double()
        metrics["topk_tokens"] = zero if topk_kl is None else metrics["tokens"]
    return LossOutput(loss=loss, metrics=metrics)


def _sample_metrics(
    loss: torch.Tensor,
    out: PolicyLossOutput,
    kl_value: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    logprobs: torch.Tensor,
    rollout: torch.Tensor,
    entropy: torch.Tensor,
    fresh: bool,
) -> dict[str, torch.Tensor]:
    """One sample's float64 sums for :func:`batch_loss_metrics` (``[T]`` tensors in, over its
    ``mask`` tokens); the mismatch KL only for a ``fresh`` sample (generated by these weights)."""
    from clawray.algos.invariants import effective_tokens, mismatch_kl_sum

    m = mask.bool()
    f64 = functools.partial(torch.as_tensor, dtype=torch.float64, device=mask.device)
    tokens = m.sum().double()
    return {
        "loss": loss.detach().double(),
        "pg_loss": out.loss.detach().double(),
        "kl": kl_value.detach().double(),
        "clipped": out.clipped[m].sum().double(),
        "ratio_sum": out.ratio[m].sum().double(),
        "tokens": tokens,
        "adv_sum": adv[m].sum().double(),
        "adv_sq_sum": adv[m].pow(2).sum().double(),
        "effective_tokens": effective_tokens(adv, mask).double(),
        "response_tokens": f64(float(mask.numel())),
        "samples": f64(1.0),
        "is_weight_sum": out.is_weight[m].sum().double(),
        "mismatch_kl_sum": mismatch_kl_sum(rollout, logprobs.detach(), mask) if fresh else f64(0.0),
        "mismatch_tokens": tokens if fresh else f64(0.0),
        "entropy_sum": entropy.detach()[m].sum().double(),
        "ratio_max": torch.where(m, out.ratio, 0.0).max().double() if m.numel() else f64(0.0),
        "token_entropy": entropy.detach()[m].double(),
    }


def batch_loss_metrics(
    sums: dict[str, float], ratio_max: float, token_entropy: torch.Tensor, world_size: int, num_mini_batches: int
) -> dict[str, float]:
    """The train step's loss metrics from the :class:`LossOutput` metrics summed over every sample of
    every rank (:data:`SUM_METRICS`), the max ratio and all masked tokens' entropies ``[M]``.

    ``loss``, ``pg_loss``, ``kl``: per mini-batch means (each sample's loss is already normalised by
    its mini-batch, so the sum over samples is the mini-batch loss times ``world_size``);
    ``num_tokens``, ``num_samples``; the invariants ``inv/entropy`` (token mean, nats),
    ``inv/entropy_p10`` (:func:`~clawray.algos.invariants.masked_quantile`), ``inv/entropy_min``,
    ``inv/adv_std`` (token population std), ``inv/ratio_mean``, ``inv/ratio_max``, ``inv/clip_frac``,
    ``inv/is_weight_mean``, ``inv/logprob_mismatch_kl`` (the summed ``mismatch_*`` terms: fresh samples
    and the learner's mismatch probe; nan without any) and
    ``inv/effective_token_rate`` (masked tokens with a non-zero advantage, and every masked token of a
    top-k distillation sample, over all response tokens); the two terms of the advantage mix, weights
    included: ``adv/rl_abs_mean`` (``|w_rl * a|`` per masked token) and ``adv/opd_abs_mean`` (``|w_opd *
    clip(teacher - rollout)|`` per masked token of the samples with a teacher; nan without any);
    ``opd/topk_kl``: the top-k reverse KL per masked token of the top-k distillation samples (nats,
    :func:`topk_reverse_kl`; their learning signal, as the advantage is others'; nan without any).
    Means over tokens divide by ``max(tokens, 1)``.
    """
    from clawray.algos.invariants import masked_quantile

    per_mini = world_size * num_mini_batches
    tokens = max(sums["tokens"], 1.0)
    adv_mean = sums["adv_sum"] / tokens
    has_entropy = token_entropy.numel() > 0
    return {
        "loss": sums["loss"] / per_mini,
        "pg_loss": sums["pg_loss"] / per_mini,
        "kl": sums["kl"] / per_mini,
        "num_tokens": sums["tokens"],
        "num_samples": sums["samples"],
        "inv/entropy": sums["entropy_sum"] / tokens,
        "inv/entropy_p10": masked_quantile(token_entropy, torch.ones_like(token_entropy), 0.1),
        "inv/entropy_min": float(token_entropy.min()) if has_entropy else math.nan,
        "inv/adv_std": math.sqrt(max(sums["adv_sq_sum"] / tokens - adv_mean**2, 0.0)),
        "inv/ratio_mean": sums["ratio_sum"] / tokens,
        "inv/ratio_max": ratio_max,
        "inv/clip_frac": sums["clipped"] / tokens,
        "inv/is_weight_mean": sums["is_weight_sum"] / tokens,
        "inv/logprob_mismatch_kl": (
            sums["mismatch_kl_sum"] / sums["mismatch_tokens"] if sums["mismatch_tokens"] else math.nan
        ),
        "inv/effective_token_rate": sums["effective_tokens"] / max(sums["response_tokens"], 1.0),
        "adv/rl_abs_mean": sums.get("adv_rl_abs_sum", 0.0) / tokens,
        "adv/opd_abs_mean": (
            sums.get("adv_opd_abs_sum", 0.0) / sums["opd_tokens"] if sums.get("opd_tokens") else math.nan
        ),
        "opd/topk_kl": sums.get("topk_kl_sum", 0.0) / sums["topk_tokens"] if sums.get("topk_tokens") else math.nan,
    }

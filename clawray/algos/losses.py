"""Policy losses and their aggregation.

Shapes: per-token tensors share one shape, ``[N]`` or ``[B, T]``; ``loss_mask`` is 0/1. Log-probs
are natural-log probabilities of the sampled response tokens. Every loss returns per-token values;
:func:`aggregate` turns them into the scalar that is minimised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def aggregate(token_values: torch.Tensor, loss_mask: torch.Tensor, mode: str = "token-mean",
              num_tokens: float | torch.Tensor | None = None, num_seqs: float | None = None) -> torch.Tensor:
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
    masked = token_values * mask
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
    ratio = torch.exp(logprobs - old_logprobs.detach())
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
        is_weight = torch.exp(old_logprobs.detach() - behaviour_logprobs.detach())
        if tis_cap is not None:
            is_weight = is_weight.clamp(max=tis_cap)
        token_loss = token_loss * is_weight
    loss = aggregate(token_loss, loss_mask, agg_mode, normalizer, num_seqs)
    return PolicyLossOutput(loss=loss, token_loss=token_loss, clipped=clipped.to(logprobs.dtype).detach(),
                            ratio=ratio.detach(), is_weight=is_weight.detach())


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi``.

    With ``d = logprobs - ref_logprobs`` (Schulman, "Approximating KL divergence", 2020):
    ``k1 = d`` (unbiased, high variance, can be negative); ``k2 = d**2 / 2`` (biased, low variance);
    ``k3 = exp(-d) - 1 + d`` (unbiased, non-negative; GRPO's choice, arXiv 2402.03300 eq. 4).

    Raises:
        ValueError: unknown estimator.
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.pow(2)
    if estimator == "k3":
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")


def topk_reverse_kl(student_logits: torch.Tensor, teacher_topk_logprobs: torch.Tensor,
                    teacher_topk_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
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
    s_tail = _log1m_exp(torch.logsumexp(s_k, dim=-1))
    t_tail = _log1m_exp(torch.logsumexp(t_k, dim=-1))
    s_all = torch.cat([s_k, s_tail[:, None]], dim=-1)
    t_all = torch.cat([t_k, t_tail[:, None]], dim=-1)
    return (s_all.exp() * (s_all - t_all)).sum(-1)


def _log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, clamped at ``x <= -1e-7`` so a full top-k mass stays finite."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution ``softmax(logits)`` at each position, in nats.

    Args:
        logits: ``[..., V]``.

    Returns:
        ``[...]`` entropies ``-sum_v p_v log p_v``.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


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

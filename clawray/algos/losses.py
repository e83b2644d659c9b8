"""Policy losses.

Shapes: ``[N]`` or ``[B, T]`` per-token tensors, all of one shape; ``loss_mask`` is 0/1. Log-probs are
natural-log probabilities of the sampled response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLossOutput:
    """Result of a policy loss.

    Attributes:
        loss: scalar to minimise, ``sum(token_loss * mask) / normalizer``.
        token_loss: per-token loss before masking (same shape as the inputs).
        clipped: per-token 0/1 float, 1 where the clipped branch of the surrogate was active.
        ratio: per-token importance ratio ``exp(logprobs - old_logprobs)`` (detached).
    """

    loss: torch.Tensor
    token_loss: torch.Tensor
    clipped: torch.Tensor
    ratio: torch.Tensor


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps: float = 0.2,
    eps_high: float | None = 0.28,
    normalizer: float | torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with asymmetric clip, token-mean over ``loss_mask``.

    Per token (PPO, arXiv 1707.06347, eq. 7; clip-higher from DAPO, arXiv 2503.14476, eq. 10)::

        ratio  = exp(logprobs - old_logprobs)
        loss_t = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)

    The ratio is taken against ``old_logprobs`` = the behaviour (rollout) log-probs, so the clip acts
    on stale or engine-mismatched samples instead of being identically 1 (OpenClaw-RL recomputes the
    old log-probs and so never clips).

    Args:
        logprobs: current-policy log-probs, with grad.
        old_logprobs: behaviour-policy log-probs (no grad needed).
        advantages: per-token advantages.
        loss_mask: 0/1 mask; masked tokens contribute nothing.
        eps: lower clip (ratio >= 1 - eps).
        eps_high: upper clip (ratio <= 1 + eps_high); None means ``eps``.
        normalizer: divide the masked sum by this token count (e.g. the global count across
            data-parallel ranks); default ``max(loss_mask.sum(), 1)``. An all-zero mask gives loss 0.

    Returns:
        :class:`PolicyLossOutput`.

    Raises:
        ValueError: the input shapes differ.
    """
    shapes = {tuple(t.shape) for t in (logprobs, old_logprobs, advantages, loss_mask)}
    if len(shapes) != 1:
        raise ValueError(f"ppo_clip_loss inputs must share one shape, got {sorted(shapes)}")
    eps_high = eps if eps_high is None else eps_high
    mask = loss_mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    surrogate = ratio * advantages
    surrogate_clipped = torch.clamp(ratio, 1.0 - eps, 1.0 + eps_high) * advantages
    token_loss = -torch.minimum(surrogate, surrogate_clipped)
    clipped = (surrogate_clipped < surrogate).to(logprobs.dtype)
    if normalizer is None:
        normalizer = torch.clamp(mask.sum(), min=1.0)
    loss = (token_loss * mask).sum() / normalizer
    return PolicyLossOutput(loss=loss, token_loss=token_loss, clipped=clipped.detach(), ratio=ratio.detach())


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

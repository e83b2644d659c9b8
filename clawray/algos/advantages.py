"""Advantage estimators.

All functions take and return ``torch.Tensor`` on the same device; shapes are given as
``[B]`` (one value per sample) and ``[B, T]`` (one value per response token, right-padded).
"""

from __future__ import annotations

import torch


def binary_advantages(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Binary-RL advantage: the raw scalar reward broadcast to every trained token.

    ``A[b, t] = r[b] * loss_mask[b, t]`` (OpenClaw-RL, arXiv 2603.10165, §3: GRPO estimator with a
    group of one and reward normalisation disabled, so there is no baseline and no std scaling).

    Args:
        rewards: ``[B]`` float rewards, e.g. +1 / -1 / 0 from the PRM majority vote.
        loss_mask: ``[B, T]`` 0/1 mask of trained response tokens.

    Returns:
        ``[B, T]`` float advantages, zero where ``loss_mask`` is zero.

    Raises:
        ValueError: the batch sizes differ.
    """
    if rewards.dim() != 1 or loss_mask.dim() != 2 or rewards.shape[0] != loss_mask.shape[0]:
        raise ValueError(f"expected rewards [B] and loss_mask [B, T], got {tuple(rewards.shape)} "
                         f"and {tuple(loss_mask.shape)}")
    return rewards.to(torch.float32)[:, None] * loss_mask.to(torch.float32)

"""Advantage estimators.

Owns: the estimators (binary, baseline, GRPO, OPD, Combine) and :func:`batch_advantages`'s order (guard,
then estimator). Must not: import Ray or fetch samples, hold the guard's rule or state
(:mod:`clawray.algos.invariants`), or form the groups (:mod:`clawray.algos.rejection`).

All functions take and return ``torch.Tensor`` on the same device; shapes are ``[B]`` (one value
per sample) and ``[B, T]`` (one value per response token, right-padded, with a 0/1 ``loss_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

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
        raise ValueError(
            f"expected rewards [B] and loss_mask [B, T], got {tuple(rewards.shape)} and {tuple(loss_mask.shape)}"
        )
    return rewards.to(torch.float32)[:, None] * loss_mask.to(torch.float32)


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, min_std: float = 1e-6) -> torch.Tensor:
    """Group-normalised (GRPO) scalar advantages for samples that share a prompt.

    For each group g: ``A_i = (r_i - mean_g) / std_g`` with the *population* std (GRPO, arXiv
    2402.03300, §4.1.2, outcome supervision). A group whose rewards are all equal (``std_g <
    min_std``) gets exactly 0: it carries no preference between its samples, and dividing by a tiny
    std would turn float noise into a full-size advantage. A group of one therefore gets 0.

    Example: rewards ``[0.3] * 7 + [0.9]`` in one group give ``≈ -0.378`` seven times and ``≈ +2.646``.

    Args:
        rewards: ``[B]`` scalar rewards.
        group_ids: ``[B]`` integer group of each sample (same prompt = same group).
        min_std: groups with a smaller std count as all-equal.

    Returns:
        ``[B]`` float32 advantages.

    Raises:
        ValueError: the shapes differ or are not 1-D.
    """
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"expected rewards [B] and group_ids [B], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    r = rewards.to(torch.float64)
    out = torch.zeros_like(r)
    for g in torch.unique(group_ids):
        idx = group_ids == g
        mean = r[idx].mean()
        std = r[idx].std(unbiased=False)
        if std >= min_std:
            out[idx] = (r[idx] - mean) / std
    return out.to(torch.float32)


def opd_advantages(
    teacher_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, clip: float | None = None
) -> torch.Tensor:
    """On-policy distillation token advantage ``A_t = teacher_logprob_t - rollout_logprob_t``.

    The teacher scores the *same* response tokens under the hint-augmented prompt (OpenClaw-RL,
    arXiv 2603.10165, §4; on-policy distillation as reverse KL, Agarwal et al., arXiv 2306.13649).
    ``clip`` bounds ``|A_t|`` (``opd.adv_clip``).

    Args:
        teacher_logprobs, rollout_logprobs, loss_mask: ``[B, T]`` (or any one shared shape).
        clip: optional bound on ``|A_t|``.

    Returns:
        advantages of the same shape, zero where ``loss_mask`` is zero (whatever the log-probs hold
        there: a non-finite one times a 0 mask would be NaN, and NaN reaches every weight's gradient).

    Raises:
        ValueError: the three shapes differ.
    """
    if not teacher_logprobs.shape == rollout_logprobs.shape == loss_mask.shape:
        raise ValueError(
            f"teacher_logprobs {tuple(teacher_logprobs.shape)}, rollout_logprobs {tuple(rollout_logprobs.shape)} "
            f"and loss_mask {tuple(loss_mask.shape)} must have one shape"
        )
    diff = teacher_logprobs.float() - rollout_logprobs.float()
    adv = torch.where(loss_mask.bool(), diff, torch.zeros_like(diff))
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv


def combine_advantages(
    rewards: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    has_teacher: torch.Tensor,
    w_rl: float = 1.0,
    w_opd: float = 1.0,
    clip: float | None = None,
) -> torch.Tensor:
    """Combine: ``A_t = w_rl * r + w_opd * (teacher_logprob_t - rollout_logprob_t)`` (OpenClaw-RL §5).

    A sample without an accepted hint (``has_teacher[b] = False``) gets *no* OPD term: exactly
    ``w_rl * r`` (OpenClaw-RL substitutes the rollout log-probs and trains on their mismatch noise).

    Args:
        rewards: ``[B]``; teacher_logprobs, rollout_logprobs, loss_mask: ``[B, T]``;
        has_teacher: ``[B]`` bool.
        w_rl, w_opd: the two weights; clip: bound on the OPD term.

    Returns:
        ``[B, T]`` advantages, zero where ``loss_mask`` is zero.

    Raises:
        ValueError: ``has_teacher`` is not ``[B]`` for the ``B`` of ``loss_mask`` (or the shapes of
            :func:`binary_advantages` and :func:`opd_advantages` disagree).
    """
    if has_teacher.shape != loss_mask.shape[:1]:
        raise ValueError(f"has_teacher {tuple(has_teacher.shape)} must be [B] for loss_mask {tuple(loss_mask.shape)}")
    rl = binary_advantages(rewards, loss_mask)
    opd = opd_advantages(teacher_logprobs, rollout_logprobs, loss_mask, clip)
    opd = torch.where(has_teacher.bool()[:, None], opd, torch.zeros_like(opd))  # not x * 0: a -inf log-prob gave NaN
    return w_rl * rl + w_opd * opd


@dataclass
class BatchAdvantages:
    """One batch's scalar advantages (see :func:`batch_advantages`).

    Attributes:
        advantages: ``[B]`` one scalar per sample, in batch order.
        train: False when the degenerate-batch guard says skip the batch.
        rewarded: indexes of the samples that carry a reward (pure OPD samples carry none).
        signal: :func:`~clawray.algos.invariants.signal_stats` of the rewarded samples.
    """

    advantages: list[float]
    train: bool
    rewarded: list[int]
    signal: dict[str, float]


def batch_advantages(
    rewards: list[float | None],
    guard,
    estimator: str = "binary",
    group_keys: list[Hashable] | None = None,
    teacher: list[bool] | None = None,
) -> BatchAdvantages:
    """Scalar advantages of one batch: the degenerate-batch guard, then the estimator.

    The guard (:class:`~clawray.algos.invariants.DegenerateBatchGuard`, its state updated) looks at
    the samples that carry a reward; a sample without one (pure OPD) keeps advantage 0 (its OPD term
    comes from the teacher, in the loss). ``estimator="binary"``: the guarded reward
    (:func:`binary_advantages` broadcasts it over the tokens in the loss); ``"baseline"``: every
    rewarded sample trains on ``r - b``, ``b`` the guard's running mean reward *before* this batch
    (REINFORCE with a baseline, Williams 1992, eq. 11; at success rate p a success weighs
    ``2(1 - p)`` and a failure ``-2p``, so a rare success is not drowned by the failures of a mixed
    batch as it is with raw ±1); ``"grpo"``: rewarded samples with equal ``group_keys`` (the prompt
    tokens) form a group, :func:`group_advantages` of the raw rewards. In every mode the guard counts
    one-signed batches and updates its baseline; ``skip`` skips a one-signed batch under ``binary``
    and, under the centring ``baseline`` and ``grpo``, a batch whose advantages are one-signed (or all 0).
    A batch ``skip`` would skip that holds a sample with a teacher term (OPD, Combine) trains on: its
    reward terms are zeroed (advantage 0), the teacher terms carry their own signal.

    Args:
        rewards: ``[B]`` each sample's reward, None for a sample without one.
        guard: the run's degenerate-batch guard.
        estimator: ``"binary"``, ``"baseline"`` or ``"grpo"``.
        group_keys: ``[B]`` hashable group of each sample; required for ``"grpo"``.
        teacher: ``[B]`` whether each sample has a teacher term (its kind is ``opd`` or ``combine``).

    Raises:
        ValueError: an unknown estimator, or ``"grpo"`` without ``group_keys`` of length B.
    """
    from clawray.algos.invariants import signal_stats

    if estimator not in ("binary", "baseline", "grpo"):
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected binary, baseline or grpo")
    values = [float(r or 0.0) for r in rewards]
    rewarded = [i for i, r in enumerate(rewards) if r is not None]
    signal = signal_stats([values[i] for i in rewarded])
    advantages, train = list(values), True
    if rewarded:
        baseline = guard.baseline
        guarded, train = guard.apply([values[i] for i in rewarded])
        for i, a in zip(rewarded, guarded):
            advantages[i] = values[i] - baseline if estimator == "baseline" else a
    if estimator == "grpo":
        if group_keys is None or len(group_keys) != len(rewards):
            raise ValueError("grpo advantages need one group key per sample")
        groups: dict[Hashable, int] = {}
        ids = torch.tensor([groups.setdefault(group_keys[i], len(groups)) for i in rewarded], dtype=torch.long)
        grouped = group_advantages(torch.tensor([values[i] for i in rewarded]), ids).tolist()
        advantages = [0.0] * len(values)  # a sample without a reward is no member of its group
        for i, a in zip(rewarded, grouped):
            advantages[i] = a
    if rewarded and estimator != "binary" and guard.mode == "skip":
        # centred advantages may contrast where the rewards do not: skip when they are one-signed too
        train = signal_stats([advantages[i] for i in rewarded])["one_signed"] == 0.0
    if not train and teacher is not None and any(teacher):  # skip the reward terms, not the teacher's
        advantages = [0.0 if i in set(rewarded) else a for i, a in enumerate(advantages)]
        train = True
    return BatchAdvantages(advantages, train, rewarded, signal)

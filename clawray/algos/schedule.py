"""Learning-rate schedules: linear warmup, then constant or cosine decay to a floor.

Owns: the factor of the base learning rate at an optimizer step (:func:`lr_factor`). Must not: hold an
optimizer or a scheduler (the learner's ``LambdaLR`` calls it), or import Ray or torch.
"""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "cosine")


def lr_factor(
    step: int, schedule: str = "constant", warmup_steps: int = 0, total_steps: int = 0, min_lr_ratio: float = 0.0
) -> float:
    """The multiplier of the base learning rate for the optimizer step with 0-based index ``step``.

    Warmup (Goyal et al., arXiv 1706.02677): for ``step < warmup_steps`` the factor is
    ``(step + 1) / warmup_steps``, so the first step already moves (it is not 0) and step
    ``warmup_steps - 1`` reaches 1. After warmup:

    * ``constant``: 1.
    * ``cosine`` (SGDR without restarts, Loshchilov & Hutter, arXiv 1608.03983):
      ``p = min((step - warmup_steps) / (total_steps - warmup_steps), 1)``,
      ``factor = min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2``; it stays at
      ``min_lr_ratio`` after ``total_steps``.

    Args:
        step: optimizer steps already taken (>= 0).
        schedule: one of :data:`LR_SCHEDULES`.
        warmup_steps, total_steps: in optimizer steps; cosine needs ``total_steps > warmup_steps``.
        min_lr_ratio: the cosine floor as a fraction of the base lr, in [0, 1].

    Raises:
        ValueError: unknown schedule, a negative step, or cosine with ``total_steps <= warmup_steps``.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; expected one of {LR_SCHEDULES}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if total_steps <= warmup_steps:
        raise ValueError(f"cosine needs total_steps > warmup_steps, got {total_steps} <= {warmup_steps}")
    progress = min((step - warmup_steps) / (total_steps - warmup_steps), 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

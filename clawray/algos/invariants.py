"""The four training invariants of agentic RL as metrics and guards (pure functions and small state).

Owns: the invariants' formulas and the guards' rules and state (:class:`DegenerateBatchGuard`'s baseline,
:class:`EntropyController`'s coefficient). Must not: import Ray, log metrics, or persist the guards
(:mod:`clawray.resume` keeps them in the loop state).

1. policy entropy does not collapse      -> :func:`masked_quantile`, :class:`EntropyController`
2. the learning signal is non-degenerate -> :func:`signal_stats`, :class:`DegenerateBatchGuard`
3. the on-policy gap stays bounded       -> :func:`logprob_mismatch_kl` (+ staleness cap, clip, TIS)
4. the effective sample rate stays high  -> :func:`effective_token_rate`

Metric names (wandb, ``inv/``) are listed in DESIGN.md; each function says which it feeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def masked_quantile(values: torch.Tensor, mask: torch.Tensor, q: float) -> float:
    """The ``q``-quantile of ``values`` where ``mask`` is 1 (linear interpolation); nan when empty.

    Feeds ``inv/entropy_p10`` with ``q = 0.1`` over per-token entropies. The same value as
    ``torch.quantile`` (its default ``linear``) read from one sort, which takes any size
    (``torch.quantile`` refuses more than 2**24 values: a step of 17M tokens failed after its update;
    ``torch.kthvalue`` is quadratic on sorted input).
    """
    v = values[mask.bool()].float().flatten()
    if not v.numel():
        return math.nan
    v = torch.sort(v).values
    pos = q * (v.numel() - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    a, b = float(v[lo]), float(v[hi])
    return a + (b - a) * (pos - lo)


def mismatch_kl_sum(
    rollout_logprobs: torch.Tensor, learner_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Sum over masked tokens of ``r - 1 - log r`` with ``r = exp(learner - rollout)`` (k3 terms of
    ``KL(rollout || learner)``), a 0-dim float64 tensor on the inputs' device (no host sync): the
    numerator of :func:`logprob_mismatch_kl`, summed by the learner over samples and ranks."""
    m = loss_mask.bool()
    log_r = (learner_logprobs.double() - rollout_logprobs.double())[m]  # float64: tiny KLs must not cancel
    return (torch.exp(log_r) - 1.0 - log_r).sum()


def logprob_mismatch_kl(
    rollout_logprobs: torch.Tensor, learner_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> float:
    """``KL(rollout || learner)`` on the sampled tokens, k3 estimator, mean over masked tokens.

    Tokens were sampled by the rollout engine ``mu``; with ``r = pi / mu``,
    ``KL(mu || pi) = E_mu[r - 1 - log r]`` (Schulman 2020; prime-rl's ``mismatch_kl``). With the same
    weights on both sides this measures only engine numerics (``inv/logprob_mismatch_kl``).
    """
    m = loss_mask.bool()
    if not m.any():
        return 0.0
    return float(mismatch_kl_sum(rollout_logprobs, learner_logprobs, loss_mask) / m.sum())


def effective_tokens(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """How many tokens carry gradient (mask 1 and advantage != 0), a 0-dim tensor (no host sync):
    the numerator of :func:`effective_token_rate`."""
    return ((advantages != 0) & loss_mask.bool()).sum()


def effective_token_rate(advantages: torch.Tensor, loss_mask: torch.Tensor, response_tokens: int) -> float:
    """Share of the batch's response tokens that carry gradient (mask 1 and advantage != 0).

    Feeds ``inv/effective_token_rate``; 0 when there are no response tokens.
    """
    if response_tokens <= 0:
        return 0.0
    return float(effective_tokens(advantages, loss_mask)) / response_tokens


def signal_stats(rewards: list[float]) -> dict[str, float]:
    """Batch reward statistics: ``nonzero_reward_frac``, ``reward_std`` (population) and
    ``one_signed`` (1.0 when every reward has the same sign or all are 0: no preference inside the
    batch, so binary RL without a baseline only shifts all log-probs one way)."""
    if not rewards:
        return {"nonzero_reward_frac": 0.0, "reward_std": 0.0, "one_signed": 1.0}
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    one_signed = all(r > 0 for r in rewards) or all(r < 0 for r in rewards) or all(r == 0 for r in rewards)
    return {"nonzero_reward_frac": sum(r != 0 for r in rewards) / n, "reward_std": std, "one_signed": float(one_signed)}


@dataclass
class DegenerateBatchGuard:
    """What to do with a one-signed batch (``inv/degenerate_batches`` counts them).

    Modes:
      * ``none``: train on raw rewards (OpenClaw-RL's behaviour).
      * ``baseline``: a one-signed batch trains on ``r - b``, with ``b`` a running mean reward over
        all batches (EMA with ``momentum``, starting at 0), so a stream of all +1 stops pushing once
        ``b`` has caught up and a promoted 0-reward turn gets a real gradient (REINFORCE with a
        baseline, Williams 1992). Mixed-sign batches keep their raw rewards.
      * ``skip``: one-signed batches are not trained (the learner step is skipped).
    """

    mode: str = "baseline"
    momentum: float = 0.9
    baseline: float = 0.0
    degenerate_batches: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("none", "baseline", "skip"):
            raise ValueError(f"unknown degenerate-batch mode {self.mode!r}; expected none, baseline or skip")

    def restore(self, saved: dict) -> None:
        """Take a checkpoint's state (``dataclasses.asdict`` of a saved guard): the running baseline
        and the count; ``mode`` and ``momentum`` stay as this run's config sets them."""
        self.baseline = float(saved.get("baseline", self.baseline))
        self.degenerate_batches = int(saved.get("degenerate_batches", self.degenerate_batches))

    def apply(self, rewards: list[float]) -> tuple[list[float], bool]:
        """Returns ``(advantages per sample, train?)`` for a batch and updates the counters and, in
        every mode, the running mean reward ``b`` (``trainer.advantage: baseline`` reads it whatever
        the mode); the advantages use ``b`` from before this batch."""
        degenerate = signal_stats(rewards)["one_signed"] == 1.0
        self.degenerate_batches += int(degenerate)
        before = self.baseline
        mean = sum(rewards) / max(len(rewards), 1)
        self.baseline = self.momentum * self.baseline + (1.0 - self.momentum) * mean
        if self.mode == "none":
            return list(rewards), True
        if self.mode == "skip":
            return list(rewards), not degenerate
        return ([r - before for r in rewards] if degenerate else list(rewards)), True


@dataclass
class EntropyController:
    """Adaptive entropy bonus: the coefficient rises while policy entropy is below ``floor``.

    ``coef <- clip(coef + lr * (floor - entropy), 0, max_coef)`` after each step, the dual-ascent
    update of a constrained entropy objective (SAC's temperature tuning, arXiv 1812.05905, eq. 18;
    Skywork-OR1's adaptive entropy control, arXiv 2505.22312). ``floor = 0`` disables it and keeps
    ``coef`` at its initial value.
    """

    coef: float = 0.0
    floor: float = 0.0
    lr: float = 0.01
    max_coef: float = 0.1

    def restore(self, saved: dict) -> None:
        """Take a checkpoint's state (``dataclasses.asdict`` of a saved controller): the coefficient it
        had adapted to, within this run's ``max_coef``, when both runs adapt it (``floor > 0``); else
        the coefficient stays this run's configured one. ``floor``, ``lr`` and ``max_coef`` stay as
        this run's config sets them."""
        if self.floor > 0 and saved.get("floor", 0.0) > 0:
            self.coef = min(max(float(saved["coef"]), 0.0), self.max_coef)

    def update(self, entropy: float) -> float:
        """Feed the step's mean entropy over trained tokens (nats); returns the new coefficient."""
        if self.floor > 0 and math.isfinite(entropy):
            self.coef = min(max(self.coef + self.lr * (self.floor - entropy), 0.0), self.max_coef)
        return self.coef

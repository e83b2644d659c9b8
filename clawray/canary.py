"""The promotion gate's canary (``deploy.canary_fraction``): before a candidate that passed its probe
reaches every user, it serves a session-affine fraction of the live traffic on one engine, and its
live rewards are compared with the promoted version's, served meanwhile to everyone else.

Owns: which engine serves the canary (:func:`canary_engine`), the live comparison window
(:class:`CanaryWindow`: the trajectory queue's reward tallies per policy version) and its verdict
(:func:`canary_verdict`, :meth:`CanaryVerdict.apply`). Must not: route a request (the routers put a
session in the canary, :func:`clawray.serve.routing.in_canary`), probe or record a decision
(:class:`~clawray.gate.PromotionGate`, which runs a canary: ``_sync_canary``), or move weights.

Why the rewards, compared by policy version: only the canary engine serves the candidate while the
window is open, so the samples stamped with its version are the canary's turns, and those stamped with
the promoted version are the turns everyone else was served in the same minutes (the window counts
what was put after it opened). A turn's reward arrives once its next state did (the user's reply or a
tool result), so the window waits for ``deploy.canary_turns`` judged turns of each version, at most
``deploy.canary_timeout_s`` seconds.

What the canary decides: it vetoes a candidate whose live mean reward is significantly below the
promoted version's by more than ``deploy.canary_margin`` (reward units): the one-sided upper
``1 - deploy.alpha`` confidence bound of the difference of the two means is below ``-canary_margin``
(Welch's unequal-variance two-sample comparison, Welch 1947, Biometrika 34(1-2):28-35: Student's t
quantile at the Welch-Satterthwaite degrees of freedom, :func:`t_quantile`; each arm has at least
``canary_turns`` turns). It is a harm detector on the traffic the probe
does not see, not a proof: showing non-inferiority is the probe's job (``deploy.rule``). A window that
closes with too few turns in an arm is inconclusive and the probe's decision stands (recorded).
"""

from __future__ import annotations

import dataclasses
import math
import time
from statistics import NormalDist
from typing import Any, Callable

from clawray.promotion import Decision

Tally = tuple[float, float, float]  # (n, sum, sum of squares) of rewards


def canary_engine(deploy: Any, engines: list) -> int | None:
    """The index of the engine that serves a canary (the last one), or None when there is no canary:
    ``deploy.canary_fraction`` is 0, the gate is off, or fewer than 2 engines serve (the others must
    go on serving the promoted version)."""
    if not deploy.gate or deploy.canary_fraction <= 0 or len(engines) < 2:
        return None
    return len(engines) - 1


def _mean_var(t: Tally) -> tuple[float, float]:
    n, total, squares = t
    mean = total / n
    return mean, max(0.0, (squares - n * mean * mean) / (n - 1)) if n > 1 else 0.0


@dataclasses.dataclass
class CanaryVerdict:
    """What a canary's window showed.

    Attributes:
        harm: True (significantly worse: the candidate is rejected), False (no evidence of harm), None
            (inconclusive: fewer than ``min_turns`` turns in an arm).
        turns, mean: the candidate's judged live turns and their mean reward.
        promoted_turns, promoted_mean: the promoted version's, in the same window.
        delta: ``mean - promoted_mean`` (reward units; nan when an arm is empty).
        upper: the one-sided upper confidence bound of ``delta`` (nan when inconclusive).
        seconds: how long the window was open.
        reason: one line.
    """

    harm: bool | None
    turns: int
    mean: float
    promoted_turns: int
    promoted_mean: float
    delta: float
    upper: float
    seconds: float
    reason: str

    def apply(self, decision: Decision) -> Decision:
        """The probe's ``decision`` with this verdict: a candidate shown harmful is rejected with the
        learning-rate back-off; otherwise the probe's decision stands, its reason naming the canary."""
        if self.harm:
            reason = f"rejected by its canary: {self.reason} (probe: {decision.reason})"
            return dataclasses.replace(decision, promote=False, backoff=True, reason=reason)
        return dataclasses.replace(decision, reason=f"{decision.reason}; canary: {self.reason}")

    def metrics(self) -> dict[str, float]:
        """``deploy/canary_*`` for the step's row: ``harm`` (1 worse, 0 not, -1 inconclusive), the two
        arms' turns and mean rewards (nan when empty), ``delta`` and the window's seconds."""
        return {
            "deploy/canary_harm": -1.0 if self.harm is None else float(self.harm),
            "deploy/canary_turns": float(self.turns),
            "deploy/canary_reward": self.mean,
            "deploy/canary_promoted_turns": float(self.promoted_turns),
            "deploy/canary_promoted_reward": self.promoted_mean,
            "deploy/canary_delta": self.delta,
            "deploy/canary_s": self.seconds,
        }

    def record(self) -> dict[str, Any]:
        """The fields of ``versions.jsonl``'s ``canary`` entry (NaNs as None)."""
        out = dataclasses.asdict(self)
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in out.items()}


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t distribution with ``df`` (> 0, real; ``inf``: the normal)
    degrees of freedom, for ``0.5 <= p < 1``: the t CDF ``1 - I_x(df/2, 1/2) / 2``, ``x = df / (df +
    t^2)`` (Abramowitz & Stegun 26.7.1 with 26.5.27), inverted by bisection to 1e-12 relative. The
    regularized incomplete beta ``I_x`` is its continued fraction (A&S 26.5.8; Lentz's method).

    Example: ``t_quantile(0.95, 1) = tan(0.45 pi) = 6.3138``; ``t_quantile(0.95, 10) = 1.8125``.

    Raises:
        ValueError: ``p`` outside [0.5, 1) or ``df`` <= 0.
    """
    if not 0.5 <= p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df > 0, got p={p}, df={df}")
    if math.isinf(df):
        return NormalDist().inv_cdf(p)
    tail = 1.0 - p  # P(T > t) = I_x(df/2, 1/2) / 2
    lo, hi = 0.0, max(1.0, NormalDist().inv_cdf(p))
    while _incomplete_beta(df / (df + hi * hi), df / 2, 0.5) / 2 > tail:
        lo, hi = hi, hi * 2
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _incomplete_beta(df / (df + mid * mid), df / 2, 0.5) / 2 > tail else (lo, mid)
    return (lo + hi) / 2


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` for ``0 <= x <= 1``."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):  # the continued fraction converges fast below this point
        return 1.0 - _incomplete_beta(1.0 - x, b, a)
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for aa in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return front * h / a


def canary_verdict(
    candidate: Tally, promoted: Tally, min_turns: int, alpha: float, margin: float, seconds: float = 0.0
) -> CanaryVerdict:
    """The canary's verdict from the live reward tallies ``(n, sum, sum of squares)`` of the candidate
    and the promoted version (see the module docstring for the test and its source).

    ``delta = mean_c - mean_p``; ``se = sqrt(s_c^2 / n_c + s_p^2 / n_p)`` (sample variances, n - 1);
    ``upper = delta + t_(1 - alpha, df) * se`` with the Welch-Satterthwaite ``df``; harm when
    ``upper < -margin``; inconclusive when
    ``n_c < min_turns`` or ``n_p < min_turns``.

    Raises:
        ValueError: ``min_turns`` < 2 or ``alpha`` outside (0, 1).
    """
    if min_turns < 2 or not 0.0 < alpha < 1.0:
        raise ValueError(f"canary_verdict needs min_turns >= 2 and 0 < alpha < 1, got {min_turns}, {alpha}")
    n_c, n_p = int(candidate[0]), int(promoted[0])
    mean_c, var_c = _mean_var(candidate) if n_c else (math.nan, 0.0)
    mean_p, var_p = _mean_var(promoted) if n_p else (math.nan, 0.0)
    delta = mean_c - mean_p
    figures = f"{mean_c:.3f} over {n_c} turns vs the promoted version's {mean_p:.3f} over {n_p}"
    if n_c < min_turns or n_p < min_turns:
        why = f"inconclusive: {figures} (fewer than {min_turns} in an arm); the probe decides"
        return CanaryVerdict(None, n_c, mean_c, n_p, mean_p, delta, math.nan, seconds, why)
    a_c, a_p = var_c / n_c, var_p / n_p
    se = math.sqrt(a_c + a_p)
    # Welch-Satterthwaite degrees of freedom (Welch 1947): the t quantile, not the normal one, at a
    # few turns an arm (the normal one called harm 2.4x alpha as often at 2 turns)
    df = (a_c + a_p) ** 2 / (a_c**2 / (n_c - 1) + a_p**2 / (n_p - 1)) if se > 0 else math.inf
    upper = delta + t_quantile(1 - alpha, df) * se
    harm = upper < -margin
    word = "worse" if harm else "no evidence of harm"
    why = f"{word}: live reward {figures}, delta {delta:+.3f}, upper bound {upper:+.3f} vs -{margin:g}"
    return CanaryVerdict(harm, n_c, mean_c, n_p, mean_p, delta, upper, seconds, why)


class CanaryWindow:
    """The live comparison of one canary: the trajectory queue's reward tallies
    (:meth:`~clawray.actors.queue.TrajectoryQueue.reward_tallies`) of the candidate's and the promoted
    version's turns put after :meth:`open`.

    Args:
        tallies: returns the queue's current ``{policy version: (n, sum, sum of squares)}``.
        candidate, promoted: the two policy versions.
        deploy: the ``deploy`` section (``canary_turns``, ``canary_timeout_s``, ``alpha``, ``canary_margin``).
        poll_s: seconds between two reads of the tallies.
    """

    def __init__(self, tallies: Callable[[], dict], candidate: int, promoted: int, deploy: Any, poll_s: float = 1.0):
        self.tallies, self.cfg, self.poll_s = tallies, deploy, poll_s
        self.candidate, self.promoted = candidate, promoted
        self.base: dict = {}
        self.t0 = 0.0

    def open(self) -> None:
        """Start counting (the canary engine serves the candidate from now on)."""
        self.base, self.t0 = dict(self.tallies()), time.perf_counter()

    def counts(self) -> tuple[Tally, Tally]:
        """The candidate's and the promoted version's tallies since :meth:`open`. A tally below its
        base means the queue restarted (Ray restarted the actor: its tallies start from 0 again):
        the window counts from 0 for that version (the turns before the restart are lost, never
        negative counts that no window could complete)."""
        now = self.tallies()

        def since(v: int) -> Tally:
            a, b = now.get(v, (0.0, 0.0, 0.0)), self.base.get(v, (0.0, 0.0, 0.0))
            if a[0] < b[0]:
                self.base[v] = b = (0.0, 0.0, 0.0)
            return (a[0] - b[0], a[1] - b[1], a[2] - b[2])

        return since(self.candidate), since(self.promoted)

    def wait(self) -> CanaryVerdict:
        """Read the tallies every ``poll_s`` seconds until each version has ``canary_turns`` judged
        turns or ``canary_timeout_s`` passed; the verdict on what arrived."""
        d = self.cfg
        while True:
            cand, prom = self.counts()
            elapsed = time.perf_counter() - self.t0
            if min(cand[0], prom[0]) >= d.canary_turns or elapsed >= d.canary_timeout_s:
                return canary_verdict(cand, prom, d.canary_turns, d.alpha, d.canary_margin, elapsed)
            time.sleep(min(self.poll_s, max(0.0, d.canary_timeout_s - elapsed)))

"""The promotion gate's decision rule: is a candidate policy version worse than the promoted one?

Owns: the gate's decision rule and its exact sign test (:func:`sign_test_p`, which the premise check
also uses). Must not: probe, hold state or import beyond the standard library: :func:`decide` is a
pure function of the paired scores.

A probe scores both versions on the same held-out items with the same seeds, so the results are
*paired*: item i gives the candidate's score ``c_i`` and the promoted version's ``p_i`` (each in
[0, 1]; 0/1 for a check that passes or fails). The rule (:func:`decide`):

* **floor**: the candidate's mean score below ``floor`` is rejected outright;
* **significant drop**: an exact one-sided **sign test** on the pairs that differ - for 0/1 scores
  this is the exact (binomial) **McNemar test** (McNemar 1947; Fagerland, Lydersen & Laake 2013,
  "The McNemar test for binary matched-pairs data", BMC Med. Res. Methodol. 13:91). With ``b`` pairs
  where the candidate scored lower and ``c`` where it scored higher, under "no difference" ``b`` is
  Binomial(b + c, 1/2); the p-value of "the candidate is worse" is ``P(X >= b)``. The candidate is
  rejected when that p-value is below ``alpha`` *and* its mean score is below the promoted one's by
  more than ``margin`` (a drop smaller than the margin is tolerated, however sure);
* else, under ``rule="no_drop"``, it is promoted: a wobble that is not significant is not a reason to
  hold back an update;
* under ``rule="noninferior"`` a candidate must instead *show* it is not worse by more than the
  margin: promoted only when the one-sided ``1 - alpha`` lower confidence bound of the paired mean
  difference (the adjusted Wald interval, :func:`adjusted_wald`: ``centre - z_(1-alpha) * se``) is
  above ``-margin`` (the confidence-interval
  approach to non-inferiority: ICH E9, Statistical Principles for Clinical Trials, 1998, section 3.3.2;
  Wellek, Testing Statistical Hypotheses of Equivalence and Noninferiority, 2nd ed. 2010, ch. 5, for
  paired observations; normal approximation, so it wants n of about 30 paired items or more). A
  candidate it cannot show non-inferior is rejected as *unproven* (``Decision.backoff`` False: no
  evidence of harm, so the caller rolls back without backing off the learning rate), the others
  (floor, significant drop, guards) with ``backoff`` True. "No drop" keeps every version the probe
  cannot tell from the promoted one, so drops within the probe's noise add up; "non-inferior" keeps
  only what it can vouch for, which is what "users are never served a version worse than the best
  by more than the margin" needs.

The invariant guards (:func:`guard_failure`) are checked at the candidate's version too: a candidate
that the test would promote is rejected when its policy entropy on the probe's replies fell below
``entropy_ratio_min`` x the baseline version's (collapse: invariant 1, the report's entropy verdict)
or its engine/learner log-prob mismatch exceeds ``mismatch_max`` (the on-policy gap: invariant 3).

The paired mean difference and its 95% interval (the adjusted Wald interval, ``centre +- 1.96 se``)
are reported beside the decision; ``no_drop`` decides by the exact test alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

RULES = ("no_drop", "noninferior")


@dataclass
class Decision:
    """A gate decision on paired probe results.

    Attributes:
        promote: True to promote the candidate.
        reason: one line: why (the figures it rests on).
        n: paired items.
        candidate_mean, promoted_mean: mean scores in [0, 1].
        delta: ``candidate_mean - promoted_mean``.
        delta_ci: the 95% interval of ``delta`` (:func:`adjusted_wald`).
        worse, better: pairs where the candidate scored lower / higher (ties left out).
        p_worse: the exact one-sided sign-test p-value of "the candidate is worse".
        lower: the one-sided ``1 - alpha`` lower confidence bound of ``delta`` (:func:`adjusted_wald`).
        backoff: for a rejection, True when it rests on evidence of harm (floor, significant drop,
            guards), False when the candidate was only not shown non-inferior (``rule="noninferior"``).
    """

    promote: bool
    reason: str
    n: int
    candidate_mean: float
    promoted_mean: float
    delta: float
    delta_ci: tuple[float, float]
    worse: int
    better: int
    p_worse: float
    lower: float = -math.inf
    backoff: bool = True


def sign_test_p(worse: int, better: int) -> float:
    """``P(X >= worse)`` for ``X ~ Binomial(worse + better, 1/2)``: the exact one-sided p-value that
    the candidate is worse, from the pairs that differ (1.0 when none differ).

    Raises:
        ValueError: a negative count.
    """
    if worse < 0 or better < 0:
        raise ValueError(f"pair counts must be >= 0, got worse={worse}, better={better}")
    n = worse + better
    if n == 0:
        return 1.0
    return sum(math.comb(n, k) for k in range(worse, n + 1)) / 2**n


def adjusted_wald(diffs: Sequence[float]) -> tuple[float, float]:
    """The centre and standard error of the adjusted Wald interval of a paired mean difference:
    Bonett & Price (2012), "Adjusted Wald confidence interval for a difference of binomial proportions
    based on paired data", J. Educ. Behav. Stat. 37(4):479-488: one pseudo-pair the candidate wins
    (+1) and one it loses (-1) join the ``n`` differences, then ``centre = mean``, ``se = sqrt((mean of
    d^2 - centre^2) / (n + 2))``. For 0/1 scores this is their ``p~12 - p~21``; for scores in [0, 1] the
    pseudo-pairs floor the variance. The plain Wald interval has zero width when every difference is
    equal (all ties: "non-inferior" from 32 tied items, or from one) and so vouches for nothing.

    Example: 32 ties -> ``(0.0, sqrt(2 / 34) / sqrt(34) = 0.0416)``; the one-sided 95% lower bound
    -0.068 shows no 5-point margin (0 worse of 32 still fits 8.9% worse pairs: 1 - 0.05^(1/32)).
    """
    adjusted = [*map(float, diffs), 1.0, -1.0]
    m = len(adjusted)
    centre = sum(adjusted) / m
    return centre, math.sqrt(max(0.0, sum(d * d for d in adjusted) / m - centre * centre) / m)


def decide(
    candidate: Sequence[float],
    promoted: Sequence[float],
    margin: float = 0.05,
    alpha: float = 0.05,
    floor: float = 0.0,
    rule: str = "no_drop",
) -> Decision:
    """Promote or reject a candidate from paired probe scores (see the module docstring).

    Args:
        candidate: the candidate's score per probe item, each in [0, 1].
        promoted: the promoted version's score on the same items, same order.
        margin: the largest drop in mean score tolerated (absolute, e.g. 0.05 = 5 points).
        alpha: the sign test's level.
        floor: the least mean score a candidate may have (0 = none).
        rule: ``"no_drop"`` (promote unless significantly worse by more than the margin) or
            ``"noninferior"`` (promote only when the lower bound shows it is not worse by more).

    Raises:
        ValueError: no items, different lengths, a score outside [0, 1], a margin, alpha or floor
            outside its range, or an unknown rule.
    """
    n = len(candidate)
    if n == 0 or n != len(promoted):
        raise ValueError(f"paired probe results need the same number (> 0) of items, got {n} and {len(promoted)}")
    if any(not 0.0 <= float(x) <= 1.0 for x in (*candidate, *promoted)):
        raise ValueError("probe scores must be in [0, 1]")
    if not (0.0 <= margin <= 1.0 and 0.0 < alpha < 1.0 and 0.0 <= floor <= 1.0):
        raise ValueError(f"need 0 <= margin <= 1, 0 < alpha < 1, 0 <= floor <= 1; got {margin}, {alpha}, {floor}")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    diffs = [float(c) - float(p) for c, p in zip(candidate, promoted)]
    cand, prom = sum(map(float, candidate)) / n, sum(map(float, promoted)) / n
    delta = sum(diffs) / n
    center, se = adjusted_wald(diffs)
    half = 1.96 * se
    ci = (max(-1.0, center - half), min(1.0, center + half))  # a difference of scores in [0, 1]
    lower = center - NormalDist().inv_cdf(1.0 - alpha) * se
    worse, better = sum(d < 0 for d in diffs), sum(d > 0 for d in diffs)
    p = sign_test_p(worse, better)
    figures = (
        f"candidate {cand:.3f} vs promoted {prom:.3f} on {n} items (delta {delta:+.3f} "
        f"[{ci[0]:+.3f}, {ci[1]:+.3f}]; worse on {worse}, better on {better}, p = {p:.3g})"
    )
    backoff = True
    if cand < floor:
        promote, why = False, f"below the floor {floor:.3f}"
    elif p < alpha and delta < -margin:
        promote, why = False, f"significantly worse (sign test p < {alpha:g}) by more than the margin {margin:.3f}"
    elif rule == "noninferior" and lower <= -margin:
        promote, backoff = False, False
        why = (
            f"unproven: not shown non-inferior (one-sided {1 - alpha:.0%} lower bound of the difference "
            f"{lower:+.3f} <= -{margin:.3f})"
        )
    elif rule == "noninferior":
        promote, why = True, f"non-inferior (one-sided {1 - alpha:.0%} lower bound {lower:+.3f} > -{margin:.3f})"
    elif delta < -margin:
        promote, why = True, f"a drop beyond the margin {margin:.3f} but not significant (p >= {alpha:g})"
    elif p < alpha:
        promote, why = True, f"significantly worse but within the margin {margin:.3f}"
    else:
        promote, why = True, "no significant drop"
    return Decision(
        promote=promote,
        reason=f"{'promoted' if promote else 'rejected'}: {why}: {figures}",
        n=n,
        candidate_mean=cand,
        promoted_mean=prom,
        delta=delta,
        delta_ci=ci,
        worse=worse,
        better=better,
        p_worse=p,
        lower=lower,
        backoff=backoff,
    )


def guard_failure(
    candidate: dict[str, float] | None,
    baseline: dict[str, float] | None,
    entropy_ratio_min: float = 0.1,
    mismatch_max: float = 0.01,
) -> str | None:
    """Why a candidate fails the invariant guards, or None when it passes (or was not measured).

    Args:
        candidate: the candidate's ``{"entropy", "mismatch_kl"}`` on probe replies (nats per token;
            ``LearnerWorker.probe_invariants``); None or nan values: not measured, no verdict.
        baseline: the baseline version's, for the entropy ratio (None: no entropy verdict).
        entropy_ratio_min: the least ``candidate entropy / baseline entropy`` (0 = off).
        mismatch_max: the largest ``mismatch_kl`` (0 = off).
    """
    if not candidate:
        return None
    ent, kl = candidate.get("entropy", math.nan), candidate.get("mismatch_kl", math.nan)
    base = (baseline or {}).get("entropy", math.nan)
    if entropy_ratio_min > 0 and math.isfinite(ent) and math.isfinite(base) and ent < entropy_ratio_min * base:
        return (
            f"policy entropy collapsed: {ent:.4f} nats/token on the probe's replies, below "
            f"{entropy_ratio_min:g} x the baseline's {base:.4f}"
        )
    if mismatch_max > 0 and math.isfinite(kl) and kl > mismatch_max:
        return f"engine/learner log-prob mismatch {kl:.3g} (KL per token) above {mismatch_max:g}"
    return None

"""The promotion gate's decision rule (issue #26) on hand-made paired probe results: promote on a wobble
that is not significant, reject on a significant drop beyond the margin, reject below the floor."""

import math

import pytest

from clawray.promotion import decide, guard_failure, sign_test_p


def _pairs(both_right, worse, better, both_wrong):
    """0/1 scores: (candidate, promoted) pairs of the four McNemar cells."""
    cells = [(1, 1)] * both_right + [(0, 1)] * worse + [(1, 0)] * better + [(0, 0)] * both_wrong
    return [c for c, _ in cells], [p for _, p in cells]


def test_sign_test_p_is_the_exact_binomial_tail():
    assert sign_test_p(3, 1) == 5 / 16  # (C(4,3) + C(4,4)) / 2^4
    assert sign_test_p(8, 0) == 1 / 256
    assert sign_test_p(0, 5) == 1.0 and sign_test_p(0, 0) == 1.0
    assert sign_test_p(6, 4) == pytest.approx(386 / 1024)  # C(10,6..10) = 210+120+45+10+1
    with pytest.raises(ValueError):
        sign_test_p(-1, 2)


def test_a_wobble_that_is_not_significant_is_promoted():
    cand, prom = _pairs(9, 3, 1, 7)  # candidate 10/20, promoted 12/20
    d = decide(cand, prom, margin=0.05, alpha=0.05)
    assert d.promote and (d.worse, d.better, d.p_worse) == (3, 1, 5 / 16)
    assert (d.candidate_mean, d.promoted_mean, d.delta) == (0.5, 0.6, pytest.approx(-0.1))
    assert d.reason.startswith("promoted: a drop beyond the margin 0.050 but not significant (p >= 0.05)")


def test_a_significant_drop_beyond_the_margin_is_rejected():
    cand, prom = _pairs(4, 8, 0, 8)  # candidate 4/20, promoted 12/20: worse on 8, better on none
    d = decide(cand, prom, margin=0.05, alpha=0.05)
    assert not d.promote and d.p_worse == 1 / 256 and d.delta == pytest.approx(-0.4)
    assert d.reason == (
        "rejected: significantly worse (sign test p < 0.05) by more than the margin 0.050: candidate 0.200 vs "
        "promoted 0.600 on 20 items (delta -0.400 [-0.601, -0.126]; worse on 8, better on 0, p = 0.00391)"
    )
    # the adjusted Wald interval (Bonett & Price 2012): 22 differences, a pseudo-pair each way
    centre, se = -8 / 22, math.sqrt((10 / 22 - (8 / 22) ** 2) / 22)
    assert d.delta_ci == pytest.approx((centre - 1.96 * se, centre + 1.96 * se))


def test_a_significant_drop_within_the_margin_is_promoted():
    cand, prom = _pairs(100, 9, 0, 91)  # 200 items, delta -0.045, p = 2^-9
    d = decide(cand, prom, margin=0.05, alpha=0.05)
    assert d.promote and d.p_worse == 1 / 512 and "within the margin" in d.reason


def test_below_the_floor_is_rejected_even_when_better():
    cand, prom = _pairs(1, 0, 1, 18)  # candidate 2/20 = 0.1, promoted 1/20
    d = decide(cand, prom, floor=0.2)
    assert not d.promote and d.reason.startswith("rejected: below the floor 0.200")
    assert decide(cand, prom, floor=0.1).promote  # at the floor is not below it


def test_graded_scores_are_paired_by_sign():
    d = decide([0.5, 0.5, 1.0, 0.25], [0.5, 1.0, 0.75, 0.25], margin=0.0)
    assert (d.worse, d.better) == (1, 1) and d.delta == pytest.approx(-0.0625) and d.promote


@pytest.mark.parametrize(
    "cand, prom, kw",
    [([], [], {}), ([1], [1, 0], {}), ([1.5], [1], {}), ([1], [1], {"alpha": 0.0}), ([1], [1], {"margin": -0.1})],
)
def test_bad_input_is_a_clear_error(cand, prom, kw):
    with pytest.raises(ValueError):
        decide(cand, prom, **kw)


def test_the_invariant_guards_name_a_collapse_and_a_mismatch_and_pass_the_rest():
    base = {"entropy": 0.8, "mismatch_kl": 1e-6}
    # entropy 0.39 < 0.5 x 0.8 = 0.4: collapsed; 0.41 passes
    why = guard_failure({"entropy": 0.39, "mismatch_kl": 1e-6}, base, entropy_ratio_min=0.5, mismatch_max=0.01)
    assert (
        why == "policy entropy collapsed: 0.3900 nats/token on the probe's replies, below 0.5 x the baseline's 0.8000"
    )
    assert guard_failure({"entropy": 0.41, "mismatch_kl": 1e-6}, base, 0.5, 0.01) is None
    why = guard_failure({"entropy": 0.9, "mismatch_kl": 0.02}, base, 0.5, 0.01)
    assert why == "engine/learner log-prob mismatch 0.02 (KL per token) above 0.01"
    # off, unmeasured (None, nan: no usable reply) or without a baseline: no verdict
    assert guard_failure({"entropy": 0.01, "mismatch_kl": 5.0}, base, 0.0, 0.0) is None
    assert guard_failure(None, base, 0.5, 0.01) is None
    assert guard_failure({"entropy": math.nan, "mismatch_kl": math.nan}, base, 0.5, 0.01) is None
    assert guard_failure({"entropy": 0.01, "mismatch_kl": 0.0}, None, 0.5, 0.01) is None


def test_the_noninferior_rule_promotes_only_what_its_lower_bound_vouches_for():
    z = 1.6448536269514715  # the standard normal's 0.95 quantile
    # 200 items, better on 4, worse on 2: delta +0.01; the adjusted Wald bound (Bonett & Price 2012)
    # adds a pseudo-pair each way: centre 2/202, se sqrt((8/202 - (2/202)^2) / 202)
    cand, prom = _pairs(100, 2, 4, 94)
    d = decide(cand, prom, margin=0.05, alpha=0.05, rule="noninferior")
    assert (
        d.lower
        == pytest.approx(2 / 202 - z * math.sqrt((8 / 202 - (2 / 202) ** 2) / 202))
        == pytest.approx(-0.013102, abs=1e-6)
    )
    assert d.promote and d.reason.startswith("promoted: non-inferior (one-sided 95% lower bound -0.013 > -0.050)")
    # a significant drop within the margin: "no drop" promotes it, but it is not *shown* within the margin
    # (delta -0.045, lower bound -0.0711 <= -0.05): unproven, rejected without evidence of harm
    cand, prom = _pairs(100, 9, 0, 91)
    assert decide(cand, prom).promote
    d = decide(cand, prom, rule="noninferior")
    lower = -9 / 202 - z * math.sqrt((11 / 202 - (9 / 202) ** 2) / 202)
    assert not d.promote and not d.backoff and d.lower == pytest.approx(lower) == pytest.approx(-0.071064, abs=1e-6)
    assert d.reason.startswith(
        "rejected: unproven: not shown non-inferior (one-sided 95% lower bound of the difference -0.071 <= -0.050)"
    )
    # the wobble "no drop" promotes (10/20 vs 12/20) cannot be vouched for on 20 items: lower -0.271
    cand, prom = _pairs(9, 3, 1, 7)
    d = decide(cand, prom, rule="noninferior")
    assert (
        not d.promote
        and not d.backoff
        and d.lower == pytest.approx(-2 / 22 - z * math.sqrt((6 / 22 - (2 / 22) ** 2) / 22))
    )
    # harm is still harm: a significant drop and the floor back off under either rule
    cand, prom = _pairs(4, 8, 0, 8)
    d = decide(cand, prom, rule="noninferior")
    assert not d.promote and d.backoff and "significantly worse" in d.reason
    d = decide(*_pairs(1, 0, 1, 18), floor=0.2, rule="noninferior")
    assert not d.promote and d.backoff and "below the floor" in d.reason
    with pytest.raises(ValueError, match="rule must be one of"):
        decide([1], [1], rule="maybe")


@pytest.mark.parametrize(
    "n, lower",
    [
        # every pair tied: the plain Wald bound was 0 (zero width), "non-inferior" from one item or 32
        (1, -1.6448536269514715 * math.sqrt(2 / 3) / math.sqrt(3)),
        (32, -1.6448536269514715 * math.sqrt(2 / 34) / math.sqrt(34)),
        (200, -1.6448536269514715 * math.sqrt(2 / 202) / math.sqrt(202)),
    ],
)
def test_tied_probes_show_non_inferiority_only_when_they_are_large_enough(n, lower):
    """0 worse pairs of 32 still fit 8.9% worse pairs (one-sided 95%: 1 - 0.05^(1/32)), so 32 tied
    items cannot show a 5-point margin; 200 can (-0.0133)."""
    d = decide([1.0] * n, [1.0] * n, margin=0.05, rule="noninferior")
    assert d.lower == pytest.approx(lower) and d.promote is (lower > -0.05)
    assert [d.promote for d in [decide([0.5] * n, [0.5] * n, rule="noninferior")]] == [n == 200]


def test_the_interval_of_the_difference_stays_within_the_scores_range():
    """32 items the candidate loses all: the adjusted Wald interval was [-1.055, -0.828]."""
    d = decide([0.0] * 32, [1.0] * 32)
    assert d.delta == -1.0 and d.delta_ci[0] == -1.0 and d.delta_ci[1] == pytest.approx(-0.8276, abs=1e-4)
    assert decide([1.0] * 32, [0.0] * 32).delta_ci[1] == 1.0

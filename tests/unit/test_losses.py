import math

import pytest
import torch

from clawray.algos.advantages import binary_advantages
from clawray.algos.losses import ppo_clip_loss, sequence_logprobs, token_entropy


def test_binary_advantages_broadcast_reward_to_masked_tokens():
    adv = binary_advantages(torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 0], [0, 1, 1]]))
    assert adv.tolist() == [[1.0, 1.0, 0.0], [-0.0, -1.0, -1.0]]


def test_binary_advantages_rejects_mismatched_batch():
    with pytest.raises(ValueError, match="expected rewards"):
        binary_advantages(torch.tensor([1.0]), torch.ones(2, 3))


def test_ppo_clip_loss_hand_computed():
    # ratios exp(d) for d = log(1.5), log(0.5), log(1.1), log(0.7); advantages +1, -1, -1, +1
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    out = ppo_clip_loss(new, old, adv, torch.ones(4), eps=0.2, eps_high=0.28)
    # token 0: min(1.5, 1.28) * 1 = 1.28 (clipped)        -> loss -1.28
    # token 1: min(-0.5, -0.8) = -0.8 (clipped, ratio<1-eps) -> loss 0.8
    # token 2: min(-1.1, -1.1) = -1.1 (inside)             -> loss 1.1
    # token 3: min(0.7, 0.8) = 0.7 (unclipped branch)      -> loss -0.7
    assert out.token_loss.tolist() == pytest.approx([-1.28, 0.8, 1.1, -0.7], abs=1e-6)
    assert out.loss.item() == pytest.approx((-1.28 + 0.8 + 1.1 - 0.7) / 4, abs=1e-6)
    assert out.clipped.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_ppo_clip_loss_mask_and_normalizer():
    new = torch.log(torch.tensor([1.0, 2.0, 1.0]))
    out = ppo_clip_loss(new, torch.zeros(3), torch.tensor([2.0, 2.0, 2.0]), torch.tensor([1, 0, 1]))
    assert out.loss.item() == pytest.approx(-2.0)  # (-2 + -2) / 2 masked tokens; the ratio-2 token is masked
    out = ppo_clip_loss(new, torch.zeros(3), torch.tensor([2.0, 2.0, 2.0]), torch.tensor([1, 0, 1]), normalizer=8.0)
    assert out.loss.item() == pytest.approx(-0.5)


def test_ppo_clip_loss_all_masked_is_zero_with_finite_grad():
    new = torch.randn(5, requires_grad=True)
    out = ppo_clip_loss(new, torch.zeros(5), torch.ones(5), torch.zeros(5))
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert torch.isfinite(new.grad).all() and new.grad.abs().sum().item() == 0.0


def test_ppo_gradient_is_advantage_times_ratio_inside_clip():
    new = torch.tensor([0.0], requires_grad=True)  # ratio 1 -> d(-ratio*A)/dlogp = -A
    ppo_clip_loss(new, torch.zeros(1), torch.tensor([3.0]), torch.ones(1)).loss.backward()
    assert new.grad.item() == pytest.approx(-3.0)


def test_ppo_clip_loss_shape_mismatch():
    with pytest.raises(ValueError, match="share one shape"):
        ppo_clip_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2), torch.ones(3))


def test_sequence_logprobs_temperature_and_greedy():
    logits = torch.tensor([[2.0, 0.0]])
    lp = sequence_logprobs(logits, torch.tensor([0]), temperature=1.0).item()
    assert lp == pytest.approx(2.0 - math.log(math.exp(2.0) + 1.0), rel=1e-5)
    lp_t = sequence_logprobs(logits, torch.tensor([0]), temperature=0.5).item()
    assert lp_t == pytest.approx(4.0 - math.log(math.exp(4.0) + 1.0), rel=1e-5)
    assert sequence_logprobs(logits, torch.tensor([0]), temperature=0.0).item() == pytest.approx(lp)


def test_token_entropy_uniform():
    assert token_entropy(torch.zeros(2, 4)).tolist() == pytest.approx([math.log(4)] * 2)


# ---------------------------------------------------------------- advantages
from clawray.algos.advantages import combine_advantages, group_advantages, opd_advantages  # noqa: E402
from clawray.algos.losses import aggregate, kl_penalty, topk_reverse_kl  # noqa: E402


def test_group_advantages_population_std_and_zero_variance_group():
    rewards = torch.tensor([0.3] * 7 + [0.9] + [1.0, 1.0, 1.0] + [5.0])
    groups = torch.tensor([0] * 8 + [1, 1, 1] + [2])
    adv = group_advantages(rewards, groups)
    assert adv[:7].tolist() == pytest.approx([-0.3779645] * 7, abs=1e-6)
    assert adv[7].item() == pytest.approx(2.6457513, abs=1e-6)
    assert adv[8:].tolist() == [0.0, 0.0, 0.0, 0.0]  # all-equal group and a group of one: exactly 0


def test_group_advantages_tiny_std_is_not_amplified():
    adv = group_advantages(torch.tensor([1.0, 1.0 + 1e-9]), torch.tensor([0, 0]))
    assert adv.tolist() == [0.0, 0.0]


def test_opd_and_combine_advantages():
    teacher = torch.tensor([[-1.0, -0.5, -3.0]])
    rollout = torch.tensor([[-2.0, -0.5, -1.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert opd_advantages(teacher, rollout, mask).tolist() == [[1.0, 0.0, 0.0]]
    assert opd_advantages(teacher, rollout, torch.ones(1, 3), clip=1.5).tolist() == [[1.0, 0.0, -1.5]]
    both = combine_advantages(
        torch.tensor([1.0, -1.0]),
        teacher.repeat(2, 1),
        rollout.repeat(2, 1),
        torch.ones(2, 3),
        torch.tensor([True, False]),
        w_rl=0.5,
        w_opd=2.0,
    )
    # sample 0: 0.5*1 + 2*(1, 0, -2); sample 1 has no hint: exactly 0.5*-1, no mismatch noise
    assert both.tolist() == [[2.5, 0.5, -3.5], [-0.5, -0.5, -0.5]]


# ---------------------------------------------------------------- aggregation
def test_aggregation_modes_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx((6.0 + 4.0) / 2)
    assert aggregate(values, mask, "token-mean", num_tokens=8).item() == pytest.approx(10 / 8)
    assert aggregate(values, mask, "seq-mean-token-sum", num_seqs=4).item() == pytest.approx(10 / 4)
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(values, mask, "mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_all_masked_micro_batch_gives_zero_loss_and_finite_zero_grad(mode):
    logp = torch.randn(2, 4, requires_grad=True)
    out = ppo_clip_loss(logp, torch.zeros(2, 4), torch.ones(2, 4), torch.zeros(2, 4), agg_mode=mode)
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.isfinite(logp.grad).all() and logp.grad.abs().sum() == 0


# ---------------------------------------------------------------- PPO variants
def test_dual_clip_bounds_negative_advantage_loss():
    new = torch.log(torch.tensor([5.0, 5.0, 0.5]))  # ratio 5 with A<0: PPO loss 5; dual clip c=3 -> 3
    adv = torch.tensor([-1.0, 1.0, -1.0])
    out = ppo_clip_loss(new, torch.zeros(3), adv, torch.ones(3), eps=0.2, eps_high=0.28, dual_clip=3.0)
    assert out.token_loss.tolist() == pytest.approx([3.0, -1.28, 0.8])
    assert out.clipped.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(new, torch.zeros(3), adv, torch.ones(3), dual_clip=1.0)


def test_decoupled_ppo_with_truncated_importance_weight():
    logp = torch.log(torch.tensor([1.0, 1.0]))
    proximal = torch.zeros(2)  # the anchor equals the current policy: ratio 1
    behaviour = torch.log(torch.tensor([0.5, 0.1]))  # proximal/behaviour weights 2 and 10
    out = ppo_clip_loss(logp, proximal, torch.ones(2), torch.ones(2), behaviour_logprobs=behaviour, tis_cap=4.0)
    assert out.is_weight.tolist() == pytest.approx([2.0, 4.0])  # 10 truncated at the cap
    assert out.token_loss.tolist() == pytest.approx([-2.0, -4.0])
    assert out.loss.item() == pytest.approx(-3.0)


# ---------------------------------------------------------------- KL and distillation
def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-1.0, 0.0])  # d = +1, -1
    assert kl_penalty(logp, ref, "k1").tolist() == [1.0, -1.0]
    assert kl_penalty(logp, ref, "k2").tolist() == [0.5, 0.5]
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx([math.exp(-1) - 1 + 1, math.exp(1) - 1 - 1])
    assert kl_penalty(logp, logp, "k3").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")


def test_topk_reverse_kl_with_tail_bin_hand_computed():
    # vocab of 3, student uniform; teacher top-2 = ids (0, 1) with p = 0.5, 0.25 -> tail 0.25
    student = torch.zeros(1, 3, requires_grad=True)
    t_lp = torch.log(torch.tensor([[0.5, 0.25]]))
    ids = torch.tensor([[0, 1]])
    kl = topk_reverse_kl(student, t_lp, ids)
    third = 1 / 3
    expected = third * math.log(third / 0.5) + third * math.log(third / 0.25) + third * math.log(third / 0.25)
    assert kl.item() == pytest.approx(expected, abs=1e-6)
    kl.sum().backward()
    assert torch.isfinite(student.grad).all()
    # identical distributions: zero
    same = topk_reverse_kl(torch.log(torch.tensor([[0.5, 0.25, 0.25]])), t_lp, ids)
    assert same.item() == pytest.approx(0.0, abs=1e-6)


def test_topk_reverse_kl_full_mass_stays_finite():
    kl = topk_reverse_kl(torch.tensor([[10.0, -10.0]]), torch.log(torch.tensor([[0.5, 0.5]])), torch.tensor([[0, 1]]))
    assert torch.isfinite(kl).all()


# ---------------------------------------------------------------- invariants
from clawray.algos.invariants import (  # noqa: E402
    DegenerateBatchGuard,
    EntropyController,
    effective_token_rate,
    logprob_mismatch_kl,
    masked_quantile,
    signal_stats,
)


def test_invariant_metrics_hand_computed():
    assert masked_quantile(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1, 1, 1, 0]), 0.5) == 2.0
    assert math.isnan(masked_quantile(torch.tensor([1.0]), torch.tensor([0]), 0.1))
    r, lp = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.0 + math.log(2)])
    assert logprob_mismatch_kl(r, lp, torch.tensor([1, 1])) == pytest.approx((0 + (2 - 1 - math.log(2))) / 2)
    assert logprob_mismatch_kl(r, r, torch.tensor([1, 1])) == 0.0
    adv = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert effective_token_rate(adv, torch.tensor([[1, 1, 1], [1, 1, 0]]), response_tokens=5) == pytest.approx(0.4)
    assert signal_stats([1, 1, 1]) == {"nonzero_reward_frac": 1.0, "reward_std": 0.0, "one_signed": 1.0}
    assert signal_stats([1, -1, 0, 0]) == {
        "nonzero_reward_frac": 0.5,
        "reward_std": pytest.approx(math.sqrt(0.5)),
        "one_signed": 0.0,
    }


def test_degenerate_guard_modes():
    g = DegenerateBatchGuard("baseline", momentum=0.5)
    adv1, train1 = g.apply([1.0, 1.0])
    adv2, train2 = g.apply([1.0, 1.0])
    assert (adv1, adv2, train1, train2) == ([1.0, 1.0], [0.5, 0.5], True, True)
    assert g.baseline == pytest.approx(0.75) and g.degenerate_batches == 2
    assert g.apply([1.0, -1.0]) == ([1.0, -1.0], True)  # mixed signs keep raw rewards
    skip = DegenerateBatchGuard("skip")
    assert skip.apply([1.0, 1.0]) == ([1.0, 1.0], False) and skip.apply([1.0, -1.0]) == ([1.0, -1.0], True)
    assert skip.degenerate_batches == 1
    with pytest.raises(ValueError):
        DegenerateBatchGuard("sometimes")


def test_entropy_controller_rises_below_floor_and_falls_back():
    c = EntropyController(coef=0.0, floor=1.0, lr=0.1, max_coef=0.05)
    assert c.update(0.6) == pytest.approx(0.04)
    assert c.update(0.6) == pytest.approx(0.05)  # capped
    assert c.update(1.5) == pytest.approx(0.0)  # entropy back above the floor: the bonus decays
    assert EntropyController(coef=0.01).update(0.0) == 0.01  # floor 0: fixed coefficient


def test_a_resume_takes_the_controllers_state_and_keeps_this_runs_settings():
    """resume=true with a changed ``trainer.degenerate_batches`` or entropy floor: the checkpoint gives
    the running baseline, the count and an adapted coefficient; mode, momentum, floor, lr and max_coef
    are this run's (the whole saved controller was copied over them: new settings silently ignored)."""
    import dataclasses

    guard = DegenerateBatchGuard("skip", momentum=0.5)
    guard.restore(
        dataclasses.asdict(DegenerateBatchGuard("baseline", momentum=0.9, baseline=0.4, degenerate_batches=3))
    )
    assert (guard.mode, guard.momentum, guard.baseline, guard.degenerate_batches) == ("skip", 0.5, 0.4, 3)
    adapted = dataclasses.asdict(EntropyController(coef=0.08, floor=1.0, lr=0.1, max_coef=0.1))
    c = EntropyController(coef=0.0, floor=0.5, lr=0.01, max_coef=0.05)
    c.restore(adapted)  # both adapt: the coefficient carries on, within this run's max_coef
    assert (c.coef, c.floor, c.lr, c.max_coef) == (0.05, 0.5, 0.01, 0.05)
    fixed = EntropyController(coef=0.002)
    fixed.restore(adapted)  # floor 0 now: the configured constant
    assert fixed.coef == 0.002
    fresh = EntropyController(coef=0.001, floor=0.5)
    fresh.restore(dataclasses.asdict(EntropyController(coef=0.03)))  # the saved run did not adapt
    assert fresh.coef == 0.001


# ---------------------------------------------------------------- one sample's loss (the learner's code)
def _uniform_inputs(**kw):
    from clawray.algos.losses import SampleLossInputs

    # uniform logits over V = 4: every log-prob is -log 4, every entropy log 4
    lp = -math.log(4)
    base = dict(
        logits=torch.zeros(3, 4, requires_grad=True),
        targets=torch.tensor([0, 1, 2]),
        loss_mask=torch.tensor([1.0, 1.0, 0.0]),
        rollout_logprobs=torch.full((3,), lp),
        advantage=2.0,
        fresh=True,
    )
    return SampleLossInputs(**{**base, **kw})


def test_sample_loss_hand_computed_and_metrics_by_name():
    from clawray.algos.losses import SUM_METRICS, LossSettings, sample_loss

    lp = -math.log(4)
    out = sample_loss(_uniform_inputs(), LossSettings())
    # ratio 1 on both masked tokens, A = 2: token loss -2, token mean -2
    assert out.loss.item() == pytest.approx(-2.0)
    m = {k: v.item() for k, v in out.metrics.items() if k != "token_entropy"}
    assert set(out.metrics) == {*SUM_METRICS, "ratio_max", "token_entropy"}
    assert m == pytest.approx(
        {
            "loss": -2.0,
            "pg_loss": -2.0,
            "kl": 0.0,
            "clipped": 0.0,
            "ratio_sum": 2.0,
            "tokens": 2.0,
            "adv_sum": 4.0,
            "adv_sq_sum": 8.0,
            "effective_tokens": 2.0,
            "response_tokens": 3.0,
            "samples": 1.0,
            "is_weight_sum": 2.0,
            "mismatch_kl_sum": 0.0,
            "mismatch_tokens": 2.0,
            "entropy_sum": 2 * math.log(4),
            "ratio_max": 1.0,
            "adv_rl_abs_sum": 4.0,  # the reward term alone: |1 x 2| on 2 tokens
            "adv_opd_abs_sum": 0.0,
            "opd_tokens": 0.0,
            "topk_kl_sum": 0.0,
            "topk_tokens": 0.0,
        }
    )
    assert out.metrics["token_entropy"].tolist() == pytest.approx([math.log(4)] * 2)
    assert all(v.dtype == torch.float64 and not v.requires_grad for v in out.metrics.values())
    # OPD term: teacher - rollout = +0.5 on every token, w_rl 0.5, w_opd 2: A = 0.5 * 2 + 2 * 0.5 = 2 per token
    teacher = torch.full((3,), lp + 0.5)
    out = sample_loss(_uniform_inputs(teacher_logprobs=teacher, fresh=False), LossSettings(w_rl=0.5, w_opd=2.0))
    assert out.metrics["adv_sum"].item() == pytest.approx(4.0) and out.metrics["mismatch_tokens"].item() == 0.0
    # each term's scale, weights included: |0.5 x 2| = 1 and |2 x 0.5| = 1 on each of the 2 masked tokens
    terms = [out.metrics[k].item() for k in ("adv_rl_abs_sum", "adv_opd_abs_sum", "opd_tokens")]
    assert terms == pytest.approx([2.0, 2.0, 2.0])
    # KL to a reference 1 nat above: k1 = -1 per token, coefficient 0.1 -> loss -2 - 0.1
    out = sample_loss(
        _uniform_inputs(ref_logprobs=torch.full((3,), lp + 1.0)), LossSettings(kl_coef=0.1, kl_estimator="k1")
    )
    assert (out.loss.item(), out.metrics["kl"].item()) == pytest.approx((-2.1, -1.0))
    # entropy bonus: - 0.5 * log 4
    out = sample_loss(_uniform_inputs(entropy_coef=0.5), LossSettings())
    assert out.loss.item() == pytest.approx(-2.0 - 0.5 * math.log(4))


@pytest.mark.parametrize("bad", [float("nan"), -float("inf")])
@pytest.mark.parametrize(
    "settings",
    [
        dict(kl_coef=0.1, kl_estimator="k3"),
        dict(proximal=True, tis_cap=2.0, kl_coef=0.1, kl_estimator="k2"),
        dict(w_rl=0.5, w_opd=2.0, dual_clip=3.0),
    ],
)
@pytest.mark.parametrize("teacher", [False, True])
def test_a_masked_tokens_non_finite_inputs_change_neither_loss_nor_gradient(bad, settings, teacher):
    """Token 3 is masked. Its rollout, teacher and reference log-probs hold NaN or -inf: the loss and
    the logits' gradient equal those with finite values there (before: 0 * nan made the gradient NaN
    through the TIS weight, the advantage, the k2 straight-through and combine's teacher switch)."""
    from clawray.algos.losses import LossSettings, sample_loss

    lp = -math.log(4)

    def run(x):
        inputs = dict(
            rollout_logprobs=torch.tensor([lp - 0.1, lp + 0.2, x]),
            ref_logprobs=torch.tensor([lp + 0.3, lp - 0.2, x]),
            teacher_logprobs=torch.tensor([lp + 0.5, lp - 0.5, x]) if teacher else None,
        )
        inp = _uniform_inputs(**inputs)
        out = sample_loss(inp, LossSettings(**settings))
        out.loss.backward()
        return out.loss.item(), inp.logits.grad

    clean_loss, clean_grad = run(lp)
    loss, grad = run(bad)
    assert math.isfinite(clean_loss) and loss == pytest.approx(clean_loss)
    assert torch.equal(grad, clean_grad) and grad[2].abs().sum() == 0 and grad[:2].abs().sum() > 0


def test_combine_without_a_teacher_is_exactly_the_reward_term_whatever_the_log_probs_hold():
    """``has_teacher`` false: A_t = w_rl * r on every masked token, even where the (unused) rollout
    log-prob is -inf (the teacher term is -inf - -inf = nan there; nan x 0 was nan)."""
    rollout = torch.tensor([[-1.0, -float("inf")], [-1.0, -2.0]])
    adv = combine_advantages(
        torch.tensor([1.0, -1.0]),
        torch.tensor([[float("nan"), 0.0], [-0.5, -1.0]]),
        rollout,
        torch.ones(2, 2),
        torch.tensor([False, True]),
        w_rl=0.5,
        w_opd=2.0,
    )
    assert adv.tolist() == [[0.5, 0.5], [-0.5 + 2 * 0.5, -0.5 + 2 * 1.0]]


def test_batch_loss_metrics_by_name():
    from clawray.algos.losses import SUM_METRICS, batch_loss_metrics

    sums = dict.fromkeys(SUM_METRICS, 0.0)
    sums.update(
        loss=-8.0,
        tokens=4.0,
        adv_sum=4.0,
        adv_sq_sum=8.0,
        ratio_sum=4.0,
        clipped=1.0,
        samples=2.0,
        effective_tokens=2.0,
        response_tokens=8.0,
        entropy_sum=2.0,
    )
    m = batch_loss_metrics(
        sums, 1.5, torch.tensor([0.1, 0.2, 0.3, 1.4], dtype=torch.float64), world_size=2, num_mini_batches=2
    )
    assert m["loss"] == -2.0 and m["inv/adv_std"] == 1.0 and m["inv/clip_frac"] == 0.25
    assert m["inv/effective_token_rate"] == 0.25 and m["inv/entropy"] == 0.5 and m["inv/entropy_min"] == 0.1
    assert m["inv/entropy_p10"] == pytest.approx(0.13) and math.isnan(m["inv/logprob_mismatch_kl"])
    assert m["adv/rl_abs_mean"] == 0.0 and math.isnan(m["adv/opd_abs_mean"])  # no sample had a teacher
    sums.update(adv_rl_abs_sum=2.0, adv_opd_abs_sum=1.5, opd_tokens=3.0)
    m = batch_loss_metrics(sums, 1.5, torch.tensor([0.1], dtype=torch.float64), world_size=2, num_mini_batches=2)
    assert (m["adv/rl_abs_mean"], m["adv/opd_abs_mean"]) == (0.5, 0.5)  # 2 / 4 tokens, 1.5 / 3 OPD tokens


def test_batch_advantages_guard_and_grpo_groups():
    from clawray.algos.advantages import batch_advantages

    # one-signed rewarded samples (+1, +1) and a pure OPD sample (None): baseline 0 -> 0.5 * 1 after
    out = batch_advantages([1.0, None, 1.0], DegenerateBatchGuard("baseline", momentum=0.5))
    assert out.advantages == [1.0, 0.0, 1.0] and out.train and out.rewarded == [0, 2]
    assert out.signal["one_signed"] == 1.0
    assert batch_advantages([1.0, 1.0], DegenerateBatchGuard("skip")).train is False
    # GRPO: groups {a: [1, -1]}, {b: [1]}: +-1 in a, 0 for the group of one (the guard still counts)
    guard = DegenerateBatchGuard("none")
    out = batch_advantages([1.0, -1.0, 1.0], guard, "grpo", ["a", "a", "b"])
    assert out.advantages == [1.0, -1.0, 0.0] and guard.degenerate_batches == 0
    with pytest.raises(ValueError, match="group key"):
        batch_advantages([1.0], guard, "grpo")
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        batch_advantages([1.0], guard, "gae")


def test_skip_drops_a_one_signed_batchs_reward_terms_and_keeps_its_teacher_terms():
    """Combine with degenerate_batches=skip: a one-signed rewarded set skipped the whole update, every
    sample's teacher term with it, while the same teacher terms in a pure OPD batch trained. Now the
    reward terms are zeroed and the batch trains; a batch without a teacher is still skipped."""
    from clawray.algos.advantages import batch_advantages

    for estimator in ("binary", "baseline"):
        guard = DegenerateBatchGuard("skip")
        out = batch_advantages([1.0, None, 1.0], guard, estimator, teacher=[True, True, False])
        assert (out.advantages, out.train, guard.degenerate_batches) == ([0.0, 0.0, 0.0], True, 1)
        no_teacher = batch_advantages([1.0, 1.0], DegenerateBatchGuard("skip"), estimator, teacher=[False, False])
        assert no_teacher.train is False
    mixed = batch_advantages([1.0, -1.0], DegenerateBatchGuard("skip"), teacher=[True, True])
    assert (mixed.advantages, mixed.train) == ([1.0, -1.0], True)  # not degenerate: untouched


def test_batch_advantages_baseline_on_every_batch():
    from clawray.algos.advantages import batch_advantages

    # momentum 0.5: b = 0 for the first batch, then 0.5 * 0 + 0.5 * mean(-1, -1, -1, 1) = -0.25
    guard = DegenerateBatchGuard("baseline", momentum=0.5)
    out = batch_advantages([-1.0, -1.0, -1.0, 1.0], guard, "baseline")
    assert out.advantages == [-1.0, -1.0, -1.0, 1.0] and guard.baseline == -0.25
    # a mixed batch now trains on r - b too (with "binary" it would keep its raw rewards)
    out = batch_advantages([-1.0, 1.0, None], guard, "baseline")
    assert out.advantages == [-0.75, 1.25, 0.0] and out.rewarded == [0, 1]
    assert guard.baseline == -0.125 and guard.degenerate_batches == 0
    # "skip" still skips a one-signed batch
    assert batch_advantages([1.0, 1.0], DegenerateBatchGuard("skip"), "baseline").train is False


@pytest.mark.parametrize("mode", ["none", "skip"])
def test_the_baseline_estimator_keeps_its_running_mean_in_every_guard_mode(mode):
    """``trainer.advantage: baseline`` with ``degenerate_batches`` none or skip trained on raw rewards:
    the guard updated its running mean only in its own ``baseline`` mode, so ``b`` stayed 0."""
    from clawray.algos.advantages import batch_advantages

    guard = DegenerateBatchGuard(mode, momentum=0.5)
    out = batch_advantages([1.0, 1.0, 1.0, -1.0], guard, "baseline")  # b: 0 -> 0.5 * 0.5 = 0.25
    assert out.advantages == [1.0, 1.0, 1.0, -1.0] and guard.baseline == 0.25
    out = batch_advantages([1.0, -1.0], guard, "baseline")  # b before it: 0.25; after: 0.125
    assert out.advantages == [0.75, -1.25] and out.train and guard.baseline == 0.125
    # the guard's own advantages stay the raw rewards in these modes; skip still skips one-signed batches
    assert guard.apply([1.0, 1.0]) == ([1.0, 1.0], mode == "none") and guard.baseline == 0.5625


def test_a_topk_distillation_sample_counts_every_masked_token_as_effective():
    """A top-k sample (no reward, advantage 0) trains every masked token through the reverse KL, yet
    ``inv/effective_token_rate`` and ``inv/adv_std`` read 0, so every top-k run failed the report's
    effective-samples and signal checks. Its tokens are effective now, and ``opd/topk_kl`` is its signal."""
    from clawray.algos.losses import SUM_METRICS, LossSettings, batch_loss_metrics, sample_loss

    # V = 4, uniform student; teacher top-2 = ids (0, 1) at p = 0.5, 0.25 on each token: tail 0.25 over
    # 2 ids. KL(s || t) per token = 1/4 log(1/4 / 1/2) + 1/4 log(1/4 / 1/4) + 2/4 log(2/4 / 1/4) = 1/4 log 2
    t_lp = torch.log(torch.tensor([[0.5, 0.25]] * 3))
    ids = torch.tensor([[0, 1]] * 3)
    out = sample_loss(
        _uniform_inputs(advantage=0.0, teacher_topk_logprobs=t_lp, teacher_topk_ids=ids, fresh=False), LossSettings()
    )
    assert out.loss.item() == pytest.approx(0.25 * math.log(2), abs=1e-6)  # token mean over the 2 masked tokens
    m = {k: out.metrics[k].item() for k in SUM_METRICS}
    assert (m["effective_tokens"], m["tokens"], m["response_tokens"], m["topk_tokens"]) == (2.0, 2.0, 3.0, 2.0)
    assert m["topk_kl_sum"] == pytest.approx(0.5 * math.log(2), abs=1e-6) and m["adv_sq_sum"] == 0.0
    batch = batch_loss_metrics(m, 1.0, out.metrics["token_entropy"], 1, 1)
    assert batch["inv/effective_token_rate"] == pytest.approx(2 / 3)
    assert batch["opd/topk_kl"] == pytest.approx(0.25 * math.log(2), abs=1e-6)
    # a PPO sample with advantage 0 carries no gradient: not effective, and no top-k KL
    plain = sample_loss(_uniform_inputs(advantage=0.0), LossSettings())
    assert plain.metrics["effective_tokens"].item() == 0.0 and plain.metrics["topk_tokens"].item() == 0.0
    sums = {k: plain.metrics[k].item() for k in SUM_METRICS}
    assert math.isnan(batch_loss_metrics(sums, 1.0, plain.metrics["token_entropy"], 1, 1)["opd/topk_kl"])


def test_a_combine_topk_sample_trains_its_reward_term_beside_the_weighted_topk_kl():
    """Combine with ``opd.loss=topk`` trained pure top-k distillation: the KL replaced the PPO loss, so
    the PRM reward (``w_rl * a``) and ``w_opd`` were ignored while ``adv/rl_abs_mean`` still read the
    reward. Loss = PPO of ``w_rl * a`` + ``w_opd`` x top-k KL; pure OPD (a = 0) keeps the KL alone."""
    from clawray.algos.losses import LossSettings, sample_loss

    t_lp = torch.log(torch.tensor([[0.5, 0.25]] * 3))  # as above: KL = 1/4 log 2 per token
    ids = torch.tensor([[0, 1]] * 3)
    inputs = dict(teacher_topk_logprobs=t_lp, teacher_topk_ids=ids, fresh=False)
    # a = 2, w_rl 0.5: ratio 1, A = 1 per token -> PPO token mean -1; w_opd 2 -> + 2 x 1/4 log 2
    out = sample_loss(_uniform_inputs(advantage=2.0, **inputs), LossSettings(w_rl=0.5, w_opd=2.0))
    assert out.loss.item() == pytest.approx(-1.0 + 0.5 * math.log(2), abs=1e-6)
    assert out.metrics["pg_loss"].item() == pytest.approx(-1.0) and out.metrics["adv_rl_abs_sum"].item() == 2.0
    only_kl = sample_loss(_uniform_inputs(advantage=0.0, **inputs), LossSettings(w_rl=0.5, w_opd=2.0))
    assert only_kl.loss.item() == pytest.approx(0.5 * math.log(2), abs=1e-6)  # pure OPD: w_opd x KL


def test_every_loss_metric_lives_on_the_inputs_device(monkeypatch):
    """``opd_tokens`` of a sample without a teacher was a CPU tensor beside the others on the GPU: the
    learner's metric sums (one ``torch.stack``) then failed on every pure-RL step on CUDA. Checked on
    the ``meta`` device, which any non-CPU device stands for here."""
    import torch.fx.experimental._config as fx_config

    from clawray.algos.losses import LossSettings, SampleLossInputs, sample_loss

    monkeypatch.setattr(fx_config, "meta_nonzero_assume_all_nonzero", True)
    dev, r, v = "meta", 3, 5
    inp = SampleLossInputs(
        logits=torch.zeros(r, v, device=dev),
        targets=torch.zeros(r, dtype=torch.long, device=dev),
        loss_mask=torch.ones(r, device=dev),
        rollout_logprobs=torch.zeros(r, device=dev),
        advantage=1.0,
    )
    metrics = sample_loss(inp, LossSettings()).metrics
    assert {k: t.device.type for k, t in metrics.items()} == {k: "meta" for k in metrics}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_kl_loss_pulls_toward_the_reference_whatever_the_estimator(estimator):
    """The KL term was the estimator itself, differentiated: on tokens sampled from pi, ``E[grad k1] = 0``
    (``kl_estimator=k1`` never pulled toward the reference) and ``E[grad k3] = grad KL(ref || pi)``.
    The term keeps the estimator's value with k2's gradient, whose expectation is grad KL(pi || ref)
    (Tang & Munos 2025). Checked exactly: every token of a 4-token vocabulary weighted by pi."""
    from clawray.algos.losses import kl_loss, kl_penalty

    theta = torch.tensor([1.0, 0.0, -0.5, 0.3], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.5, 0.0, -1.0], dtype=torch.float64), -1)

    def grad(f):
        lp = torch.log_softmax(theta, -1)
        return torch.autograd.grad(f(lp), theta)[0]

    exact = grad(lambda lp: (lp.exp() * (lp - ref)).sum())  # grad KL(pi || ref)
    assert exact.tolist() == pytest.approx([0.1692, -0.2021, -0.1226, 0.1554], abs=1e-4)
    got = grad(lambda lp: (lp.exp().detach() * kl_loss(lp, ref, estimator)).sum())
    assert got.tolist() == pytest.approx(exact.tolist(), abs=1e-12)
    lp = torch.log_softmax(theta, -1)
    assert kl_loss(lp, ref, estimator).tolist() == pytest.approx(kl_penalty(lp, ref, estimator).tolist())


def test_skip_keeps_a_one_signed_batch_whose_centred_advantages_carry_a_signal():
    """``trainer.degenerate_batches=skip`` vetoed every one-signed batch, the right veto for raw binary
    rewards; under ``grpo`` and ``baseline`` the advantages are already centred, so continuous positive
    rewards (shaping, returns) had every batch skipped. Those skip when the advantages are one-signed."""
    from clawray.algos.advantages import batch_advantages
    from clawray.algos.invariants import DegenerateBatchGuard

    out = batch_advantages([0.2, 1.0, 0.6, 0.6], DegenerateBatchGuard(mode="skip"), "grpo", ["p", "p", "q", "q"])
    assert out.advantages == pytest.approx([-1.0, 1.0, 0.0, 0.0]) and out.train
    out = batch_advantages([0.2, 1.0], DegenerateBatchGuard(mode="skip", baseline=0.9), "baseline")
    assert out.advantages == pytest.approx([-0.7, 0.1]) and out.train
    same = batch_advantages([0.6, 0.6], DegenerateBatchGuard(mode="skip"), "grpo", ["p", "p"])
    assert same.advantages == [0.0, 0.0] and not same.train  # no signal left: skipped
    above = batch_advantages([1.0, 0.6], DegenerateBatchGuard(mode="skip", baseline=0.5), "baseline")
    assert above.advantages == pytest.approx([0.5, 0.1]) and not above.train  # both above b: no contrast
    binary = batch_advantages([0.2, 1.0], DegenerateBatchGuard(mode="skip"), "binary")
    assert binary.advantages == [0.2, 1.0] and not binary.train  # raw one-signed rewards: skipped


def test_the_entropy_quantile_equals_torch_quantile_and_takes_any_size():
    """``inv/entropy_p10`` used ``torch.quantile``, which refuses more than 2**24 values: a step of
    17M masked tokens (256 samples x 64k) raised after its optimizer update. Same values, any size."""
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 1000):
        v = torch.rand(n, generator=gen)
        for q in (0.0, 0.1, 0.5, 0.9, 1.0):
            assert masked_quantile(v, torch.ones(n), q) == pytest.approx(float(torch.quantile(v, q)), abs=1e-6)
    big = torch.arange(2**24 + 1, dtype=torch.float32)  # 0 .. 2**24: the 0.1-quantile is 0.1 * 2**24
    assert masked_quantile(big.flip(0), torch.ones(2**24 + 1), 0.1) == pytest.approx(0.1 * 2**24, abs=1.0)


def test_a_ratio_past_float32_leaves_the_other_tokens_gradient_finite():
    """A token whose behaviour log-prob is 100 nats below the learner's: exp(100) overflows float32.
    That token sits in a constant branch (clipped, or the dual clip's bound), so its gradient is 0 and
    the loss is finite; the backward's 0 * inf made the whole step's gradient NaN (skipped as nonfinite)."""
    old = torch.tensor([-1.0, -100.5])
    lp = torch.tensor([-1.0, -0.5], requires_grad=True)
    out = ppo_clip_loss(lp, old, torch.tensor([1.0, 1.0]), torch.ones(2))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-(1.0 + 1.28) / 2)  # eps_high 0.28: the token clipped at 1.28
    assert lp.grad.tolist() == pytest.approx([-0.5, 0.0])
    lp.grad = None
    out = ppo_clip_loss(lp, old, torch.tensor([-1.0, -1.0]), torch.ones(2), dual_clip=3.0)
    out.loss.backward()
    assert out.loss.item() == pytest.approx((1.0 + 3.0) / 2) and lp.grad.tolist() == pytest.approx([0.5, 0.0])
    lp.grad = None  # the same token masked out: inf * 0 in the aggregation gave a NaN loss
    out = ppo_clip_loss(lp, old, torch.tensor([-1.0, -1.0]), torch.tensor([1.0, 0.0]))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(1.0) and lp.grad.tolist() == pytest.approx([1.0, 0.0])
    # the proximal anchor's importance weight exp(old - behaviour), 100 nats apart: clamped as the ratio
    # (exp(100) overflowed: an inf loss, the mini-batch skipped as non-finite)
    lp.grad = None
    old_near = torch.tensor([-1.0, -0.5])
    out = ppo_clip_loss(
        lp, old_near, torch.tensor([1.0, 1.0]), torch.ones(2), behaviour_logprobs=torch.tensor([-1.0, -100.5])
    )
    out.loss.backward()
    assert out.is_weight.tolist() == pytest.approx([1.0, math.exp(20.0)]) and torch.isfinite(out.loss)
    assert lp.grad.tolist() == pytest.approx([-0.5, -math.exp(20.0) / 2])
    d = torch.tensor([-50.0], requires_grad=True)  # k3 = exp(-d) - 1 + d: finite, its gradient too
    value = kl_penalty(d, torch.zeros(1), "k3")
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(d.grad).all()


def test_a_non_finite_log_prob_on_a_masked_token_gives_no_advantage_and_no_nan():
    """(teacher - rollout) * mask was NaN where a masked token's teacher log-prob is -inf (-inf * 0), and
    NaN reached every weight's gradient; a masked token contributes nothing, whatever it holds."""
    from clawray.algos.advantages import combine_advantages, opd_advantages

    teacher = torch.tensor([[-1.0, -2.0, -math.inf], [-0.5, math.nan, -1.0]])
    rollout = torch.tensor([[-1.5, -1.0, -2.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert opd_advantages(teacher, rollout, mask).tolist() == [[0.5, -1.0, 0.0], [0.5, 0.0, 0.0]]
    both = combine_advantages(torch.tensor([1.0, -1.0]), teacher, rollout, mask, torch.tensor([True, False]))
    assert both.tolist() == [[1.5, 0.0, 0.0], [-1.0, 0.0, -1.0]]


def test_advantages_and_kl_refuse_shapes_that_would_silently_broadcast():
    from clawray.algos.advantages import combine_advantages, opd_advantages
    from clawray.algos.losses import kl_penalty

    two, one = torch.zeros(2, 3), torch.zeros(3)
    with pytest.raises(ValueError, match="has_teacher \\(1,\\) must be \\[B\\]"):  # it gave sample 1 the OPD term
        combine_advantages(torch.tensor([1.0, -1.0]), two, two, torch.ones(2, 3), torch.tensor([True]))
    with pytest.raises(ValueError, match="must have one shape"):
        opd_advantages(two, one, torch.ones(2, 3))
    with pytest.raises(ValueError, match="differ"):
        kl_penalty(two, one)


def test_k3_is_never_negative_at_small_log_ratios():
    """exp(-d) - 1 + d cancels in float32 near d = 0 (0.9% of terms negative at |d| ~ 1e-3, 5% in bf16);
    k3 = x - 1 - log x >= 0 for every x (Schulman 2020). Now computed in float64."""
    from clawray.algos.losses import kl_penalty

    d = torch.tensor([1e-3, -1e-3, 3e-4, -7e-4, 1e-5])
    for dtype in (torch.float32, torch.bfloat16):
        k3 = kl_penalty(d.to(dtype), torch.zeros(5, dtype=dtype), "k3")
        dd = d.to(dtype).double()
        assert k3.dtype == dtype and (k3 >= 0).all()
        assert k3.double() == pytest.approx((torch.exp(-dd) - 1 + dd).tolist(), rel=1e-2)


def test_masked_logits_add_nothing_to_the_entropy_or_the_topk_kl_and_give_finite_gradients():
    """A -inf logit (a masked or padded vocabulary entry) is a zero-probability entry: ``p log p`` -> 0.
    It used to give 0 * -inf = NaN in both the value and the gradient."""
    logits = torch.tensor([[0.0, 0.0, float("-inf"), 0.0]], requires_grad=True)
    h = token_entropy(logits)
    assert h.tolist() == pytest.approx([math.log(3)])
    h.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().max().item() < 1e-6  # uniform: a maximum
    # top-k KL: the teacher's top-2 holds an id the student masks. Restricted to {id 0, id 2, tail},
    # the student has p = (1/3, 0, 2/3) and the teacher (0.5, 0.25, 0.25):
    # KL = 1/3 log((1/3)/0.5) + 0 + 2/3 log((2/3)/0.25)
    student = torch.tensor([[0.0, 0.0, float("-inf"), 0.0]], requires_grad=True)
    kl = topk_reverse_kl(student, torch.log(torch.tensor([[0.5, 0.25]])), torch.tensor([[0, 2]]))
    want = (1 / 3) * math.log((1 / 3) / 0.5) + (2 / 3) * math.log((2 / 3) / 0.25)
    assert kl.tolist() == pytest.approx([want], rel=1e-5)
    kl.sum().backward()
    assert torch.isfinite(student.grad).all()
    # the student masks every id of the teacher's top-1: all its mass is in the tail bin,
    # KL = 1 x log(1 / (1 - 0.3)); the gradient used to be NaN everywhere (logsumexp of all -inf)
    student = torch.tensor([[0.0, float("-inf")]], requires_grad=True)
    kl = topk_reverse_kl(student, torch.log(torch.tensor([[0.3]])), torch.tensor([[1]]))
    assert kl.tolist() == pytest.approx([math.log(1 / 0.7)], rel=1e-5)
    kl.sum().backward()
    assert student.grad.tolist() == [[0.0, 0.0]]

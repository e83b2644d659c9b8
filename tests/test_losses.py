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

"""The learner's forward projects only the response positions to the vocabulary, and gives the same
logits and gradients as each sample's own full forward."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from clawray.actors.learner import response_logits
from clawray.types import Sample

# (prompt_len, response_len): different prompts (the earliest response starts at position 2) and lengths
SHAPES = [(3, 4), (6, 2), (5, 5)]


@pytest.fixture(scope="module")
def model(tiny_model):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for p, r in SHAPES:
        tokens = torch.randint(10, 200, (p + r,), generator=g).tolist()
        out.append(
            Sample(
                tokens=tokens,
                prompt_len=p,
                loss_mask=[1] * r,
                rollout_logprobs=[-1.0] * r,
                reward=1.0,
                policy_version=0,
            )
        )
    return out


def _head_inputs(model) -> tuple[list, torch.utils.hooks.RemovableHandle]:
    """The shapes the output embedding is called with (recorded after any pre-hook ran)."""
    shapes = []
    handle = model.get_output_embeddings().register_forward_hook(lambda _m, args, _out: shapes.append(args[0].shape))
    return shapes, handle


def _reference(model, samples) -> list[torch.Tensor]:
    """Each sample alone, its full ``[T, V]`` logits sliced at the response positions."""
    return [model(input_ids=torch.tensor([s.tokens])).logits[0, s.prompt_len - 1 : -1] for s in samples]


def test_only_response_rows_reach_the_head_and_values_match_each_sample_alone(model):
    samples = _samples()
    shapes, handle = _head_inputs(model)
    try:
        got = response_logits(model, samples, torch.device("cpu"))
    finally:
        handle.remove()
    hidden = model.config.hidden_size
    # 4 + 2 + 5 = 11 response rows projected, not 3 x 10 padded positions (nor the 3 x 7 from position 2 on)
    assert [tuple(s) for s in shapes] == [(1, 11, hidden)]
    assert [tuple(t.shape) for t in got] == [
        (4, model.config.vocab_size),
        (2, model.config.vocab_size),
        (5, model.config.vocab_size),
    ]
    for g, ref in zip(got, _reference(model, samples)):
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)
    assert not model.get_output_embeddings()._forward_pre_hooks  # the gather hook is removed again


def test_gradients_match_each_sample_alone(model):
    """The gather's backward scatters into the response rows only: the head's and the embedding's
    gradients equal those of the samples' own forwards."""
    samples = _samples()
    weights = [torch.linspace(-1.0, 1.0, s.response_len) for s in samples]

    def grads(logits_list):
        model.zero_grad(set_to_none=True)
        loss = sum((torch.log_softmax(x, -1)[:, 7] * w).sum() for x, w in zip(logits_list, weights))
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got, ref = grads(response_logits(model, samples, torch.device("cpu"))), grads(_reference(model, samples))
    assert got.keys() == ref.keys() and len(got) == len(list(model.parameters()))
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_model_without_output_embedding_gathers_from_the_logits(model, monkeypatch):
    samples = _samples()
    head = model.get_output_embeddings()
    shapes = []
    handle = head.register_forward_hook(lambda _m, args, _out: shapes.append(tuple(args[0].shape)))
    monkeypatch.setattr(model, "get_output_embeddings", lambda: None)
    try:
        got = response_logits(model, samples, torch.device("cpu"))
    finally:
        handle.remove()
    # logits_to_keep: positions 2..8 of the 10-token batch (from the shortest prompt's last token)
    assert shapes == [(3, 7, model.config.hidden_size)]
    for g, ref in zip(got, _reference(model, samples)):
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)

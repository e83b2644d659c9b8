"""HFBackend samples what it records: the first-token distribution against the full softmax, the top-p
nucleus, greedy, seeds, a hostile ``generation_config.json`` in the model folder, and cancellation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from clawray.engines.base import GenerateRequest, sample_next_token

PROMPT = [5, 6, 7, 8]
N_SAMPLES = 400
CHI2_9DOF_P001 = 27.877  # chi-square critical value, 9 degrees of freedom, p = 0.001


@pytest.fixture(scope="module")
def engine(tiny_model):
    from clawray.engines.hf import HFBackend

    return HFBackend(tiny_model, seed=1234)


@pytest.fixture(scope="module")
def hostile_engine(tiny_model, tmp_path_factory):
    """The tiny model in a folder whose generation_config.json asks for greedy-like sampling."""
    from clawray.engines.hf import HFBackend

    path = tmp_path_factory.mktemp("hostile") / "tiny"
    shutil.copytree(tiny_model, path)
    cfg = json.loads((path / "generation_config.json").read_text())
    cfg.update(
        {
            "do_sample": True,
            "top_k": 1,
            "temperature": 0.1,
            "top_p": 0.1,
            "repetition_penalty": 3.0,
            "min_p": 0.5,
            "no_repeat_ngram_size": 1,
        }
    )
    (path / "generation_config.json").write_text(json.dumps(cfg))
    return HFBackend(str(path), seed=99)


def _probs(engine, prompt, temperature=1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt])).logits[0, -1].float()
    return torch.softmax(logits / temperature, dim=-1)


def _first_tokens(engine, n, **kw) -> list[int]:
    return [engine.generate([GenerateRequest(PROMPT, max_tokens=1, **kw)])[0].response_ids[0] for _ in range(n)]


def _chi2_equal_mass_bins(probs: torch.Tensor, samples: list[int], bins: int = 10) -> float:
    """Pearson chi-square of ``samples`` against ``probs`` over ``bins`` groups of tokens of about
    equal mass (tokens ordered by probability)."""
    order = probs.argsort(descending=True)
    edges = torch.linspace(0, 1, bins + 1)[1:-1]
    bin_of_rank = torch.bucketize(probs[order].cumsum(0) - probs[order] / 2, edges)
    bin_of = torch.empty_like(bin_of_rank)
    bin_of[order] = bin_of_rank
    mass = torch.zeros(bins).index_add_(0, bin_of, probs)
    seen = torch.zeros(bins).index_add_(0, bin_of[torch.tensor(samples)], torch.ones(len(samples)))
    expected = mass * len(samples)
    return float(((seen - expected) ** 2 / expected).sum())


def test_first_token_follows_the_full_softmax_at_t1(engine):
    probs = _probs(engine, PROMPT)
    samples = _first_tokens(engine, N_SAMPLES, temperature=1.0, top_p=1.0)
    top50 = set(probs.topk(50).indices.tolist())
    outside = sum(t not in top50 for t in samples)
    expected_outside = N_SAMPLES * (1 - float(probs.topk(50).values.sum()))  # ~369 of 400 on the tiny model
    # binomial: 4 standard deviations; a top-k=50 sampler gives 0 outside
    assert abs(outside - expected_outside) < 4 * (expected_outside * (1 - expected_outside / N_SAMPLES)) ** 0.5
    assert _chi2_equal_mass_bins(probs, samples) < CHI2_9DOF_P001


def test_temperature_is_applied_before_sampling(engine):
    """T = 0.25 sharpens the tiny model's near-uniform softmax: the sample follows softmax(z / 0.25)."""
    probs = _probs(engine, PROMPT, 0.25)
    samples = _first_tokens(engine, N_SAMPLES, temperature=0.25, top_p=1.0)
    assert _chi2_equal_mass_bins(probs, samples) < CHI2_9DOF_P001
    assert _chi2_equal_mass_bins(_probs(engine, PROMPT, 1.0), samples) > CHI2_9DOF_P001  # and not T = 1


def test_top_p_samples_only_inside_the_nucleus(engine):
    probs = _probs(engine, PROMPT)
    sorted_p, order = probs.sort(descending=True)
    nucleus = set(order[(sorted_p.cumsum(0) - sorted_p) < 0.05].tolist())
    assert 10 < len(nucleus) < 100  # a real choice, far from the whole vocabulary
    samples = _first_tokens(engine, 200, temperature=1.0, top_p=0.05)
    assert set(samples) <= nucleus
    assert len(set(samples)) > 10
    out = engine.generate([GenerateRequest(PROMPT, max_tokens=8, temperature=1.0, top_p=0.05, seed=5)])[0]
    # recorded log-probs: the full softmax at T, not renormalised over the nucleus
    torch.testing.assert_close(
        torch.tensor(out.logprobs), torch.tensor(engine.logprobs(PROMPT, out.response_ids, 1.0)), atol=1e-5, rtol=0
    )


def test_sample_next_token_nucleus_keeps_the_token_that_crosses_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    seen = {sample_next_token(logits, 1.0, 0.6, gen)[0] for _ in range(300)}
    assert seen == {0, 1}  # mass before token 1 is 0.5 < 0.6: kept; before token 2 it is 0.8: dropped
    assert {sample_next_token(logits, 1.0, 0.45, gen)[0] for _ in range(50)} == {0}
    tok, lp = sample_next_token(logits, 0.0, 1.0, None)
    assert tok == 0 and lp == pytest.approx(float(torch.log(torch.tensor(0.5))), abs=1e-6)


def test_greedy_and_seeds(engine):
    greedy = engine.generate([GenerateRequest(PROMPT, max_tokens=10, temperature=0.0)])[0]
    with torch.no_grad():
        ids = torch.tensor([PROMPT + greedy.response_ids])
        assert engine.model(ids).logits[0, len(PROMPT) - 1 : -1].argmax(-1).tolist() == greedy.response_ids
    a, b, c = (engine.generate([GenerateRequest(PROMPT, max_tokens=12, temperature=1.0, seed=s)])[0] for s in (7, 7, 8))
    assert a.response_ids == b.response_ids != c.response_ids


def test_a_hostile_generation_config_changes_nothing(hostile_engine):
    """top_k 1, temperature 0.1, repetition_penalty 3 in the folder: T = 1 replies stay diverse and
    their log-probs are the full softmax of a teacher-forced forward pass."""
    outs = [
        hostile_engine.generate([GenerateRequest(PROMPT, max_tokens=12, temperature=1.0, seed=s)])[0] for s in range(6)
    ]
    assert len({tuple(o.response_ids) for o in outs}) == 6
    for o in outs:
        torch.testing.assert_close(
            torch.tensor(o.logprobs),
            torch.tensor(hostile_engine.logprobs(PROMPT, o.response_ids, 1.0)),
            atol=1e-5,
            rtol=0,
        )
    probs = _probs(hostile_engine, PROMPT)
    assert _chi2_equal_mass_bins(probs, _first_tokens(hostile_engine, N_SAMPLES, temperature=1.0)) < CHI2_9DOF_P001


def test_cancel_stops_at_the_next_token(engine):
    polls = []

    def cancelled(i):
        polls.append(i)
        return len(polls) > 3

    streamed = []
    out = engine.generate(
        [GenerateRequest(PROMPT, max_tokens=50, temperature=0.0)],
        on_tokens=lambda i, ids: streamed.extend(ids),
        cancelled=cancelled,
    )[0]
    assert out.finish_reason == "abort"
    assert len(out.response_ids) == 3 == len(out.logprobs) and streamed == out.response_ids


def test_scoring_projects_only_the_response_positions(engine):
    """``logprobs`` and ``topk_logprobs`` equal a full forward's values at the response positions, and
    the head sees only the R + 1 last positions (the prompt's last token on), not the whole sequence."""
    response = [9, 3, 11, 2, 17]
    ids = torch.tensor([PROMPT + response])
    with torch.no_grad():
        full = torch.log_softmax(engine.model(ids).logits[0, len(PROMPT) - 1 : -1].float(), dim=-1)  # [5, V]
    head = engine.model.get_output_embeddings()
    rows = []
    handle = head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[1]))
    try:
        lp = engine.logprobs(PROMPT, response, 1.0)
        top_values, top_ids = engine.topk_logprobs(PROMPT, response, 3, 1.0)
    finally:
        handle.remove()
    assert rows == [6, 6]  # 4 prompt + 5 response tokens: positions 3..8
    torch.testing.assert_close(torch.tensor(lp), full[torch.arange(5), torch.tensor(response)], atol=1e-5, rtol=0)
    expected = full.topk(3, dim=-1)
    assert top_ids == expected.indices.tolist()
    torch.testing.assert_close(torch.tensor(top_values), expected.values, atol=1e-5, rtol=0)

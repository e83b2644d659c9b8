"""Prompt ids without re-tokenisation drift: splice the previous turn's exact tokens into the new prompt.

Re-rendering a conversation with the chat template does not always give back the tokens the engine
produced for an earlier reply: thinking templates drop ``<think>`` blocks from earlier turns, tool-call
JSON is re-serialised, and a BPE may merge the reply's text differently. If turn t+1's prompt ids are
a fresh render, the policy is trained on a history it never generated (and the engine's prefix cache
misses). As NeMo-RL does, clawray builds turn t+1's prompt as

    prompt_ids(t) + response_ids(t) + tokens(everything the template renders after reply t)

so the earlier reply's tokens appear exactly as sampled. "Everything after reply t" is found by
rendering the history up to and including reply t, and the whole new history with the generation
prompt, both with reasoning dropped from assistant messages (the only part thinking templates render
differently depending on what follows); the suffix is the difference, starting right after the end
of reply t (the text of the stop token the engine sampled, or the whole end tag when the reply was
cut short).
"""

from __future__ import annotations

from typing import Any, Callable

Render = Callable[[list[dict[str, Any]], bool], str]


class SpliceError(ValueError):
    """The template does not render the new history as an extension of the old one."""


def _without_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != "reasoning_content"} if m["role"] == "assistant" else m
            for m in messages]


def splice_suffix(render: Render, messages: list[dict[str, Any]], n_messages: int, stop_text: str,
                  reply_stopped: bool) -> str:
    """The template text that follows reply t (``messages[n_messages]``) in the new prompt.

    Args:
        render: ``(messages, add_generation_prompt) -> text`` with the tokenizer's chat template
            (and the request's tools).
        messages: the new request's normalised history; ``messages[n_messages]`` is reply t.
        n_messages: how many messages turn t's prompt had.
        stop_text: the text of the stop token that ends an assistant message (e.g. ``<|im_end|>``).
        reply_stopped: reply t's ids end with that stop token (else it was cut at max_tokens and the
            suffix starts with the end tag).

    Returns:
        the text to tokenise and append after ``prompt_ids(t) + response_ids(t)``.

    Raises:
        SpliceError: the template renders the shorter history differently from the start of the
            longer one, or reply t's end tag cannot be found.
    """
    plain = _without_reasoning(messages)
    head = render(plain[: n_messages + 1], False)
    full = render(plain, True)
    if not full.startswith(head):
        raise SpliceError("the chat template renders the earlier turns differently once later ones follow")
    end = head.rfind(stop_text) if stop_text else -1
    if end < 0:
        raise SpliceError(f"the rendered reply does not end with the stop text {stop_text!r}")
    bridge = head[end + len(stop_text):] if reply_stopped else head[end:]
    return bridge + full[len(head):]

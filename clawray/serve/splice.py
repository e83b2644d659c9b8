"""Prompt ids without re-tokenisation drift: splice the previous turn's exact tokens into the new prompt.

Owns: the splice rule, the template suffix it appends (:func:`splice_suffix`) and when it refuses
(:class:`SpliceError`). Must not: tokenise or look up the previous turn: it takes a ``render``
callable; :mod:`clawray.serve.app` assembles the ids and renders afresh on a :class:`SpliceError`.

Re-rendering a conversation with the chat template does not always give back the tokens the engine
produced for an earlier reply: thinking templates drop ``<think>`` blocks from earlier turns, tool-call
JSON is re-serialised, and a BPE may merge the reply's text differently. If turn t+1's prompt ids are
a fresh render, the policy is trained on a history it never generated (and the engine's prefix cache
misses). As NeMo-RL does, clawray builds turn t+1's prompt as

    prompt_ids(t) + response_ids(t) + tokens(everything the template renders after reply t)

so the earlier reply's tokens appear exactly as sampled. Precisely, with ``body(t)`` = reply t's
ids without its final end-of-turn id (any id of :func:`clawray.chat.end_of_turn_ids` the engine
stopped on; all of them when the reply was cut at ``max_tokens``):

    prompt_ids(t + 1) = prompt_ids(t) + body(t) + tokens(template text from reply t's end tag on)

The end tag (e.g. ``<|im_end|>``) is the template's own, so a reply that ended on another end id
(``<|endoftext|>`` in Qwen's generation config) continues exactly as one that ended on ``<|im_end|>``
(the same ids: a special token is tokenised on its own), and a cut reply gets the end tag the
template renders. The stored response ids of turn t keep the id that was sampled.

"Template text from the end tag on" is found by rendering the history up to and including reply t,
and the whole new history with the generation prompt, both with reasoning dropped from assistant
messages (the only part thinking templates render differently depending on what follows); the
suffix is the difference, starting at reply t's end tag. Both renders use the new request's tools;
the server splices only when they are the tools of turn t too (:func:`clawray.chat.render_key`),
else it renders the whole prompt afresh.
"""

from __future__ import annotations

from typing import Any, Callable

Render = Callable[[list[dict[str, Any]], bool], str]


class SpliceError(ValueError):
    """The template does not render the new history as an extension of the old one."""


def _without_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in m.items() if k != "reasoning_content"} if m["role"] == "assistant" else m for m in messages
    ]


def splice_suffix(render: Render, messages: list[dict[str, Any]], n_messages: int, stop_text: str) -> str:
    """The template text that follows reply t's body (``messages[n_messages]``) in the new prompt,
    starting with the end tag.

    Args:
        render: ``(messages, add_generation_prompt) -> text`` with the tokenizer's chat template
            (and the request's tools).
        messages: the new request's normalised history; ``messages[n_messages]`` is reply t.
        n_messages: how many messages turn t's prompt had.
        stop_text: the end tag the template renders after an assistant message (e.g. ``<|im_end|>``).

    Returns:
        the text to tokenise and append after ``prompt_ids(t) + body(t)``.

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
    if end < len(render(plain[:n_messages], False)):  # none, or an earlier turn's: reply t is left open
        raise SpliceError(f"the rendered reply does not end with the stop text {stop_text!r}")
    return head[end:] + full[len(head) :]

"""A deployment's own probe set for the promotion gate (``deploy.probe_file``): held-out conversations,
each with a rule that checks the policy's next reply, read as an :class:`~clawray.envs.base.Environment`
so the gate's :class:`~clawray.evaluation.Evaluator` renders, seeds and scores them as it does an
environment's eval split.

Owns: the file's format, its validation and the rule's check. Must not: import Ray or send requests.

One JSON object per line (blank lines skipped)::

    {"messages": [{"role": "system", ...}, {"role": "user", "content": "2+2? Just the number."}],
     "answer": "4"}
    {"messages": [...], "regex": "^\\s*(yes|no)\\b"}

    {"messages": [...], "compare": true}

``messages`` is the conversation up to the reply to be judged (OpenAI chat messages, the last one a
``user`` or ``tool`` message). ``answer``: the reply passes when its text, stripped, equals the answer,
stripped. ``regex``: it passes when :func:`re.search` finds the pattern in the reply's text
(``re.DOTALL``). ``"compare": true``: no rule; the gate's judge compares the candidate's reply with
the promoted version's (:meth:`clawray.actors.judge.JudgeWorker.compare`). Exactly one of the three
per line. The one measure is ``passed``: 1.0 or 0.0 by a rule; a compare item scores 0.5 here (alone,
a reply ties with itself) and the gate replaces the candidate's 0.5 by the judge's preference.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from typing import Any

from clawray.envs.base import SPLITS, Environment


@dataclass
class ProbeItem:
    """One probe conversation.

    Attributes:
        question: the last message's text (names the item in the probe's replies).
        messages: the conversation up to the reply to be judged.
        answer: the exact reply (stripped) that passes, or None.
        regex: the pattern the reply must contain, or None.
        compare: no rule: the gate's judge compares two versions' replies.
    """

    question: str
    messages: list[dict[str, Any]] = field(repr=False)
    answer: str | None = None
    regex: str | None = None
    compare: bool = False

    def passes(self, reply: str) -> bool:
        """Whether ``reply`` (the assistant message's text) passes this item's rule.

        Raises:
            ValueError: a compare item (it has no rule).
        """
        if self.compare:
            raise ValueError("a compare item has no rule: the gate's judge compares two replies")
        if self.answer is not None:
            return reply.strip() == self.answer.strip()
        return re.search(self.regex, reply, re.DOTALL) is not None


def load_probe_items(path: str) -> list[ProbeItem]:
    """The items of a probe file (see the module docstring).

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``path:line: why`` for a line that is not a JSON object, has no ``messages`` list
            of role-bearing messages ending with a user or tool message, has not exactly one of
            ``answer``, ``regex`` and ``"compare": true``, or a pattern that does not compile; or a
            file without items.
    """
    path = os.path.expanduser(path)
    items = []
    with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is no part of the JSON
        for i, line in enumerate(f, start=1):
            if line.strip():
                items.append(_item(line, f"{path}:{i}"))
    if not items:
        raise ValueError(f"{path} holds no probe item")
    return items


def _item(line: str, where: str) -> ProbeItem:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    msgs = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
        raise ValueError(f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, ...], ...}}')
    if msgs[-1]["role"] not in ("user", "tool"):
        raise ValueError(f"{where}: the last message must be a user or tool message (the reply to it is judged)")
    answer, regex, compare = row.get("answer"), row.get("regex"), row.get("compare", False)
    if not isinstance(compare, bool):
        raise ValueError(f'{where}: "compare" must be true or false, got {compare!r}')
    rules = [x for x in (answer, regex) if x is not None]
    if len(rules) + compare != 1 or not all(isinstance(x, str) for x in rules):
        raise ValueError(
            f'{where}: give exactly one rule, "answer" (a string) or "regex" (a pattern), or "compare": true'
        )
    if regex is not None:
        try:
            re.compile(regex, re.DOTALL)
        except re.error as e:
            raise ValueError(f"{where}: regex {regex!r} does not compile ({e})") from None
    content = msgs[-1].get("content")
    return ProbeItem(str(content) if content is not None else "", msgs, answer, regex, compare)


class ProbeFileEnv(Environment):
    """A probe file as an environment for the gate: every item is held out (the file is the user's
    held-out set: it has no train split), ``check`` scores the reply appended after the item's
    conversation.

    Args:
        path: the JSONL file.

    Raises:
        See :func:`load_probe_items`.
    """

    name = "probe_file"

    def __init__(self, path: str):
        self.path = path
        self.items = load_probe_items(path)

    def prompts(self, split: str, seed: int = 0) -> list[ProbeItem]:  # type: ignore[override]
        """Every item, shuffled by ``seed``, for the ``eval`` split; none for ``train``.

        Raises:
            ValueError: an unknown split.
        """
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
        if split == "train":
            return []
        out = list(self.items)
        random.Random(seed).shuffle(out)
        return out

    def opening(self, task: ProbeItem) -> list[dict[str, Any]]:  # type: ignore[override]
        """The item's conversation (a copy)."""
        return [dict(m) for m in task.messages]

    def grade(self, task: ProbeItem, reply: str) -> dict[str, float]:  # type: ignore[override]
        """``{"passed": 1.0 | 0.0}``; 0.5 for a compare item (the gate's judge scores it)."""
        return {"passed": 0.5 if task.compare else float(task.passes(reply))}

    def check(self, task: ProbeItem, messages: list[dict[str, Any]]) -> dict[str, float]:  # type: ignore[override]
        """The rule on the LAST message of ``messages`` (the reply appended after the conversation,
        which may hold earlier assistant turns); a pure tool call scores the empty text."""
        last = messages[-1] if messages and messages[-1].get("role") == "assistant" else {}
        return self.grade(task, last.get("content") or "")

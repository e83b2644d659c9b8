"""The ``plain`` environment: word problems asked plainly, one short plain sentence wanted, said only
when correcting; the correction names what was wrong.

Owns: the check (:data:`MAX_WORDS`), the corrections and the preferred reply (the problems are
:func:`clawray.envs.arith.make_problem`'s one-step ones). Must not: import Ray, send requests, or decide
the split (:mod:`clawray.envs.base`).

The user asks a one-step word problem ("Zoe has 16 pencils and gives 5 to Tom. How many pencils does
Zoe have left?") and says nothing about the form. The user wants one short plain sentence with the
right number: a reply solves the task when it has no formatting (markdown lists, bold, headings,
code, LaTeX), is one line of at most :data:`MAX_WORDS` words, and states the answer with no other
number of its own (the question's numbers may be repeated, so "Zoe has 11 pencils left after giving
5 to Tom." and "16 - 5 = 11" are right, "16 - 5 = 12, so 11" is not). The user's correction names the
first check the reply failed: the formatting, the length, a missing answer, or a wrong number.

Unlike ``terse`` and ``concise``, whose one correction always asks for the same form of a bare sum, the
correction here depends on what the reply did, and the wanted reply is a sentence about the story:
the second kind of hint-carrying task of issue #28. An instruction-tuned model works such problems
out step by step with markdown and LaTeX. Measured by the job (Qwen2.5-Coder-0.5B-Instruct,
``env.max_tokens=64``, 64 held-out problems x 2, T = 0.7): 2.3% solved before training (correct
21.9%, no formatting 6.2%, short 4.7%); premise check: with the correction as hint the teacher's
replies are accepted 73% of the time, without it 2% (better on 15, worse on 0 of 15, p = 3.1e-5).
No tool is offered.
"""

from __future__ import annotations

import random
import re

from clawray.envs.arith import make_problem
from clawray.envs.base import Environment, Problem

MAX_WORDS = 30
ACCEPTED = "Correct, thanks! That is exactly what I wanted."
CORRECTIONS = {
    "formatting": "No formatting please (lists, bold, headings or LaTeX). Try again in one short plain sentence.",
    "length": "That's too long. Try again in one short plain sentence.",
    "no_answer": "I can't find the answer in that. Try again in one short plain sentence that gives the number.",
    "wrong": "That's wrong: check the numbers. Try again in one short plain sentence.",
}

_FORMATTING = re.compile(r"(\*\*|__|^#{1,6}\s|^\s*[-*+]\s|^\s*\d+[.)]\s|`|\\\(|\\\[|\\boxed|\$\$)", re.MULTILINE)
_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


def _numbers(text: str) -> set[float]:
    return {float(n.replace(",", "")) for n in _NUMBER.findall(text)}


class PlainEnv(Environment):
    """``plain``: :func:`~clawray.envs.arith.make_problem`'s one-step word problems (those whose
    answer is not one of the question's numbers), no stated preference; measures ``solved``,
    ``correct``, ``no_formatting``, ``short``."""

    name = "plain"
    preference = ""
    tools = None

    def draw(self, rng: random.Random) -> Problem:
        """A one-step problem whose answer is not one of its own numbers (so stating the answer
        cannot be mistaken for repeating the question)."""
        while True:
            task = make_problem(rng, 2)
            if task.answer not in _numbers(task.question):
                return task

    def grade(self, task: Problem, reply: str) -> dict[str, bool]:
        """``{"solved", "correct", "no_formatting", "short"}``; ``correct``: the reply states the
        answer and no number that is neither the answer nor one of the question's."""
        said = _numbers(reply)
        correct = task.answer in said and said <= _numbers(task.question) | {task.answer}
        no_formatting = _FORMATTING.search(reply) is None
        text = reply.strip()
        short = bool(text) and "\n" not in text and len(text.split()) <= MAX_WORDS
        return {
            "solved": correct and no_formatting and short,
            "correct": correct,
            "no_formatting": no_formatting,
            "short": short,
        }

    def preferred_reply(self, task: Problem) -> str:
        """One plain sentence with the answer: "The answer is 11."."""
        return f"The answer is {task.answer}."

    def feedback(self, task: Problem, reply: str) -> tuple[str, bool]:
        """:data:`ACCEPTED` when solved, else the :data:`CORRECTIONS` entry of the first failed check
        (formatting, length, a missing answer: no number but the question's, a wrong number)."""
        g = self.grade(task, reply)
        if g["solved"]:
            return ACCEPTED, True
        if not g["no_formatting"]:
            return CORRECTIONS["formatting"], False
        if not g["short"]:
            return CORRECTIONS["length"], False
        said = _numbers(reply)
        if task.answer not in said and said <= _numbers(task.question):
            return CORRECTIONS["no_answer"], False
        return CORRECTIONS["wrong"], False

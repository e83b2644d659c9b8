"""Arithmetic word problems generated from a seed (no data set is downloaded), and the ``arith``
environment: the user asks one and states a preference (one short sentence, no markdown); a reply
solves it when its answer is right and it has no markdown. A calculator tool is offered.

Owns: the problem generator, the preference, the check and the feedback, and the calculator tool (its
schema and a safe evaluation of its expression). Must not: import Ray, send requests (the simulated user
calls :func:`calculator`), or decide the split (:mod:`clawray.envs.base`).
"""

from __future__ import annotations

import ast
import operator
import random
import re

from clawray.envs.base import Environment, Problem

_NAMES = ["Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Iris", "Tom", "Lena", "Ravi", "Sara", "Ken"]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "shells", "cards", "stamps"]


def make_problem(rng: random.Random, level: int = 3) -> Problem:
    """A problem of difficulty ``level``.

    Levels: 1 = a bare sum of two numbers in 1..5 ("What is 4 + 3?"; SmolLM2-135M-Instruct answers
    about 60% of them right and briefly, a learnable signal); 2 = a one-step word problem; 3 = a
    two-step word problem (answers in 0..400).

    Raises:
        ValueError: an unknown level.
    """
    if level == 1:
        x, y = rng.randint(1, 5), rng.randint(1, 5)
        return Problem(f"What is {x} + {y}?", x + y)
    a, b = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    if level == 2:
        x, y = rng.randint(2, 12), rng.randint(2, 12)
        if rng.random() < 0.5:
            return Problem(f"{a} has {x} {item} and gets {y} more. How many {item} does {a} have now?", x + y)
        return Problem(f"{a} has {x + y} {item} and gives {y} to {b}. How many {item} does {a} have left?", x)
    if level != 3:
        raise ValueError(f"unknown problem level {level}; expected 1, 2 or 3")
    item = rng.choice(_ITEMS)
    kind = rng.randrange(4)
    x, y, z = rng.randint(5, 40), rng.randint(2, 20), rng.randint(1, 9)
    if kind == 0:
        q = f"{a} has {x} {item}. {a} buys {y} more and then gives {z} to {b}. How many {item} does {a} have now?"
        ans = x + y - z
    elif kind == 1:
        q = f"{a} packs {item} into {z} boxes with {y} {item} in each box, and has {x} left over. How many {item} are there in total?"
        ans = z * y + x
    elif kind == 2:
        q = f"{a} has {x} {item} and {b} has {y} more than {a}. How many {item} do they have together?"
        ans = x + (x + y)
    else:
        total = z * y
        q = f"{a} shares {total} {item} equally among {z} friends, then each friend gets {x} more. How many {item} does each friend have?"
        ans = y + x
    return Problem(q, ans)


def make_problems(n: int, seed: int = 0, level: int = 3) -> list[Problem]:
    """``n`` problems of ``level``, the same list for the same seed."""
    rng = random.Random(seed)
    return [make_problem(rng, level) for _ in range(n)]


PREFERENCE = "Reply in one short sentence, no markdown."

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def calculator(expression: str) -> str:
    """Evaluate ``+ - * /`` arithmetic safely; returns the result or ``"error: ..."``."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("unsupported expression")

    try:
        value = ev(ast.parse(str(expression), mode="eval").body)
        return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
    except Exception as e:
        return f"error: {e}"


_MARKDOWN = re.compile(r"(\*\*|__|^#{1,6}\s|^\s*[-*+]\s|^\s*\d+[.)]\s|`)", re.MULTILINE)
_ANSWER = re.compile(r"answer\s*[:=]?\s*\$?(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_LAST_LINE_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")  # "1,200" is 1200; "2.5" is 2.5, not 2 and 5


def grade(reply: str, problem: Problem) -> tuple[bool, bool, bool]:
    """``(has_answer, correct, markdown)`` for a reply.

    The answer is the last ``Answer: N`` in the reply, else the last number on the last line.
    """
    found = _ANSWER.findall(reply)
    if not found:
        lines = [ln for ln in reply.strip().splitlines() if ln.strip()]
        found = _LAST_LINE_NUMBER.findall(lines[-1]) if lines else []
    if not found:
        return False, False, bool(_MARKDOWN.search(reply))
    value = float(found[-1].replace(",", ""))
    return True, value == problem.answer, bool(_MARKDOWN.search(reply))


def feedback(reply: str, problem: Problem) -> tuple[str, bool]:
    """The user's next message for ``reply`` and whether the task is solved (right, no markdown)."""
    has_answer, correct, markdown = grade(reply, problem)
    if correct and not markdown:
        return "Correct, thanks! That is exactly what I wanted.", True
    if correct:
        return "The number is right, but I asked for no markdown. Please redo it as one plain sentence.", False
    if not has_answer:
        return "I can't find the answer in that. Please try again in one short sentence.", False
    return "That's wrong. Please try again, in one plain sentence.", False


class ArithEnv(Environment):
    """``arith``: word problems of ``level`` (see :func:`make_problem`) with the preference "one
    short sentence, no markdown" and a calculator tool.

    Level 1 is finite (the 25 sums x + y, x, y in 1..5: about 5 of them are in the eval split);
    levels 2 and 3 are generated (``prompts`` returns ``pool_size`` distinct tasks per split).
    Measures: ``solved`` (right answer, no markdown: the user's check), ``correct``, ``no_markdown``,
    ``has_answer``.

    Raises:
        ValueError: an unknown level.
    """

    name = "arith"
    preference = PREFERENCE
    tools = [CALCULATOR_TOOL]

    def __init__(self, level: int = 3):
        if level not in (1, 2, 3):
            raise ValueError(f"unknown problem level {level}; expected 1, 2 or 3")
        self.level = level

    def draw(self, rng: random.Random) -> Problem:
        """:func:`make_problem` at this level (the simulated user's generator)."""
        return make_problem(rng, self.level)

    def all_tasks(self) -> list[Problem] | None:
        """The 25 level-1 sums; None for the generated levels."""
        if self.level != 1:
            return None
        return [Problem(f"What is {x} + {y}?", x + y) for x in range(1, 6) for y in range(1, 6)]

    def grade(self, task: Problem, reply: str) -> dict[str, bool]:
        """``{"solved", "correct", "no_markdown", "has_answer"}`` by :func:`grade`."""
        has_answer, correct, markdown = grade(reply, task)
        return {
            "solved": correct and not markdown,
            "correct": correct,
            "no_markdown": not markdown,
            "has_answer": has_answer,
        }

    def preferred_reply(self, task: Problem) -> str:
        """One plain sentence with the answer: "The answer is 12."."""
        return f"The answer is {task.answer}."

    def feedback(self, task: Problem, reply: str) -> tuple[str, bool]:
        """:func:`feedback`."""
        return feedback(reply, task)

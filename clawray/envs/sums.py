"""The ``sums`` environment: the demo's "just the number" preference.

Owns: the task set, the preference, the check and the feedback. Must not: import Ray, send requests, or
decide the split (:mod:`clawray.envs.base`).

The user asks "What is x + y?" (x, y in 1..25: 625 distinct questions, about 125 of them in the
eval split) and says "Reply with the number only." A reply solves the task when it is the right
number and nothing else (optionally a final period, surrounding whitespace). SmolLM2-135M-Instruct
mostly gets such sums right but wraps the number in a sentence, so the preference leaves headroom a
few hundred judged turns can teach. No tool is offered.
"""

from __future__ import annotations

import random

from clawray.envs.base import NUMBER, NUMBER_ONLY, Environment, Problem, last_number

PREFERENCE = "Reply with the number only."
LOW, HIGH = 1, 25  # operand range, inclusive


class SumsEnv(Environment):
    """``sums``: x + y with x, y in ``LOW..HIGH``; the preference "the number only".

    Measures: ``solved`` (the right number and nothing else: the user's check), ``correct`` (the
    last number in the reply is the sum), ``number_only`` (the reply is one number).
    """

    name = "sums"
    preference = PREFERENCE
    tools = None

    def draw(self, rng: random.Random) -> Problem:
        """A uniformly random pair of operands."""
        x, y = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        return Problem(f"What is {x} + {y}?", x + y)

    def all_tasks(self) -> list[Problem]:
        """All ``(HIGH - LOW + 1) ** 2`` questions."""
        return [Problem(f"What is {x} + {y}?", x + y) for x in range(LOW, HIGH + 1) for y in range(LOW, HIGH + 1)]

    def grade(self, task: Problem, reply: str) -> dict[str, bool]:
        """``{"solved", "correct", "number_only"}``."""
        correct = last_number(reply) == task.answer
        number_only = NUMBER_ONLY.fullmatch(reply) is not None
        return {"solved": correct and number_only, "correct": correct, "number_only": number_only}

    def preferred_reply(self, task: Problem) -> str:
        """The number alone: "7"."""
        return str(task.answer)

    def feedback(self, task: Problem, reply: str) -> tuple[str, bool]:
        """The user's next message from :meth:`grade` and whether the task is solved."""
        g = self.grade(task, reply)
        if g["solved"]:
            return "Correct, thanks! That is exactly what I wanted.", True
        if g["correct"]:
            return "The number is right, but I asked for the number only. Please redo it with just the number.", False
        if not NUMBER.search(reply):
            return "I can't find the answer in that. Please try again with just the number.", False
        return "That's wrong. Please try again, with just the number.", False

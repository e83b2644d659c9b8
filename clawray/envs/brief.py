"""The ``brief`` environment: the CPU demo's preference, a short reply to a small sum.

Owns: the task set and its phrasings, the check (:data:`MAX_WORDS`) and the feedback. Must not: import
Ray, send requests, or decide the split (:mod:`clawray.envs.base`).

The user asks a one-digit sum in one of six phrasings ("What is 3 + 4?", "Add 3 and 4.", ...;
x, y in 1..9: 486 distinct questions, about 97 of them in the eval split) and says "Reply with
the number only." The check is lenient about the form and strict about the length: a reply solves
the task when its last number is the sum and it is one line of at most :data:`MAX_WORDS` words
("7", "3 + 4 = 7", "The answer is 7." all pass; a paragraph that ends on 7 does not).

Why this task (measured on SmolLM2-135M-Instruct, vLLM, T = 0.7, 20 prompts x 4 samples each;
see the demo note in README): with "x + y, x, y in 1..25, the number only" the base model is solved
0% of the time (no positive reward to learn from); on one-digit sums it gets the number right
about 42% of the time but rambles, and the short-and-right check passes about 23% of replies: a
preference with positive examples to reinforce and headroom above them, which does not ask the
135M model for new arithmetic skill.
"""

from __future__ import annotations

import random

from clawray.envs.base import NUMBER, NUMBER_ONLY, Environment, Problem, last_number

PREFERENCE = "Reply with the number only."
LOW, HIGH = 1, 9  # operand range, inclusive
MAX_WORDS = 8
TEMPLATES = (
    "What is {x} + {y}?",
    "What's {x} plus {y}?",
    "Add {x} and {y}.",
    "Compute {x} + {y}.",
    "How much is {x} + {y}?",
    "What do you get when you add {x} to {y}?",
)


class BriefEnv(Environment):
    """``brief``: one-digit sums in six phrasings; the preference "the number only", checked as
    "right and brief".

    Measures: ``solved`` (correct and brief: the user's check), ``correct`` (the last number in the
    reply is the sum), ``brief`` (one line, at most :data:`MAX_WORDS` whitespace-separated words),
    ``number_only`` (the reply is one number, the strict reading of the preference).
    """

    name = "brief"
    preference = PREFERENCE
    tools = None

    def draw(self, rng: random.Random) -> Problem:
        """A uniformly random phrasing and pair of operands."""
        x, y, t = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH), rng.choice(TEMPLATES)
        return Problem(t.format(x=x, y=y), x + y)

    def all_tasks(self) -> list[Problem]:
        """All ``len(TEMPLATES) * (HIGH - LOW + 1) ** 2`` questions."""
        return [
            Problem(t.format(x=x, y=y), x + y)
            for t in TEMPLATES
            for x in range(LOW, HIGH + 1)
            for y in range(LOW, HIGH + 1)
        ]

    def grade(self, task: Problem, reply: str) -> dict[str, bool]:
        """``{"solved", "correct", "brief", "number_only"}``."""
        correct = last_number(reply) == task.answer
        text = reply.strip()
        brief = bool(text) and "\n" not in text and len(text.split()) <= MAX_WORDS
        return {
            "solved": correct and brief,
            "correct": correct,
            "brief": brief,
            "number_only": NUMBER_ONLY.fullmatch(reply) is not None,
        }

    def preferred_reply(self, task: Problem) -> str:
        """The number alone: "7"."""
        return str(task.answer)

    def feedback(self, task: Problem, reply: str) -> tuple[str, bool]:
        """The user's next message from :meth:`grade` and whether the task is solved. A correction
        names the right answer and the wanted form (the number alone): information the reply
        lacked, so as an OPD hint (the ``feedback`` judge passes the correction verbatim) it lets
        the teacher prefer exactly the reply the user wanted."""
        g = self.grade(task, reply)
        if g["solved"]:
            return "Correct, thanks! Short and clear, exactly what I wanted.", True
        if g["correct"]:
            return (
                f"The number is right, but that is far too long: I asked for the number only. Please redo it "
                f"as just: {task.answer}"
            ), False
        if not NUMBER.search(reply):
            return (
                f"I can't find the answer in that. It is {task.answer}; please try again with just the number.",
                False,
            )
        return f"That's wrong: the answer is {task.answer}. Please try again, with just the number.", False

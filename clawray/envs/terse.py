"""The ``terse`` environment: a preference the user states only when correcting (OPD's case).

Owns: the feedback that states the preference (the tasks and the check are :mod:`clawray.envs.sums`'s).
Must not: import Ray, send requests, or decide the split (:mod:`clawray.envs.base`).

The user asks "What is x + y?" (x, y in 1..25, as :mod:`clawray.envs.sums`) and says nothing about
the form; the user wants the number alone, and says so in the correction. A reply solves the task
when it is the right number and nothing else. An instruction-tuned model answers in a sentence
("7 + 7 equals 14."), so the base rate is about 0 and Binary RL has no accepted reply to reinforce;
the correction carries exactly what the reply lacked, so an OPD teacher that reads it can teach
(issue #28: Qwen2.5-Coder-0.5B-Instruct replies with just the number 0/24 times plain and 24/24 with
such a hint). No tool is offered.
"""

from __future__ import annotations

from clawray.envs.base import NUMBER, Problem
from clawray.envs.sums import SumsEnv


class TerseEnv(SumsEnv):
    """``terse``: :class:`~clawray.envs.sums.SumsEnv`'s tasks and check without the stated
    preference; measures ``solved``, ``correct``, ``number_only``."""

    name = "terse"
    preference = ""

    def feedback(self, task: Problem, reply: str) -> tuple[str, bool]:
        """The user's next message (the preference, said now) and whether the task is solved."""
        g = self.grade(task, reply)
        if g["solved"]:
            return "Correct, thanks! That is exactly what I wanted.", True
        if g["correct"]:
            return "That's not what I asked for: please redo it as just the number, no words, no equation.", False
        if not NUMBER.search(reply):
            return "I can't find the answer in that. Please redo it as just the number, no words, no equation.", False
        return "That's wrong. Please redo it as just the number, no words, no equation.", False

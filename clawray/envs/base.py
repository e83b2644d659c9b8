"""Environments: a task set with disjoint train/eval splits, a simulated user's check, and its feedback.

Owns: the :class:`Environment` contract (below), the split rule (:func:`split_of`) and drawing the tasks
of one split. Must not: import Ray, send requests to the policy (:mod:`clawray.envs.sim_user` does), or
read data files (an environment's own, e.g. :mod:`clawray.envs.gsm8k`).

An :class:`Environment` owns three things that must agree:

- ``prompts(split, seed)``: the tasks of one split. The split of a task is a pure function of its
  question text (:func:`split_of`: SHA-256 of a fixed salt + the text), so the train and eval
  splits never overlap, whatever the seed, the process or the machine; the seed only orders (and,
  for generated task sets, selects) the tasks.
- ``check(task, messages)``: the success measures of the conversation's FIRST assistant reply
  (``{name: bool | float in [0, 1]}``), the simulated user's own check.
- ``feedback(task, reply)``: the simulated user's next message and whether the task is solved;
  it is derived from the same check (``solved`` is ``grade``'s ``"solved"``), so what the judge
  reads and what the evaluation measures cannot drift apart.

The simulated user (:mod:`clawray.envs.sim_user`) draws its tasks with :meth:`Environment.sample`
from the train split only; ``clawray eval`` and the main job's evaluation read the eval split.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any

SPLITS = ("train", "eval")
_SALT = b"clawray-split-v1\0"


#: a number as a reply writes it: a sign, digits, and a decimal part read whole ("2.5" is 2.5, not 2 and 5)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
#: a reply that is one number and nothing else ("7", " 7. ", "7.0")
NUMBER_ONLY = re.compile(r"\s*-?\d+(?:\.\d+)?\.?\s*")


def last_number(text: str) -> float | None:
    """The last number in ``text`` (:data:`NUMBER`), or None when it holds none."""
    found = NUMBER.findall(text)
    return float(found[-1]) if found else None


@dataclass(frozen=True)
class Problem:
    """One task: the question the user asks and its integer answer."""

    question: str
    answer: int


def split_of(question: str, eval_fraction: float) -> str:
    """``"eval"`` for a fixed ``eval_fraction`` of all question texts, else ``"train"``.

    The first 8 bytes of SHA-256(salt + question) as an integer in [0, 2**64) decide: eval when it
    is below ``eval_fraction * 2**64``. Deterministic across processes (no ``hash()`` seed).
    """
    digest = hashlib.sha256(_SALT + question.encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") < eval_fraction * 2**64 else "train"


def first_reply(messages: list[dict[str, Any]]) -> str:
    """The text of the first assistant message (``""`` when there is none or it has no content,
    e.g. a pure tool call)."""
    for m in messages:
        if m.get("role") == "assistant":
            return m.get("content") or ""
    return ""


class Environment:
    """Base class: a task generator, a split rule and the simulated user's check.

    Subclasses set ``name``, ``preference`` and ``tools`` and implement :meth:`draw`,
    :meth:`grade` and :meth:`feedback`; a finite task set also implements :meth:`all_tasks`.

    Attributes:
        eval_fraction: the share of question texts in the eval split (by :func:`split_of`).
        pool_size: for a generated (unbounded) task set, how many distinct tasks ``prompts`` returns.
    """

    name = "base"
    preference = ""
    tools: list[dict] | None = None
    eval_fraction = 0.2
    pool_size = 200

    def draw(self, rng: random.Random) -> Problem:
        """One task from the generator, ignoring the split."""
        raise NotImplementedError

    def all_tasks(self) -> list[Problem] | None:
        """Every task when the task set is finite and small, else None."""
        return None

    def grade(self, task: Problem, reply: str) -> dict[str, bool]:
        """The success measures of one reply; must contain ``"solved"``."""
        raise NotImplementedError

    def feedback(self, task: Problem, reply: str) -> tuple[str, bool]:
        """The simulated user's next message and ``grade(task, reply)["solved"]``."""
        raise NotImplementedError

    def preferred_reply(self, task: Problem) -> str | None:
        """One reply the simulated user accepts (``grade`` says solved): the reply a hint should make
        more likely, read by the OPD premise check (:mod:`clawray.premise`); None when the
        environment names none (then the check is not measured)."""
        return None

    # ---------------------------------------------------------------- shared logic
    def split(self, task: Problem) -> str:
        """``"train"`` or ``"eval"`` (see :func:`split_of`)."""
        return split_of(task.question, self.eval_fraction)

    def first_message(self, task: Problem) -> str:
        """The user's opening message: the question, then the stated preference."""
        return f"{task.question} {self.preference}".strip()

    def opening(self, task: Problem) -> list[dict[str, Any]]:
        """The opening conversation (OpenAI messages) the user sends for ``task``."""
        return [{"role": "user", "content": self.first_message(task)}]

    def sample(self, rng: random.Random, split: str = "train") -> Problem:
        """A task of ``split`` from the generator (rejection sampling: the generator's distribution
        conditioned on the split).

        Raises:
            ValueError: an unknown split.
            RuntimeError: no task of the split in 10,000 draws.
        """
        _check_split(split)
        for _ in range(10_000):
            task = self.draw(rng)
            if self.split(task) == split:
                return task
        raise RuntimeError(f"environment {self.name!r}: no {split} task in 10000 draws")

    def prompts(self, split: str, seed: int = 0) -> list[Problem]:
        """The distinct tasks of ``split``, ordered by ``seed``.

        A finite task set returns all its tasks of the split (shuffled by ``seed``); a generated one
        returns up to ``pool_size`` distinct tasks drawn with ``random.Random(seed)``.

        Raises:
            ValueError: an unknown split.
        """
        _check_split(split)
        rng = random.Random(seed)
        tasks = self.all_tasks()
        if tasks is not None:
            out = [t for t in tasks if self.split(t) == split]
            rng.shuffle(out)
            return out
        seen: dict[str, Problem] = {}
        for _ in range(50 * self.pool_size):
            if len(seen) >= self.pool_size:
                break
            task = self.draw(rng)
            if task.question not in seen and self.split(task) == split:
                seen[task.question] = task
        return list(seen.values())

    def check(self, task: Problem, messages: list[dict[str, Any]]) -> dict[str, bool]:
        """The success measures of the first assistant reply in ``messages`` (the simulated user's
        check, :meth:`grade`); a conversation without one (or a pure tool call) scores the empty
        reply."""
        return self.grade(task, first_reply(messages))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")

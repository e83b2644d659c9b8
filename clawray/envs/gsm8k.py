"""The seed's personalisation scenario on GSM8K-style problems: a ``student`` and a ``teacher``.

Owns: reading the items of ``env.data_path``, the two users' checks, phrase lists and feedback, and the
pupil's answers. Must not: import Ray, download anything, send requests, or decide the split
(:func:`clawray.envs.base.split_of`).

Both environments read a local JSON file (a list of objects) or JSONL file (one object a line)
named by ``env.data_path``; each item has ``question`` (text) and ``ground_truth_answer`` (an
integer, as a number or a string such as ``"1,200"``). Nothing is downloaded. The items are split
into train/eval by :func:`clawray.envs.base.split_of` on the question text (a fixed salt: the same
split on every machine and for both users), so the simulated user asks train items only.

- ``student``: a student asks the problem and wants the answer worked out in their own words, not
  sounding AI-written. Solved = the final number is right, the reply shows its work (at least one
  calculation ``a op b`` or ``=``), and it reads like a person: no markdown (headings, bold, lists,
  code) and none of the stock assistant phrases in :data:`AI_PHRASES`.
- ``teacher``: a teacher pastes a problem and a pupil's answer (right for about half the items,
  else off by a fixed amount, both chosen from the question's hash) and asks for feedback for the
  pupil. Solved = specific (names the correct answer, and, when the pupil was wrong, the pupil's
  number too) and friendly (an encouraging word from :data:`FRIENDLY`, no harsh word from
  :data:`HARSH`, no markdown).

The checks are plain regular expressions, deterministic and cheap, and the user's next message
(``feedback``) is derived from them, so what the ``feedback`` judge reads and what the evaluation
measures agree. They stand in for the seed's LLM-simulated users, whose scores (student 0.17 ->
0.76, teacher 0.22 -> 0.90 after 8 steps on a GPU) they are meant to mirror, not reproduce.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from typing import Any

from clawray.envs.base import Environment, Problem

STUDENT_PREFERENCE = (
    "I'm a student and this is my homework. Work it out the way I would write it myself, "
    "in plain sentences with the calculations, not like an AI assistant."
)
TEACHER_PREFERENCE = (
    "I'm a teacher. Write a short note to my pupil about their answer: say exactly what is "
    "right or wrong and what the correct answer is, and keep it kind and encouraging."
)

# stock phrases that make a reply sound AI-written (matched case-insensitively, as words)
AI_PHRASES = (
    "as an ai",
    "certainly",
    "i'd be happy",
    "i would be happy",
    "happy to help",
    "great question",
    "let's break",
    "let's dive",
    "delve",
    "step 1",
    "step-by-step",
    "step by step",
    "in conclusion",
    "to solve this problem",
    "here's",
    "here is the",
    "final answer",
    "sure!",
    "absolutely",
)
FRIENDLY = (
    "great",
    "good",
    "nice",
    "well done",
    "keep",
    "don't worry",
    "almost",
    "close",
    "proud",
    "effort",
    "try",
    "awesome",
    "excellent",
)
HARSH = ("stupid", "careless", "lazy", "bad", "terrible", "obviously", "should have known", "pathetic")

_MARKDOWN = re.compile(r"(\*\*|__|^#{1,6}\s|^\s*[-*+]\s|^\s*\d+[.)]\s|`|\\\(|\\\[|\\boxed)", re.MULTILINE)
_CALC = re.compile(r"\d\s*[-+*/x×÷]\s*\d|=")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _phrase_re(phrases: tuple[str, ...]) -> re.Pattern:
    return re.compile("|".join(rf"(?<!\w){re.escape(p)}(?!\w)" for p in phrases), re.IGNORECASE)


_AI = _phrase_re(AI_PHRASES)
_FRIENDLY = _phrase_re(FRIENDLY)
_HARSH = _phrase_re(HARSH)


def numbers_in(text: str) -> list[float]:
    """Every number in ``text`` in order (``1,200`` -> 1200.0, ``$3.50`` -> 3.5)."""
    out = []
    for tok in _NUMBER.findall(text):
        try:
            out.append(float(tok.replace(",", "")))
        except ValueError:
            continue
    return out


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg}, line {e.lineno} column {e.colno})") from None


def _parse_answer(value: Any, where: str) -> int:
    try:
        number = float(str(value).replace(",", "").replace("$", "").strip())
    except ValueError:
        raise ValueError(f"{where}: ground_truth_answer {value!r} is not a number") from None
    if not number.is_integer():
        raise ValueError(f"{where}: ground_truth_answer {value!r} is not an integer")
    return int(number)


def load_items(path: str) -> list[Problem]:
    """The problems of a GSM8K-style JSON (a list) or JSONL (an object a line) file, in file order.

    Raises:
        FileNotFoundError: no such file, with how to point ``env.data_path`` at a copy.
        ValueError: a file or line that is not JSON (named), an item without ``question`` /
            ``ground_truth_answer``, a non-integer answer, or
            an empty file.
    """
    if not path:
        raise FileNotFoundError(
            "the student/teacher environments need a GSM8K-style file (a JSON list or JSONL of "
            '{"question", "ground_truth_answer"}): env.data_path=/path/to/gsm8k_test.json for clawray run, '
            "--data-path /path/to/gsm8k_test.json for clawray eval"
        )
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"env.data_path={path} does not exist: point env.data_path at a local copy of a "
            'GSM8K-style file (a JSON list or JSONL of {"question", "ground_truth_answer"}), '
            "e.g. `clawray run ... env.data_path=/data/gsm8k_test.json` (clawray eval: --data-path)"
        )
    with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is no part of the JSON (RFC 8259 section 8.1)
        text = f.read()
    if text.lstrip().startswith("["):
        rows = _json(text, path)
    else:
        rows = [_json(ln, f"{path}:{i}") for i, ln in enumerate(text.splitlines(), start=1) if ln.strip()]
    items = []
    for i, row in enumerate(rows):
        where = f"{path} item {i}"
        if not isinstance(row, dict) or "question" not in row or "ground_truth_answer" not in row:
            raise ValueError(f"{where}: expected an object with 'question' and 'ground_truth_answer'")
        items.append(Problem(str(row["question"]).strip(), _parse_answer(row["ground_truth_answer"], where)))
    if not items:
        raise ValueError(f"{path} has no items")
    return items


class GSM8KEnv(Environment):
    """Base of ``student`` and ``teacher``: a finite task set read from ``data_path``.

    Args:
        data_path: the JSON/JSONL file (see :func:`load_items`).

    Raises:
        FileNotFoundError, ValueError: from :func:`load_items`.
    """

    name = "gsm8k"
    eval_fraction = 0.2

    def __init__(self, data_path: str):
        self.data_path = data_path
        seen: dict[str, Problem] = {}
        for item in load_items(data_path):
            seen.setdefault(item.question, item)  # duplicates would share a split anyway
        self.items = list(seen.values())

    def all_tasks(self) -> list[Problem]:
        """Every distinct question of the file."""
        return list(self.items)

    def draw(self, rng: random.Random) -> Problem:
        """A uniformly random item."""
        return rng.choice(self.items)

    def feedback(self, task: Problem, reply: str) -> tuple[str, bool]:
        """The user's next message from :meth:`grade` (see the subclasses) and whether it is solved."""
        g = self.grade(task, reply)
        return self.complaint(g), g["solved"]

    def complaint(self, g: dict[str, bool]) -> str:
        raise NotImplementedError


class StudentEnv(GSM8KEnv):
    """``student``: the answer worked out in the student's own words, not sounding AI-written.

    Measures: ``solved`` (correct and shows_work and natural), ``correct`` (the last number is the
    answer), ``shows_work`` (a calculation or ``=``), ``natural`` (no markdown, no :data:`AI_PHRASES`).
    """

    name = "student"
    preference = STUDENT_PREFERENCE

    def grade(self, task: Problem, reply: str) -> dict[str, bool]:
        """``{"solved", "correct", "shows_work", "natural"}``."""
        nums = numbers_in(reply)
        correct = bool(nums) and nums[-1] == task.answer
        shows_work = _CALC.search(reply) is not None
        natural = bool(reply.strip()) and not _MARKDOWN.search(reply) and not _AI.search(reply)
        return {
            "solved": correct and shows_work and natural,
            "correct": correct,
            "shows_work": shows_work,
            "natural": natural,
        }

    def complaint(self, g: dict[str, bool]) -> str:
        """Thanks when solved, else the first failed check in words (read by the feedback judge)."""
        if g["solved"]:
            return "Thanks, that makes sense and sounds like me. Great!"
        if not g["correct"]:
            return "That's wrong, the final number doesn't match the answer key. Please try again."
        if not g["natural"]:
            return (
                "The number is right, but that sounds like an AI wrote it (lists, bold or phrases like "
                "'Certainly' or 'step by step'). Please try again in plain sentences, the way a student writes."
            )
        return "The number is right, but I need to show the calculation. Please try again with the working shown."


def pupil_answer(task: Problem) -> int:
    """The pupil's (simulated) answer: the right one for about half the questions, else off by
    1..9 (both fixed by SHA-256 of the question text)."""
    h = hashlib.sha256(b"clawray-pupil\0" + task.question.encode()).digest()
    return task.answer if h[0] % 2 == 0 else task.answer + (1 + h[1] % 9) * (1 if h[2] % 2 else -1)


class TeacherEnv(GSM8KEnv):
    """``teacher``: specific, friendly feedback for a pupil's answer.

    Measures: ``solved`` (specific and friendly), ``specific`` (names the correct answer; when the
    pupil was wrong, also the pupil's number), ``friendly`` (a word of :data:`FRIENDLY`, none of
    :data:`HARSH`, no markdown).
    """

    name = "teacher"
    preference = TEACHER_PREFERENCE

    def first_message(self, task: Problem) -> str:
        """The problem, the pupil's answer, then the teacher's request."""
        return f"Problem: {task.question}\nMy pupil's answer: {pupil_answer(task)}\n{self.preference}"

    def grade(self, task: Problem, reply: str) -> dict[str, bool]:
        """``{"solved", "specific", "friendly"}``."""
        nums = set(numbers_in(reply))
        pupil = pupil_answer(task)
        specific = task.answer in nums and (pupil == task.answer or pupil in nums)
        friendly = _FRIENDLY.search(reply) is not None and _HARSH.search(reply) is None and not _MARKDOWN.search(reply)
        return {"solved": specific and friendly, "specific": specific, "friendly": friendly}

    def complaint(self, g: dict[str, bool]) -> str:
        """Thanks when solved, else what the note lacked (read by the feedback judge)."""
        if g["solved"]:
            return "Thanks, that is specific and kind, exactly what I wanted. Great!"
        if not g["specific"]:
            return (
                "That's not specific enough: the note must name my pupil's number and the correct answer. "
                "Please try again."
            )
        return "That's too cold (or formatted): please try again, warm and encouraging, plain text."

"""Arithmetic word problems generated from a seed (the demo's task set; no data set is downloaded)."""

from __future__ import annotations

import random
from dataclasses import dataclass

_NAMES = ["Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Iris", "Tom", "Lena", "Ravi", "Sara", "Ken"]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "shells", "cards", "stamps"]


@dataclass(frozen=True)
class Problem:
    """One word problem with its integer answer."""

    question: str
    answer: int


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

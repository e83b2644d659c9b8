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


def make_problem(rng: random.Random) -> Problem:
    """A two- or three-step problem over small integers (answers in 0..400)."""
    a, b = rng.sample(_NAMES, 2)
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


def make_problems(n: int, seed: int = 0) -> list[Problem]:
    """``n`` problems, the same list for the same seed."""
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]

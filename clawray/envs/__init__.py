"""Environments (task sets with disjoint train/eval splits and a simulated user's check) and the
simulated users that drive the policy endpoint like a real agent client would."""

from __future__ import annotations

from clawray.envs.base import SPLITS, Environment, Problem, split_of

ENVIRONMENTS = ("arith", "sums")


def make_env(name: str, level: int = 3) -> Environment:
    """The environment called ``name`` (``level``: the ``arith`` difficulty, ignored by ``sums``).

    Raises:
        ValueError: an unknown name or level.
    """
    if name == "arith":
        from clawray.envs.arith import ArithEnv

        return ArithEnv(level)
    if name == "sums":
        from clawray.envs.sums import SumsEnv

        return SumsEnv()
    raise ValueError(f"unknown environment {name!r}; expected one of {list(ENVIRONMENTS)}")


__all__ = ["ENVIRONMENTS", "SPLITS", "Environment", "Problem", "make_env", "split_of"]

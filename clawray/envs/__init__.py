"""Environments (task sets with disjoint train/eval splits and a simulated user's check) and the
simulated users that drive the policy endpoint like a real agent client would.

Owns: the environment names (:data:`ENVIRONMENTS`, :func:`make_env`). Must not: import Ray or the
simulated user (:mod:`clawray.envs.sim_user`, a Ray actor, is imported by :mod:`clawray.traffic`).
"""

from __future__ import annotations

from typing import Any

from clawray.envs.base import SPLITS, Environment, Problem, split_of

ENVIRONMENTS = ("arith", "sums", "brief", "terse", "concise", "plain", "student", "teacher")


def make_env(name: str, level: int = 3, data_path: str = "") -> Environment:
    """The environment called ``name`` (``level``: the ``arith`` difficulty; ``data_path``: the
    GSM8K-style file of ``student`` and ``teacher``; each ignored by the others).

    Raises:
        ValueError: an unknown name or level, or a malformed data file.
        FileNotFoundError: ``student``/``teacher`` without a readable ``data_path`` (the message says
            how to set ``env.data_path``).
    """
    if name == "arith":
        from clawray.envs.arith import ArithEnv

        return ArithEnv(level)
    if name == "sums":
        from clawray.envs.sums import SumsEnv

        return SumsEnv()
    if name == "brief":
        from clawray.envs.brief import BriefEnv

        return BriefEnv()
    if name == "terse":
        from clawray.envs.terse import TerseEnv

        return TerseEnv()
    if name == "concise":
        from clawray.envs.concise import ConciseEnv

        return ConciseEnv()
    if name == "plain":
        from clawray.envs.plain import PlainEnv

        return PlainEnv()
    if name in ("student", "teacher"):
        from clawray.envs.gsm8k import StudentEnv, TeacherEnv

        return (StudentEnv if name == "student" else TeacherEnv)(data_path)
    raise ValueError(f"unknown environment {name!r}; expected one of {list(ENVIRONMENTS)}")


__all__ = ["ENVIRONMENTS", "env_from_config", "SPLITS", "Environment", "Problem", "make_env", "split_of"]


def env_from_config(env_cfg: Any) -> Environment:
    """:func:`make_env` from the ``env`` config section: an :class:`~clawray.config.EnvConfig`, an
    omegaconf node or a mapping of some of its keys (converted by :func:`~clawray.config.section`, the
    defaults are the schema's).

    Raises:
        ConfigError: a key :class:`~clawray.config.EnvConfig` lacks or a value of the wrong type.
    """
    from clawray.config import EnvConfig, section

    env = section(EnvConfig, env_cfg)
    return make_env(env.name, env.level, env.data_path)

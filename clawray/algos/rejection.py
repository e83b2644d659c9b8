"""Groups and rejection sampling, to keep the advantage's variance (pure functions, no Ray).

Owns: each sample's group (``trainer.group_by``) and which rewarded samples sit in a zero-variance group.
Must not: take from the queue or wait (:mod:`clawray.batching` rejects and refills).

``trainer.group_by`` says which samples of a batch form one group (for ``trainer.advantage: grpo``
and for dynamic sampling):

* ``prompt``: the same prompt token ids (a request answered with n choices, or the simulated user's
  resample mode, ``env.resample_n``);
* ``session_prefix``: the same session opening (the messages up to the first user message) and
  the same turn index: turn k of sessions that began alike, whatever was said in between;
* ``none``: the whole batch is one group (GRPO then normalises over the batch).

Dynamic sampling (DAPO, Yu et al. 2025, arXiv 2503.14476, §3.2): a group whose rewards are all
equal has zero advantage under GRPO and carries no preference; it is rejected
(``dropped/zero_variance``) and the batch keeps filling from the queue, for at most
``trainer.dynamic_sampling_wait_s`` seconds. Samples without a reward (pure OPD) are never rejected.
A group of one has zero variance, so live traffic without repeated prompts rejects everything: use
it with groups (resample mode, ``n`` > 1 requests, or ``group_by: none``).
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

GROUP_BY = ("prompt", "session_prefix", "none")


def opening(messages: Sequence[dict]) -> list[dict]:
    """A session's opening: its messages up to and including the first user message (all of them
    when there is none)."""
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            return list(messages[: i + 1])
    return list(messages)


def group_keys(
    mode: str, prompts: Sequence[Sequence[int] | Hashable], openings: Sequence[Hashable], turn_indexes: Sequence[int]
) -> list[Hashable]:
    """The group of each sample (see the module docstring).

    Args:
        mode: ``"prompt"``, ``"session_prefix"`` or ``"none"``.
        prompts: ``[B]`` prompt token ids (or a hashable key of each prompt); openings: ``[B]`` a key of each session's opening;
        turn_indexes: ``[B]`` each sample's turn index in its session.

    Raises:
        ValueError: an unknown mode or lists of different lengths.
    """
    if mode not in GROUP_BY:
        raise ValueError(f"unknown group_by {mode!r}; expected one of {list(GROUP_BY)}")
    if not len(prompts) == len(openings) == len(turn_indexes):
        raise ValueError("prompts, openings and turn_indexes must have one entry per sample")
    if mode == "prompt":  # token lists, or already-hashable keys (SampleMeta.prompt_key)
        return [tuple(p) if isinstance(p, (list, tuple)) else p for p in prompts]
    if mode == "session_prefix":
        return [(o, t) for o, t in zip(openings, turn_indexes)]
    return [0] * len(prompts)


def zero_variance(keys: Sequence[Hashable], rewards: Sequence[float | None], min_std: float = 1e-6) -> list[int]:
    """Indexes of the rewarded samples whose group's rewards have a population std below ``min_std``
    (all equal; a group of one included); samples without a reward are never listed and do not count
    in their group.

    Example: keys [a, a, b, b, c], rewards [1, 1, 1, -1, 0.5] -> [0, 1, 4].
    """
    groups: dict[Hashable, list[int]] = {}
    for i, (k, r) in enumerate(zip(keys, rewards)):
        if r is not None:
            groups.setdefault(k, []).append(i)
    out = []
    for idx in groups.values():
        vals = [float(rewards[i]) for i in idx]
        mean = sum(vals) / len(vals)
        if math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)) < min_std:
            out += idx
    return sorted(out)

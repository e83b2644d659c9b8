"""The ``concise`` environment: a preference the user states vaguely and spells out when correcting.

Owns: the stated preference (the tasks, the check and the corrections are :mod:`clawray.envs.terse`'s).
Must not: import Ray, send requests, or decide the split (:mod:`clawray.envs.base`).

The user asks "What is x + y? Be brief." and wants the number alone; the correction says so ("please
redo it as just the number, no words, no equation"). Unlike ``terse`` (base rate 0: Binary RL has
nothing to reinforce) some replies already pass, so both Binary RL (from the accepted replies) and OPD
(from the corrections) can teach: the task on which Combine is compared with both (issue #28).
Measured on Qwen2.5-Coder-0.5B-Instruct (fp32, T = 0.7, 32 sums, one sample each): "Be brief."
3/32 replies are the number alone; "Keep it short." 23/32; "Reply with the number only." 28/32; no
stated preference 0/32.
"""

from __future__ import annotations

from clawray.envs.terse import TerseEnv

PREFERENCE = "Be brief."


class ConciseEnv(TerseEnv):
    """``concise``: :class:`~clawray.envs.terse.TerseEnv` with "Be brief." stated in the question;
    measures ``solved``, ``correct``, ``number_only``."""

    name = "concise"
    preference = PREFERENCE

"""The ``concise`` environment: a preference the user states vaguely and spells out when correcting.

Owns: the stated preference (the tasks, the check and the corrections are :mod:`clawray.envs.terse`'s).
Must not: import Ray, send requests, or decide the split (:mod:`clawray.envs.base`).

The user asks "What is x + y? Be brief." and wants the number alone; the correction says so ("please
redo it as just the number, no words, no equation"). Unlike ``terse``, the stated wish brings the bare
number within the policy's reach, so Binary RL (the corrected sentences' -1, the accepted bare numbers'
+1) and OPD (the corrections as hints) can both teach: the task on which Combine is compared with both
(issue #28). Measured by the job's evaluation (Qwen2.5-Coder-0.5B-Instruct, 64 held-out sums x 2,
T = 0.7): 0.0% solved before training, 10.9% of replies a bare number (each a wrong one), 82.0% correct;
Binary RL alone reaches 79.7% solved in 20 updates (README, "OPD's CPU task").
"""

from __future__ import annotations

from clawray.envs.terse import TerseEnv

PREFERENCE = "Be brief."


class ConciseEnv(TerseEnv):
    """``concise``: :class:`~clawray.envs.terse.TerseEnv` with "Be brief." stated in the question;
    measures ``solved``, ``correct``, ``number_only``."""

    name = "concise"
    preference = PREFERENCE

"""Round-robin dispatch of the SessionTracker's judgements to its judge and teacher actors.

Owns: the binding of :class:`~clawray.algos.algorithm.WorkerCalls` to actor handles and the round-robin
counter. Must not: import Ray, await a call, or decide a verdict (:mod:`clawray.algos.algorithm`).

The algorithm (:mod:`clawray.algos.algorithm`) sees the judge and the teacher as async callables
(:class:`~clawray.algos.algorithm.WorkerCalls`); this module binds them to JudgeWorker and TeacherWorker
actor handles (``judge.judge.remote``, ``teacher.teacher_logprobs.remote``, ...), so the tracker never
names an actor method. Invariant: judges are taken in turn, one per judgement, in the order the
judgements are launched; the teacher is picked when it is asked, by the same counter.
"""

from __future__ import annotations

from typing import Any

from clawray.algos.algorithm import WorkerCalls


class WorkerPool:
    """The tracker's judges and teachers.

    Args:
        judges: JudgeWorker actor handles (at least one).
        teachers: TeacherWorker actor handles (may be empty when the algorithm needs none).
    """

    def __init__(self, judges: list, teachers: list | None = None):
        self.judges, self.teachers = judges, teachers or []
        self._rr = 0

    def next_judge(self) -> Any:
        """The judge of the next judgement (round-robin)."""
        judge = self.judges[self._rr % len(self.judges)]
        self._rr += 1
        return judge

    def calls(self, judge: Any) -> WorkerCalls:
        """``judge``'s calls and the teachers' (round-robin, picked when the teacher is asked)."""
        return WorkerCalls(
            judge=getattr(getattr(judge, "judge", None), "remote", None),
            hint=getattr(getattr(judge, "hint", None), "remote", None),
            teacher_logprobs=lambda turn, hint: self._teacher().teacher_logprobs.remote(turn, hint),
            teacher_topk=lambda turn, hint, k: self._teacher().teacher_topk.remote(turn, hint, k),
        )

    def _teacher(self) -> Any:
        return self.teachers[self._rr % len(self.teachers)]

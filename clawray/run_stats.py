"""Reading the counters of a run's actors for the metrics row, ``/health`` reasons and the summary.

Owns: how long the loop waits for a component's counters (:data:`STATS_TIMEOUT_S`) and what it uses
when one does not answer (its last answer, counted), and totals across actor restarts. Must not:
decide anything (the row itself is :func:`clawray.step_metrics.step_row`, a pure function).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import ray

from clawray.recovery import ENGINE_COUNTERS, RestartCounters
from clawray.run_actors import RunActors
from clawray.step_metrics import GenerationMeter, drop_counts, judge_metrics, step_row, traffic

#: Seconds the loop waits for a component's counters (metrics, summary) before it uses the last ones.
STATS_TIMEOUT_S = 10.0


class RunStats:
    """The counters of ``actors``, read with a deadline.

    Attributes:
        timeouts: ``{component: reads}`` that missed :data:`STATS_TIMEOUT_S`.
        restarts: engine, judge and teacher counters re-based across their restarts.
        generation: rollout tokens and throughput between two steps.
    """

    def __init__(self, actors: RunActors):
        self.actors = actors
        self.timeouts: dict[str, int] = {}
        self._last: dict[str, Any] = {}  # the last answer of each component's counters
        self.restarts = RestartCounters()
        self.generation = GenerationMeter()

    def read(self, name: str, refs: Any, default: Any) -> Any:
        """``ray.get(refs)`` of a component's counters within :data:`STATS_TIMEOUT_S`; past it, the
        last answer under ``name`` (or ``default``) and a count in :attr:`timeouts`: metrics and
        shutdown never wait behind a component's work (a judge busy with thousands of slow calls
        held the whole loop before its counters moved to a control concurrency group)."""
        try:
            value = ray.get(refs, timeout=STATS_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.timeouts[name] = self.timeouts.get(name, 0) + 1
            print(
                f"[clawray] {name} counters did not answer within {STATS_TIMEOUT_S:.0f}s: the last ones are used",
                flush=True,
            )
            return self._last.get(name, default)
        self._last[name] = value
        return value

    def lagging(self) -> list[str]:
        """``"judge-0 failing: <reason>"`` for each judge or teacher whose model is slow or failing
        (:meth:`clawray.actors.judge.JudgeWorker.health`), in role order; a worker that does not
        answer within :data:`STATS_TIMEOUT_S` (restarting) is left out: the actor checks cover it."""
        named = [(f"judge-{i}", j) for i, j in enumerate(self.actors.judges)]
        named += [(f"teacher-{i}", t) for i, t in enumerate(self.actors.teachers)]
        refs = [actor.health.remote() for _, actor in named]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=STATS_TIMEOUT_S) if refs else ([], [])
        out = []
        for (name, _), ref in zip(named, refs):
            if ref not in ready:
                continue
            try:
                report = ray.get(ref)
            except ray.exceptions.RayError:
                continue
            if report.get("state", "ok") != "ok":
                out.append(f"{name} {report['state']}: {report['reason']}")
        return out

    def tracker(self) -> dict:
        """The session tracker's counters (``{}`` until it first answers)."""
        return self.read("sessions", self.actors.tracker.stats.remote(), {})

    def judge_metrics(self, tracker_stats: dict) -> dict[str, float]:
        """:func:`~clawray.step_metrics.judge_metrics` over the run's judge and teacher workers
        (totals across their restarts)."""
        judges, teachers, rebase = self.actors.judges, self.actors.teachers, self.restarts.rebase
        teacher_stats = None
        if teachers:  # {} for a teacher that never answered yet (killed before its first read)
            raw = self.read("teachers", [t.get_stats.remote() for t in teachers], [{}] * len(teachers))
            teacher_stats = [rebase(f"teacher-{i}", st, st) for i, st in enumerate(raw)]
        judge_stats = self.read("judges", [j.get_stats.remote() for j in judges], [{}] * len(judges))
        return judge_metrics(
            [rebase(f"judge-{i}", st, st) for i, st in enumerate(judge_stats)], teacher_stats, tracker_stats
        )

    def generation_metrics(self) -> dict[str, float]:
        """The engines' generation figures since the last call (:class:`~clawray.step_metrics.GenerationMeter`);
        ``{}`` when an engine does not answer within 10 s."""
        try:
            stats = ray.get([e.stats.remote() for e in self.actors.engines], timeout=10)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
            return {}
        # a restarted engine counts from 0 again: totals across its restarts
        return self.generation.update([self.restarts.rebase(st["name"], st, ENGINE_COUNTERS) for st in stats])

    def serve(self) -> tuple[dict[str, float], Counter]:
        """``({"serve/replica_requests/<i>": requests}, summed request counts by kind)`` over the
        replicas (:func:`serve_stats`); both empty when Serve does not answer."""
        replicas = serve_stats()
        counts: Counter[str] = Counter()
        for st in replicas:
            counts.update(st.get("counts") or {})
        return {f"serve/replica_requests/{i}": float(st["requests"]) for i, st in enumerate(replicas)}, counts

    def step_row(
        self,
        state: Any,
        batch: dict,
        metas: list,
        adv: Any,
        skipped: str,
        train: dict,
        timing: dict[str, float],
        entropy_coef: float,
        dynamic_sampling: bool,
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """The step's metrics row (:func:`~clawray.step_metrics.step_row`, whose arguments these are)
        with the actors' counters, and the cumulative drop counts by reason
        (:func:`~clawray.step_metrics.drop_counts`; ``dropped/zero_variance`` with ``dynamic_sampling``)."""
        qstats = ray.get(self.actors.queue.stats.remote())
        tstats = self.tracker()
        zero_variance = state.zero_variance_dropped if dynamic_sampling else None
        dropped = drop_counts(tstats, qstats, state.all_masked_dropped, zero_variance)
        serve_metrics, serve_counts = self.serve()
        gathered = {
            **self.judge_metrics(tstats),
            **{f"stats_timeouts/{k}": float(v) for k, v in self.timeouts.items()},
            **self.generation_metrics(),
            **serve_metrics,
            **(traffic(serve_counts, tstats) if serve_metrics else {}),
            **timing,
        }
        row = step_row(state, batch, metas, adv, skipped, train, qstats, tstats, dropped, gathered, entropy_coef)
        return row, dropped

    def summary(self) -> dict[str, Any]:
        """Every component's counters for ``summary.json``, each read bounded (:meth:`read`): a
        summary at Ctrl-C never waits behind a wedged component."""
        a = self.actors
        return {
            "engine_versions": self.read(
                "engine_versions", [e.get_version.remote() for e in a.engines], [None] * len(a.engines)
            ),
            "engines": self.read("engines", [e.stats.remote() for e in a.engines], [{}] * len(a.engines)),
            "queue": self.read("queue", a.queue.stats.remote(), {}),
            "sessions": self.tracker(),
            "judges": self.read("judges", [j.get_stats.remote() for j in a.judges], [{}] * len(a.judges)),
            "stats_timeouts": dict(self.timeouts),
        }


def serve_stats(session_ids: bool = False) -> list[dict]:
    """Every PolicyServer replica's :meth:`~clawray.serve.app.PolicyServer.stats` (one call per
    replica, ``DeploymentHandle.broadcast``), sorted by replica id: entry ``i`` is the ``i`` of the
    metric ``serve/replica_requests/<i>`` (chat requests that replica received since it started).
    ``[]`` when Serve does not answer within 10 s."""
    from ray import serve

    try:
        handle = serve.get_app_handle("clawray")
        stats = handle.broadcast("stats", session_ids).results(timeout_s=10)
    except Exception:  # noqa: BLE001 - metrics without the serve part, never a failed step
        return []
    return sorted(stats, key=lambda st: st["replica"])

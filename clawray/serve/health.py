"""``GET /health``: the state of every actor of the run, open sessions and the traffic funnel, read
without calling a busy actor (Ray's actor table) and never showing conversation content, actor ids
or pids.

Owns: what counts as degraded. Must not: route or record.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from clawray.recovery import actor_state, probe
from clawray.step_metrics import traffic


async def health_body(engines: list, tracker: Any, actors: dict, counts: Counter) -> tuple[dict, bool]:
    """``(body, degraded)`` of ``/health``.

    ``engines``: per engine its name, policy version and state (``serving``, ``syncing``: loading new
    weights, ``awaiting_sync``: restarted, waiting for the current policy, ``down``: dead or
    restarting); ``judges``, ``teachers``, ``learners``: per actor ``{"name", "state"}``; ``queue``,
    ``tracker``: a state; ``traffic``: :func:`traffic_funnel`. Actor states
    (:func:`clawray.recovery.actor_state`): ``ok``, ``restarting``, ``starting``, ``dead``; a live
    judge or teacher whose model lags is ``slow``, one whose calls fail is ``failing``, each with a
    ``reason`` (:class:`clawray.actors.call_health.CallHealth`). Degraded while any of them is not
    serving/ok, or while the disk refuses the tracker's writes (``failing``: which files, and why).

    Args:
        engines: the rollout engines' handles.
        tracker: the session tracker's handle.
        actors: ``{"judges": [...], "teachers": [...], "learners": [...], "queue": handle}``.
        counts: the replica's counters.
    """
    engine_states = await _engines(engines)
    stats = await probe(tracker.stats.remote())
    kinds = {}
    for kind, prefix in (("judges", "judge"), ("teachers", "teacher"), ("learners", "learner rank")):
        kinds[kind] = [
            {"name": f"{prefix}-{i}" if kind != "learners" else f"{prefix} {i}", "state": actor_state(a)}
            for i, a in enumerate(actors.get(kind) or [])
        ]
    # a live judge or teacher whose model lags or fails is "slow"/"failing", with the reason
    live = [
        (entry, actor)
        for kind in ("judges", "teachers")
        for entry, actor in zip(kinds[kind], actors.get(kind) or [])
        if entry["state"] == "ok"
    ]
    for (entry, _), report in zip(live, await asyncio.gather(*(probe(a.health.remote()) for _, a in live))):
        if report and report.get("state", "ok") != "ok":
            entry.update(state=report["state"], reason=report["reason"])
    queue = actor_state(actors["queue"]) if actors.get("queue") is not None else None
    failing = list((stats or {}).get("storage_failing") or [])  # e.g. "turns.jsonl: No space left on device"
    degraded = (
        stats is None
        or bool(failing)
        or queue not in (None, "ok")
        or any(e["state"] in ("down", "awaiting_sync") for e in engine_states)
        or any(a["state"] != "ok" for v in kinds.values() for a in v)
    )
    body = {
        "status": "degraded" if degraded else "ok",
        "policy_versions": [e["policy_version"] for e in engine_states],
        "engines": engine_states,
        "tracker": "down" if stats is None else "ok",
        **kinds,
        "open_sessions": (stats or {}).get("open_sessions", 0),
        "traffic": traffic_funnel(counts, stats or {}),
        "counts": dict(counts),
    }
    if failing:
        body["failing"] = failing
    if queue is not None:
        body["queue"] = queue
    return body, degraded


async def serving_versions(engines: list) -> list[int]:
    """The policy versions the engines serve users now (engines held for a sync or a probe, and down
    ones, left out), most engines first, ties by the lower version: ``/v1/models``' ``policy_version``
    is the first (with the promotion gate, the promoted version, never a candidate under probe)."""
    counts = Counter(e["policy_version"] for e in await _engines(engines) if e["state"] == "serving")
    return sorted(counts, key=lambda v: (-counts[v], v))


async def _engines(engines: list) -> list[dict]:
    """Each engine's entry of ``/health`` (a dead or silent one is ``down``)."""
    stats = await asyncio.gather(*(probe(e.stats.remote()) for e in engines))
    paused = await asyncio.gather(*(probe(e.is_paused.remote()) for e in engines))
    out = []
    for i, (st, p) in enumerate(zip(stats, paused)):
        if st is None or p is None:
            out.append({"name": f"rollout-{i}", "policy_version": None, "state": "down"})
            continue
        state = "awaiting_sync" if st.get("awaiting_sync") else "syncing" if p else "serving"
        out.append(
            {
                "name": st["name"],
                "policy_version": st["version"],
                "state": state,
                "requests": st["requests"],
                "cancelled": st.get("cancelled", 0),
                "errors": st.get("errors", 0),
            }
        )
    return out


def traffic_funnel(counts: Counter, tracker: dict) -> dict:
    """``/health``'s ``traffic``: where this replica's requests went and what became of the turns
    (:func:`clawray.step_metrics.traffic`, without the prefix) and ``dropped``: turns not trained so
    far, by reason (the tracker's ``dropped/*``; the queue's ``stale`` are in the step line)."""
    funnel = {k.removeprefix("traffic/"): v for k, v in traffic(counts, tracker).items()}
    funnel["dropped"] = {k.removeprefix("dropped/"): v for k, v in tracker.items() if k.startswith("dropped/") and v}
    return funnel

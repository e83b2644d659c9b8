"""One training step's metrics row and its printed line (pure functions of what the driver gathered).

Owns: the row's keys and the step line, how counters become figures (cumulative counters stay
cumulative; a rate whose denominator is zero is left out or NaN, never a division by zero), the
generation meter and the phase timeline. Must not: read an actor (:mod:`clawray.run_stats` gathers the
counters, with a deadline) or write the row (:mod:`clawray.metrics_log`).

The counters are those of the actors (queue, session tracker, judges, teachers, rollout engines) and
of the step; the row goes to ``metrics.jsonl`` / wandb, the ``[clawray] step ...`` line to the
terminal (see README).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from typing import Any, Iterator


def judge_metrics(judge_stats: list[dict], teacher_stats: list[dict] | None, tracker_stats: dict) -> dict[str, float]:
    """Cumulative judge and teacher figures from the workers' counters (summed over the J judges).

    - ``judge/votes_per_turn`` = votes / turns; ``judge/invalid_vote_rate`` = invalid votes / votes;
      ``judge/agreement_rate`` = votes equal to their turn's majority / valid votes (NaN without valid
      votes).
    - ``judge/hint_acceptance_rate`` = accepted hints / hint turns; ``judge/hint_invalid_vote_rate``;
      ``judge/mean_hint_chars`` = characters of accepted hints / accepted hints.
    - ``timing/teacher_scoring_s`` (seconds, summed over teachers), ``teacher/scored`` (turns) and
      ``teacher/errors`` (failed teacher calls, from the SessionTracker), when there are teachers.
    - ``judge/dispatch/<case>``: the SessionTracker's Combine dispatch counts.
    - ``judge/session_invalid_vote_rate`` = invalid votes / votes of the whole-session outcome judge
      (``trainer.outcome_judge``); ``credit/outcome_judged``, ``credit/outcome_unscored`` and
      ``credit/outcome_judge_errors``: the SessionTracker's counts of sessions it scored, that got no
      valid vote, and whose judge call failed.

    A figure whose denominator is zero is left out (never divided by zero).
    """
    total: dict[str, float] = {}
    for stats in judge_stats:
        for k, v in stats.items():
            total[k] = total.get(k, 0) + v
    out = {}
    if total.get("turns"):
        out["judge/votes_per_turn"] = total["votes"] / total["turns"]
        out["judge/invalid_vote_rate"] = total.get("invalid_votes", 0) / max(total["votes"], 1)
        valid = total["votes"] - total.get("invalid_votes", 0)
        out["judge/agreement_rate"] = total.get("agree_votes", 0) / valid if valid else math.nan
    if total.get("hint_turns"):
        out["judge/hint_acceptance_rate"] = total.get("hints_accepted", 0) / total["hint_turns"]
        out["judge/hint_invalid_vote_rate"] = total.get("hint_invalid_votes", 0) / max(total["hint_votes"], 1)
        if total.get("hints_accepted"):
            out["judge/mean_hint_chars"] = total["hint_chars"] / total["hints_accepted"]
    if total.get("session_votes"):
        out["judge/session_invalid_vote_rate"] = total.get("session_invalid_votes", 0) / total["session_votes"]
    for key in ("credit/outcome_judged", "credit/outcome_unscored", "credit/outcome_judge_errors"):
        if key in tracker_stats:
            out[key] = tracker_stats[key]
    if teacher_stats is not None:
        # a teacher whose counters never answered yet (killed, restarting) is {}: it adds nothing
        out["timing/teacher_scoring_s"] = sum(t.get("seconds", 0.0) for t in teacher_stats)
        out["teacher/scored"] = sum(t.get("scored", 0) for t in teacher_stats)
        out["teacher/errors"] = tracker_stats.get("teacher_errors", 0)
        out["teacher/hint_mixtures"] = tracker_stats.get("hint_mixtures", 0)  # turns mixing several hints
    out.update({f"judge/{k}": v for k, v in tracker_stats.items() if k.startswith("dispatch/")})
    return out


def credit_metrics(metas: list, tracker_stats: dict) -> dict[str, float]:
    """Long-horizon credit and shaping figures of one step (see :mod:`clawray.algos.credit`).

    - ``credit/turns_waiting``: judged turns waiting in the tracker for their session's end (now);
    - ``credit/mean_session_turns``: main-line requests per closed session (since the start);
    - ``reward/outcome_mean``: mean session outcome over the batch's samples that carry one (NaN when
      none does);
    - ``reward/shaping/<term>``: mean signed shaping contribution over the batch's samples that carry
      a reward (0 for a sample the term left alone; absent when no sample has shaping terms).
    """
    out: dict[str, float] = {"credit/turns_waiting": float(tracker_stats.get("credit/turns_waiting", 0))}
    if "credit/mean_session_turns" in tracker_stats:
        out["credit/mean_session_turns"] = float(tracker_stats["credit/mean_session_turns"])
    outcomes = [m.outcome for m in metas if m.outcome is not None]
    out["reward/outcome_mean"] = sum(outcomes) / len(outcomes) if outcomes else math.nan
    rewarded = [m for m in metas if m.reward is not None]
    names = sorted({n for m in rewarded for n, _ in m.shaping})
    for name in names:
        out[f"reward/shaping/{name}"] = sum(dict(m.shaping).get(name, 0.0) for m in rewarded) / len(rewarded)
    return out


def traffic(serve_counts: dict, tracker_stats: dict) -> dict[str, int]:
    """Where the served requests went, since the start (the README's "traffic" funnel):

    - ``traffic/requests``: chat requests received (every replica);
    - ``traffic/main``: main-line turns recorded in a session (n choices count n);
    - ``traffic/side``: side turns served and never trained (``X-Turn-Type: side``, or a client's
      housekeeping, ``traffic/side/<kind>``: OpenClaw's ``memory_flush``, ``compaction_summary``, ``heartbeat``);
    - ``traffic/unattributable``: main-line requests served but in no session (no session id, no
      session hint, a history that continues no pending turn);
    - ``traffic/paired``: turns given their next state (``traffic/paired_after_rewrite``: found by their
      reply after the client rewrote the history, a compaction); ``traffic/judged``: turns judged;
      ``traffic/samples``: samples sent to the learners' queue.

    Requests refused with a 4xx are in ``requests`` only. Args: ``serve_counts``: the replicas'
    ``counts`` summed; ``tracker_stats``: the SessionTracker's :meth:`stats`.
    """
    out = {
        "traffic/requests": serve_counts.get("requests", 0),
        "traffic/main": serve_counts.get("main_turns", 0),
        "traffic/side": serve_counts.get("side_turns", 0),
        "traffic/unattributable": serve_counts.get("unattributable", 0),
        "traffic/paired": tracker_stats.get("paired", 0),
        "traffic/paired_after_rewrite": tracker_stats.get("paired_after_rewrite", 0),
        "traffic/judged": tracker_stats.get("judged", 0),
        "traffic/samples": tracker_stats.get("samples", 0),
    }
    for key, value in serve_counts.items():
        if key.startswith("side_turns/"):
            out[f"traffic/side/{key.removeprefix('side_turns/')}"] = value
    return out


def drop_counts(tracker_stats: dict, queue_stats: dict, all_masked: int, zero_variance: int | None) -> dict[str, int]:
    """Turns that never became trained samples since the start, by reason: the tracker's
    ``dropped/*`` counters, the queue's (``stale``, ...), ``dropped/all_masked`` and, with dynamic
    sampling (``zero_variance`` not None), ``dropped/zero_variance``."""
    dropped = {k: v for k, v in tracker_stats.items() if k.startswith("dropped/")}
    dropped.update({f"dropped/{k}": v for k, v in queue_stats["dropped"].items()})
    dropped["dropped/all_masked"] = all_masked
    if zero_variance is not None:
        dropped["dropped/zero_variance"] = zero_variance
    return dropped


def step_row(
    state: Any,
    batch: dict,
    metas: list,
    adv: Any,
    skipped: str,
    train: dict,
    queue_stats: dict,
    tracker_stats: dict,
    dropped: dict[str, int],
    gathered: dict[str, float],
    entropy_coef: float,
) -> dict[str, Any]:
    """The step's metrics row (see README) from values the loop gathered.

    Args:
        state: the loop's state after the step (:class:`clawray.resume.LoopState`).
        batch: the batch taken (its ``staleness`` per sample, the all-masked ones included).
        metas: the kept samples' :class:`~clawray.types.SampleMeta`.
        adv: the batch's :class:`~clawray.algos.advantages.BatchAdvantages`.
        skipped: ``""`` or why the batch was not trained.
        train: the learners' metrics (``{}`` when skipped before training).
        queue_stats, tracker_stats: the queue's and the session tracker's counters.
        dropped: :func:`drop_counts`.
        gathered: the judge, generation, serve, traffic and timing figures, added as they are.
        entropy_coef: the entropy-bonus coefficient of the next update.

    ``inv/effective_sample_rate`` = samples trained / samples whose fate the queue decided (taken by
    the learner or dropped as stale); queued ones are not counted yet, all-masked samples and
    skipped steps count as taken, not trained. ``reward_mean`` is NaN when no sample carries a reward
    (pure OPD), never a 0.
    """
    decided = queue_stats["taken"] + queue_stats["dropped"].get("stale", 0)
    rewarded = adv.rewarded
    return {
        "policy_version": state.version,
        "samples": len(metas),
        "reward_mean": sum(float(metas[i].reward) for i in rewarded) / len(rewarded) if rewarded else math.nan,
        "skipped": skipped or "no",
        **{k: v for k, v in train.items() if k not in ("skipped", "train_s")},
        "inv/nonzero_reward_frac": adv.signal["nonzero_reward_frac"],
        "inv/reward_std": adv.signal["reward_std"],
        "inv/degenerate_batches": state.guard.degenerate_batches,
        "inv/baseline": state.guard.baseline,
        "inv/entropy_coef": entropy_coef,
        "inv/staleness_mean": sum(batch["staleness"]) / len(batch["staleness"]),
        "inv/staleness_max": max(batch["staleness"]),
        "inv/effective_sample_rate": state.samples_trained / decided if decided else math.nan,
        **{f"inv/dropped_samples/{k.removeprefix('dropped/')}": v for k, v in dropped.items()},
        **credit_metrics(metas, tracker_stats),
        "sessions/open": tracker_stats.get("open_sessions", 0),
        "sessions/idle_closed": tracker_stats.get("sessions_idle_closed", 0),
        "samples_in": queue_stats["put"],
        "samples_taken": queue_stats["taken"],
        "samples_trained": state.samples_trained,
        "samples_dropped": sum(dropped.values()),
        **gathered,
    }


class GenerationMeter:
    """Rollout tokens and throughput between two steps, from the engines' cumulative counters."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float]] = {}  # engine -> (tokens, gen seconds) at the last step

    def update(self, stats: list[dict]) -> dict[str, float]:
        """``rollout/tokens``: tokens the engines generated since the last call (all engines);
        ``rollout/tokens_per_s``: per engine, those tokens / its generation seconds, summed over the
        engines (throughput while generating, not wall time); ``serve/cancelled`` and
        ``rollout/engine_errors``: since the start (all engines).

        Args:
            stats: each engine's ``stats()`` (``name``, cumulative ``tokens`` and ``gen_seconds``,
                ``cancelled``, ``errors``), re-based across its restarts.
        """
        tokens, rate = 0, 0.0
        for st in stats:
            seen_tokens, seen_s = self._seen.get(st["name"], (0, 0.0))
            d_tokens, d_s = st["tokens"] - seen_tokens, st["gen_seconds"] - seen_s
            self._seen[st["name"]] = (st["tokens"], st["gen_seconds"])
            tokens += d_tokens
            rate += d_tokens / d_s if d_s > 0 else 0.0
        return {
            "rollout/tokens": float(tokens),
            "rollout/tokens_per_s": rate,
            "serve/cancelled": float(sum(st.get("cancelled", 0) for st in stats)),
            "rollout/engine_errors": float(sum(st.get("errors", 0) for st in stats)),
        }


def _traffic_part(metrics: dict[str, Any]) -> str:
    if "traffic/main" not in metrics:
        return ""
    side, unattributable = metrics["traffic/side"], metrics["traffic/unattributable"]
    return (
        f"turns {metrics['traffic/main']} (side {side}, unattributable {unattributable}) "
        f"paired {metrics['traffic/paired']} judged {metrics['traffic/judged']} | "
    )


def _serving_part(metrics: dict[str, Any]) -> str:
    """`` (serving v3, candidate v4 rejected)`` with the promotion gate (``deploy/*`` in the row), else ``""``."""
    if "deploy/serving_version" not in metrics:
        return ""
    decided = {1.0: "promoted", 0.0: "rejected"}.get(metrics.get("deploy/promoted", -1.0))
    candidate = f", candidate {decided}" if decided else ""
    return f" (serving v{int(metrics['deploy/serving_version'])}{candidate})"


def step_line(
    step: int,
    num_steps: int,
    metrics: dict[str, Any],
    dropped: dict[str, int],
    train: dict,
    rewarded: bool,
    skipped: str,
    sync_s: float,
    sync_error: str | None,
    t_wait: float,
    t_train: float,
) -> str:
    """The step's printed line (README): samples, reward, loss, sync and pause seconds, policy
    version (with the promotion gate: the serving version and the candidate's decision), staleness, trained share of judged turns, the traffic funnel so far (:func:`traffic`:
    main turns, side and unattributable requests, paired, judged; when the row has it), drops so far
    by reason, wait and train seconds.

    Args:
        step: steps done; num_steps: ``trainer.num_steps`` (<= 0: no total shown).
        metrics: the step's row; dropped: :func:`drop_counts`; train: the learners' metrics (``loss``
            absent on a skipped step); rewarded: some sample carries a reward (pure OPD: ``n/a``).
        skipped: ``""`` or why the batch was not trained.
    """
    total = f"/{num_steps}" if num_steps > 0 else ""
    reasons = ", ".join(f"{k.removeprefix('dropped/')} {v}" for k, v in sorted(dropped.items()) if v)
    loss = f"{train['loss']:+.4f}" if "loss" in train else "  --   "
    reward = f"{metrics['reward_mean']:+.2f}" if rewarded else " n/a"  # pure OPD samples carry no reward
    n_int = int(metrics.get("sync/interrupted_requests", 0))
    n_inflight = int(metrics.get("sync/inflight_requests", 0))
    interrupted = f" ({n_int} interrupted)" if n_int else f" ({n_inflight} in flight)" if n_inflight else ""
    return (
        f"[clawray] step {step}{total} | samples {metrics['samples']} | "
        f"reward {reward} | loss {loss} | sync {sync_s:.2f}s{' FAILED' if sync_error else ''} "
        f"pause {metrics['sync/pause_s']:.2f}s{interrupted} | "
        f"policy v{metrics['policy_version']}{f' (skipped: {skipped})' if skipped else ''}{_serving_part(metrics)} | "
        f"staleness {metrics['inv/staleness_mean']:.1f} | "
        f"trained {100 * metrics['inv/effective_sample_rate']:.0f}% of judged | "
        f"{_traffic_part(metrics)}"
        f"dropped so far {metrics['samples_dropped']}{f' ({reasons})' if reasons else ''} | "
        f"wait {t_wait:.1f}s train {t_train:.1f}s"
    )


class Timeline:
    """Seconds of the loop's phases: :meth:`phase` times a block into :attr:`seconds`; a kept
    phase's wall-clock ``(name, start, end)`` (``time.time()``) is appended to :attr:`spans`."""

    def __init__(self, maxlen: int = 4096):
        self.spans: deque[tuple[str, float, float]] = deque(maxlen=maxlen)
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str, keep: bool = False) -> Iterator[None]:
        t0, w0 = time.perf_counter(), time.time()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - t0
            if keep:
                self.spans.append((name, w0, time.time()))

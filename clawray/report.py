"""``clawray report RUN_DIR``: the evaluation curve, then one PNG per training invariant, plus a
summary table.

Reads ``RUN_DIR/metrics.jsonl`` (written by the driver: one training row per step, plus one
evaluation row, with ``eval/*`` keys, per evaluation; both carry the step number, so an evaluation
after step k shares k with step k's training row) and ``RUN_DIR/config.json`` (the run's config,
for the guards' bounds; optional). Writes ``RUN_DIR/report/eval.png`` (each ``eval/<measure>``
with its 95% CI band against the step; absent without evaluations), ``RUN_DIR/report/
{reward,entropy,signal,on_policy_gap,effective_samples}.png`` and ``RUN_DIR/report/summary.md``.

Conventions: a running total in the metrics (drop counters, ``samples_*``, the degenerate-batch
count) is plotted per step (the difference to the previous training row; the first row's value is
its own count); each invariant panel draws its guard's bound as a dashed line (the staleness cap
``queue.max_staleness``, the PPO clip range ``[1 - learner.eps, 1 + learner.eps_high]`` on the
ratio, ``learner.entropy_floor``); step axes have integer ticks.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

# invariant -> (title, metrics plotted on its panel); "reward" comes first, on its own
INVARIANTS: dict[str, tuple[str, list[str]]] = {
    "reward": ("Reward (batch mean of the judge's score)", ["reward_mean", "inv/nonzero_reward_frac"]),
    "entropy": ("Policy entropy does not collapse",
                ["inv/entropy", "inv/entropy_p10", "inv/entropy_coef"]),
    "signal": ("Learning signal stays non-degenerate",
               ["inv/nonzero_reward_frac", "inv/adv_std", "inv/degenerate_batches"]),
    "on_policy_gap": ("On-policy gap stays bounded",
                      ["inv/staleness_mean", "inv/staleness_max", "inv/ratio_max", "inv/clip_frac",
                       "inv/logprob_mismatch_kl"]),
    "effective_samples": ("Effective sample rate stays high",
                          ["inv/effective_sample_rate", "inv/effective_token_rate", "samples_dropped"]),
}

# running totals in metrics.jsonl, plotted (and summarized) as per-step increments
COUNTERS = ("samples_dropped", "samples_in", "samples_taken", "samples_trained", "inv/degenerate_batches")
COUNTER_PREFIXES = ("inv/dropped_samples/",)


def is_counter(key: str) -> bool:
    """True for a running total (see :data:`COUNTERS`)."""
    return key in COUNTERS or key.startswith(COUNTER_PREFIXES)


def load_metrics(run_dir: str) -> list[dict]:
    """Every row of ``run_dir/metrics.jsonl`` (training and evaluation rows), in file order.

    Raises:
        FileNotFoundError: ``run_dir/metrics.jsonl`` does not exist.
        ValueError: the file holds no row.
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no step")
    return rows


def split_rows(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(training rows, evaluation rows)``: an evaluation row has an ``eval/*`` key."""
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    return [r for r in rows if not any(k.startswith("eval/") for k in r)], evals


def per_step(rows: list[dict], key: str) -> list[float]:
    """``key`` of each training row; a running total (:func:`is_counter`) as its increment over the
    previous row (the first row: its own value); a missing or null value is NaN."""
    out, prev = [], 0.0
    for r in rows:
        v = r.get(key)
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            out.append(math.nan)
            continue
        v = float(v)
        out.append(v - prev if is_counter(key) else v)
        if is_counter(key):
            prev = v
    return out


def bounds(config: dict[str, Any]) -> dict[str, list[tuple[float, str]]]:
    """The guard bounds per metric from the run's config: ``{metric: [(value, label)]}``."""
    lrn, queue = config.get("learner", {}) or {}, config.get("queue", {}) or {}
    out: dict[str, list[tuple[float, str]]] = {}
    if isinstance(queue.get("max_staleness"), (int, float)):
        cap = float(queue["max_staleness"])
        out["inv/staleness_max"] = out["inv/staleness_mean"] = [(cap, f"cap {cap:g}")]
    if isinstance(lrn.get("eps"), (int, float)) and isinstance(lrn.get("eps_high"), (int, float)):
        out["inv/ratio_max"] = [(1 + lrn["eps_high"], f"clip 1+{lrn['eps_high']:g}"),
                                (1 - lrn["eps"], f"clip 1-{lrn['eps']:g}")]
    if lrn.get("entropy_floor"):
        out["inv/entropy"] = out["inv/entropy_p10"] = [(float(lrn["entropy_floor"]), "floor")]
    return out


def summarize(rows: list[dict]) -> list[tuple[str, str, int, float, float, float, float, float]]:
    """``(panel, metric, steps with a value, first, min, mean, max, last)`` for every plotted
    metric present, over the training rows (running totals as per-step increments, named
    ``<metric> (per step)``), then every ``eval/<measure>`` over the evaluation rows. Steps without
    a value (``null``) are counted out of the statistics."""
    train, evals = split_rows(rows)
    table = []
    for name, (_, keys) in INVARIANTS.items():
        for key in keys:
            values = [v for v in per_step(train, key) if math.isfinite(v)]
            if values:
                label = f"{key} (per step)" if is_counter(key) else key
                table.append((name, label, len(values), values[0], min(values), sum(values) / len(values),
                              max(values), values[-1]))
    for key in eval_measures(evals):
        values = [float(r[key]) for r in evals if isinstance(r.get(key), (int, float))]
        table.append(("eval", key, len(values), values[0], min(values), sum(values) / len(values), max(values),
                      values[-1]))
    return table


def eval_measures(evals: list[dict]) -> list[str]:
    """The ``eval/<measure>`` keys (not their ``_lo``/``_hi`` bounds nor ``eval/seconds``), in order."""
    keys: dict[str, None] = {}
    for r in evals:
        for k in r:
            if k.startswith("eval/") and not k.endswith(("_lo", "_hi")) and k != "eval/seconds":
                keys.setdefault(k)
    return list(keys)


def _int_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _plot_eval(plt, evals: list[dict], path: str) -> bool:
    keys = eval_measures(evals)
    if not keys:
        return False
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        pts = [(r["step"], r[key], r.get(f"{key}_lo", r[key]), r.get(f"{key}_hi", r[key])) for r in evals
               if isinstance(r.get(key), (int, float))]
        xs, ys, lo, hi = (list(c) for c in zip(*pts))
        ax.fill_between(xs, lo, hi, alpha=0.2, label="95% CI")
        ax.plot(xs, ys, marker="o")
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel(key.removeprefix("eval/"), fontsize=8)
        ax.grid(alpha=0.3)
        _int_steps(ax)
    axes[0, 0].legend(fontsize=7, loc="best")
    axes[-1, 0].set_xlabel("step (policy updates)")
    fig.suptitle("Held-out evaluation (first-turn success, 95% Wilson CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write_report(run_dir: str) -> list[str]:
    """Write ``eval.png`` (when the run evaluated), one PNG per panel of :data:`INVARIANTS` and
    ``summary.md``; returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_metrics(run_dir)
    train, evals = split_rows(rows)
    config = {}
    if os.path.isfile(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json")) as f:
            config = json.load(f)
    limits = bounds(config)
    out_dir = os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    if _plot_eval(plt, evals, os.path.join(out_dir, "eval.png")):
        written.append(os.path.join(out_dir, "eval.png"))
    steps = [r["step"] for r in train]
    for name, (title, keys) in INVARIANTS.items():
        present = [k for k in keys if any(k in r for r in train)]
        fig, axes = plt.subplots(len(present) or 1, 1, figsize=(7, 1.9 * max(len(present), 1)), sharex=True,
                                 squeeze=False)
        for ax, key in zip(axes[:, 0], present):
            ax.plot(steps, per_step(train, key), marker="o", ms=3)
            for value, label in limits.get(key, []):
                ax.axhline(value, color="tab:red", ls="--", lw=1)
                ax.annotate(label, (1.0, value), xycoords=("axes fraction", "data"), ha="right", va="bottom",
                            fontsize=7, color="tab:red")
            label = key.removeprefix("inv/") + (" / step" if is_counter(key) else "")
            ax.set_ylabel(label, fontsize=8)
            ax.grid(alpha=0.3)
            _int_steps(ax)
        axes[-1, 0].set_xlabel("step")
        fig.suptitle(title)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    lines = [f"# clawray report: {run_dir}", "", f"{len(train)} steps, {len(evals)} evaluations.", "",
             "| panel | metric | rows with a value | first | min | mean | max | last |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {inv} | `{key}` | {n}/{len(evals) if inv == 'eval' else len(train)} | "
              + " | ".join(f"{v:.4g}" for v in vals) + " |" for inv, key, n, *vals in summarize(rows)]
    path = os.path.join(out_dir, "summary.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    written.append(path)
    return written

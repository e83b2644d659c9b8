"""``clawray report RUN_DIR``: one PNG per training invariant over steps, plus a summary table.

Reads ``RUN_DIR/metrics.jsonl`` (written by the driver every step) and writes
``RUN_DIR/report/{entropy,signal,on_policy_gap,effective_samples}.png`` and
``RUN_DIR/report/summary.md`` (first / min / mean / max / last of every plotted metric).
"""

from __future__ import annotations

import json
import math
import os

# invariant -> (title, metrics plotted on its panel)
INVARIANTS: dict[str, tuple[str, list[str]]] = {
    "entropy": ("Policy entropy does not collapse",
                ["inv/entropy", "inv/entropy_p10", "inv/entropy_coef"]),
    "signal": ("Learning signal stays non-degenerate",
               ["inv/nonzero_reward_frac", "inv/adv_std", "inv/degenerate_batches", "reward_mean"]),
    "on_policy_gap": ("On-policy gap stays bounded",
                      ["inv/staleness_mean", "inv/staleness_max", "inv/ratio_max", "inv/clip_frac",
                       "inv/logprob_mismatch_kl"]),
    "effective_samples": ("Effective sample rate stays high",
                          ["inv/effective_token_rate", "samples_dropped"]),
}


def load_metrics(run_dir: str) -> list[dict]:
    """The per-step metric dicts of a run, in step order.

    Raises:
        FileNotFoundError: ``run_dir/metrics.jsonl`` does not exist.
        ValueError: the file holds no step.
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no step")
    return rows


def summarize(rows: list[dict]) -> list[tuple[str, str, int, float, float, float, float, float]]:
    """``(invariant, metric, steps with a value, first, min, mean, max, last)`` for every plotted
    metric present. Steps without a value (``null``: e.g. a log-prob mismatch when no sample was
    fresh, a reward mean when no sample carried a reward) are counted out of the statistics."""
    table = []
    for name, (_, keys) in INVARIANTS.items():
        for key in keys:
            values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            if values:
                table.append((name, key, len(values), values[0], min(values), sum(values) / len(values), max(values),
                              values[-1]))
    return table


def write_report(run_dir: str) -> list[str]:
    """Write the PNGs and ``summary.md``; returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_metrics(run_dir)
    out_dir = os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    steps = [r["step"] for r in rows]
    written = []
    for name, (title, keys) in INVARIANTS.items():
        present = [k for k in keys if any(k in r for r in rows)]
        fig, axes = plt.subplots(len(present) or 1, 1, figsize=(7, 1.9 * max(len(present), 1)), sharex=True,
                                 squeeze=False)
        for ax, key in zip(axes[:, 0], present):
            ys = [float(r[key]) if isinstance(r.get(key), (int, float)) else math.nan for r in rows]
            ax.plot(steps, ys, marker="o", ms=3)
            ax.set_ylabel(key.removeprefix("inv/"), fontsize=8)
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        fig.suptitle(title)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    lines = [f"# clawray report: {run_dir}", "", f"{len(rows)} steps.", "",
             "| invariant | metric | steps with a value | first | min | mean | max | last |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {inv} | `{key}` | {n}/{len(rows)} | " + " | ".join(f"{v:.4g}" for v in vals) + " |"
              for inv, key, n, *vals in summarize(rows)]
    path = os.path.join(out_dir, "summary.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    written.append(path)
    return written

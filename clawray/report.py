"""``clawray report RUN_DIR``: the evaluation curve, then one PNG per training invariant, plus a
summary table.

Owns: the plots, the per-step conventions below, :data:`THRESHOLDS` and the matrix's verdicts. Must
not: touch a live run or Ray: it reads ``metrics.jsonl`` and ``config.json`` and writes only
``RUN_DIR/report/``.

Reads ``RUN_DIR/metrics.jsonl`` (written by the driver: one training row per step, plus one
evaluation row, with ``eval/*`` keys, per evaluation; both carry the step number, so an evaluation
after step k shares k with step k's training row) and ``RUN_DIR/config.json`` (the run's config,
for the guards' bounds; optional) and, with the promotion gate, ``RUN_DIR/versions.jsonl`` (drawn as
``RUN_DIR/report/deploy.png``: candidate vs promoted probe means). Writes ``RUN_DIR/report/eval.png`` (each ``eval/<measure>``
with its 95% CI band against the step; absent without evaluations), ``RUN_DIR/report/
{reward,entropy,signal,on_policy_gap,effective_samples}.png`` and ``RUN_DIR/report/summary.md``.

Conventions: a running total in the metrics (drop counters, ``samples_*``, the degenerate-batch
count) is plotted per step (the difference to the previous training row; the first row's value is
its own count); each invariant panel draws its guard's bound as a dashed line (the staleness cap
``queue.max_staleness``, the PPO clip range ``[1 - learner.eps, 1 + learner.eps_high]`` on the
ratio, ``learner.entropy_floor``); step axes have integer ticks.

The invariant matrix (the seed's overview matrix, measured): :func:`matrix` makes one row per run
(its mode, ``trainer.algo``, from its ``config.json``) and one column per invariant, each cell the
run's own figures and a verdict, ✓ (holds) or ● (at risk), against :data:`THRESHOLDS`:

| invariant | figures (over the run's training rows) | ✓ when |
|---|---|---|
| entropy | ``inv/entropy`` first -> last | last >= 0.5 x first, and >= ``learner.entropy_floor`` |
| signal | mean ``inv/nonzero_reward_frac``, mean ``inv/adv_std``; a top-k distillation run: mean ``opd/topk_kl`` | adv std >= 0.05 and (a mode with rewards) non-zero fraction >= 0.5; top-k: KL >= 0.001 nats/token |
| on-policy gap | max ``inv/logprob_mismatch_kl`` (and at how many steps it was measured), mean ``inv/clip_frac`` | KL <= 0.01 and clip fraction <= 0.2 |
| effective samples | mean ``inv/effective_token_rate`` | >= 0.5 |
| behaviour | ``inv/behaviour_entropy`` first -> last (when the monitor ran) | last >= 0.5 x first, and >= ``learner.behaviour_floor`` |

A cell without its metrics is ``–``. ``clawray report RUN_DIR [RUN_DIR ...]`` writes the matrix of
all the given runs into the first one's ``report/summary.md`` and ``report/index.html`` (with every
run's plots).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from clawray.records import read_jsonl

# invariant -> (title, metrics plotted on its panel); "reward" comes first, on its own
INVARIANTS: dict[str, tuple[str, list[str]]] = {
    "reward": ("Reward (batch mean of the judge's score)", ["reward_mean", "inv/nonzero_reward_frac"]),
    "entropy": ("Policy entropy does not collapse", ["inv/entropy", "inv/entropy_p10", "inv/entropy_coef"]),
    "signal": (
        "Learning signal stays non-degenerate",
        ["inv/nonzero_reward_frac", "inv/adv_std", "inv/degenerate_batches"],
    ),
    "on_policy_gap": (
        "On-policy gap stays bounded",
        ["inv/staleness_mean", "inv/staleness_max", "inv/ratio_max", "inv/clip_frac", "inv/logprob_mismatch_kl"],
    ),
    "effective_samples": (
        "Effective sample rate stays high",
        ["inv/effective_sample_rate", "inv/effective_token_rate", "samples_dropped"],
    ),
}

# OPD and Combine runs also get this panel: how often a hint is accepted (the user corrects less as
# the policy learns), the OPD term's size per token and the reward term's (with their weights,
# opd.w_opd / opd.w_rl), and the teacher's failures and hint mixtures
DISTILLATION: tuple[str, list[str]] = (
    "Distillation: hints and the teacher's term",
    [
        "judge/hint_acceptance_rate",
        "adv/opd_abs_mean",
        "adv/rl_abs_mean",
        "opd/topk_kl",
        "teacher/errors",
        "teacher/hint_mixtures",
    ],
)


def panels(train: list[dict]) -> dict[str, tuple[str, list[str]]]:
    """The report's panels for these training rows: :data:`INVARIANTS`, then ``opd``
    (:data:`DISTILLATION`) when a row has the OPD term's size or the top-k KL (an OPD or Combine run)."""
    out = dict(INVARIANTS)
    keys = ("adv/opd_abs_mean", "opd/topk_kl")
    if any(isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) for r in train for k in keys):
        out["opd"] = DISTILLATION
    return out


# running totals in metrics.jsonl, plotted (and summarized) as per-step increments
COUNTERS = (
    "samples_dropped",
    "samples_in",
    "samples_taken",
    "samples_trained",
    "inv/degenerate_batches",
    "teacher/errors",
    "teacher/hint_mixtures",
)
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
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist")
    rows = read_jsonl(path, "metrics", print, skip_damaged=True)  # a row torn by a kill: left out, said
    if not rows:
        raise ValueError(f"{path} holds no step")
    return rows


def split_rows(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(training rows, evaluation rows)``: an evaluation row has an ``eval/*`` key; the OPD premise
    check's row (``premise/*``, logged before the first step) is neither."""
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    train = [r for r in rows if not any(k.startswith(("eval/", "premise/")) for k in r)]
    return train, evals


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
        out["inv/ratio_max"] = [
            (1 + lrn["eps_high"], f"clip 1+{lrn['eps_high']:g}"),
            (1 - lrn["eps"], f"clip 1-{lrn['eps']:g}"),
        ]
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
    for name, (_, keys) in panels(train).items():
        for key in keys:
            values = [v for v in per_step(train, key) if math.isfinite(v)]
            if values:
                label = f"{key} (per step)" if is_counter(key) else key
                table.append(
                    (
                        name,
                        label,
                        len(values),
                        values[0],
                        min(values),
                        sum(values) / len(values),
                        max(values),
                        values[-1],
                    )
                )
    for key in eval_measures(evals):
        values = [float(r[key]) for r in evals if isinstance(r.get(key), (int, float))]
        table.append(
            ("eval", key, len(values), values[0], min(values), sum(values) / len(values), max(values), values[-1])
        )
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
    """Each ``eval/<measure>`` with its 95% CI band against the step (left) and, when the rows carry
    ``time/elapsed_s``, against wall minutes since the run started (right)."""
    keys = eval_measures(evals)
    if not keys:
        return False
    xaxes = [("step", "step (policy updates)", 1.0)]
    if all(isinstance(r.get("time/elapsed_s"), (int, float)) for r in evals):
        xaxes.append(("time/elapsed_s", "wall time (minutes since start)", 60.0))
    fig, axes = plt.subplots(
        len(keys), len(xaxes), figsize=(5 * len(xaxes) + 2, 2.2 * len(keys)), sharex="col", squeeze=False
    )
    for row, key in enumerate(keys):
        pts = [
            (r, r[key], r.get(f"{key}_lo", r[key]), r.get(f"{key}_hi", r[key]))
            for r in evals
            if isinstance(r.get(key), (int, float))
        ]
        for col, (xkey, _, scale) in enumerate(xaxes):
            ax = axes[row, col]
            xs = [r[xkey] / scale for r, *_ in pts]
            ax.fill_between(xs, [p[2] for p in pts], [p[3] for p in pts], alpha=0.2, label="95% CI")
            ax.plot(xs, [p[1] for p in pts], marker="o")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            if xkey == "step":
                _int_steps(ax)
        axes[row, 0].set_ylabel(key.removeprefix("eval/"), fontsize=8)
    axes[0, 0].legend(fontsize=7, loc="best")
    for col, (_, label, _) in enumerate(xaxes):
        axes[-1, col].set_xlabel(label)
    fig.suptitle("Held-out evaluation (first-turn success, 95% Wilson CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def load_versions(run_dir: str) -> list[dict]:
    """The promotion gate's decisions (``run_dir/versions.jsonl``, :mod:`clawray.gate`); [] without one."""
    return read_jsonl(os.path.join(run_dir, "versions.jsonl"), "gate records", print, skip_damaged=True)


def _plot_deploy(plt, versions: list[dict], path: str) -> list[str]:
    """``deploy.png``: each candidate's probe mean (promoted: a dot, rejected: a cross) beside the
    mean of the version users were served when it was judged (a step line), against the decision's
    order; returns the summary's lines ([] and no plot without a decision)."""
    judged = [r for r in versions if r.get("decision") in ("promoted", "rejected")]
    base = next((r for r in versions if r.get("decision") == "baseline"), None)
    if not judged:
        return []
    fig, ax = plt.subplots(figsize=(7, 2.6))
    xs = list(range(1, len(judged) + 1))
    ax.step(xs, [r["promoted_mean"] for r in judged], where="mid", color="tab:blue", label="served (promoted)")
    for decision, marker, color in (("promoted", "o", "tab:green"), ("rejected", "x", "tab:red")):
        pts = [(x, r) for x, r in zip(xs, judged) if r["decision"] == decision]
        ax.scatter(
            [x for x, _ in pts], [r["candidate_mean"] for _, r in pts], marker=marker, color=color, label=decision
        )
        for x, r in pts:
            ax.annotate(
                f"v{r['version']}", (x, r["candidate_mean"]), fontsize=6, xytext=(2, 2), textcoords="offset points"
            )
    if base is not None:
        ax.axhline(base["mean"], color="grey", ls="--", lw=1, label=f"baseline v{base['version']}")
    ax.set_xlabel("gate decision")
    ax.set_ylabel("probe mean", fontsize=8)
    ax.grid(alpha=0.3)
    _int_steps(ax)
    ax.legend(fontsize=7, loc="best")
    fig.suptitle("Promotion gate: candidate vs promoted version on the probe")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    rejected = [r for r in judged if r["decision"] == "rejected"]
    served = next(
        (r["version"] for r in reversed(versions) if r.get("decision") in ("baseline", "promoted", "resumed")), None
    )
    return [
        "",
        f"Promotion gate: {len(judged) - len(rejected)} promoted, {len(rejected)} rejected, serving v{served} "
        f"(versions.jsonl; deploy.png)." + "".join(f"\n- v{r['version']} rejected: {r['reason']}" for r in rejected),
    ]


THRESHOLDS = {
    "entropy_ratio_min": 0.5,
    "adv_std_min": 0.05,
    "topk_kl_min": 0.001,
    "nonzero_reward_frac_min": 0.5,
    "mismatch_kl_max": 0.01,
    "clip_frac_max": 0.2,
    "effective_token_rate_min": 0.5,
    "behaviour_ratio_min": 0.5,
}
"""The matrix's verdict thresholds (see the module docstring)."""

MATRIX_COLUMNS = ("entropy", "signal", "on_policy_gap", "effective_samples", "behaviour")


def _finite(rows: list[dict], key: str) -> list[float]:
    return [v for v in per_step(rows, key) if math.isfinite(v)]


def _trend(values: list[float], floor: float) -> tuple[str, bool] | None:
    if not values:
        return None
    first, last = values[0], values[-1]
    ok = last >= THRESHOLDS["entropy_ratio_min"] * first and last >= floor
    return f"{first:.3g} → {last:.3g}", ok


def matrix_row(rows: list[dict], config: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """One run's matrix row: ``{column: (figures, verdict)}``, verdict ``"✓"``, ``"●"`` or ``"–"``
    (no data), columns :data:`MATRIX_COLUMNS` (see the module docstring for the rules)."""
    train, _ = split_rows(rows)
    lrn = config.get("learner", {}) or {}
    algo = (config.get("trainer", {}) or {}).get("algo", "rl")
    T = THRESHOLDS
    out: dict[str, tuple[str, str]] = {}

    def cell(name: str, result: tuple[str, bool] | None) -> None:
        out[name] = ("", "–") if result is None else (result[0], "✓" if result[1] else "●")

    cell("entropy", _trend(_finite(train, "inv/entropy"), float(lrn.get("entropy_floor") or 0.0)))
    nz, adv = _finite(train, "inv/nonzero_reward_frac"), _finite(train, "inv/adv_std")
    topk = _finite(train, "opd/topk_kl")  # top-k distillation: the teacher's distribution is the signal
    if topk:
        mean_kl = sum(topk) / len(topk)
        cell("signal", (f"top-k KL {mean_kl:.3g}", mean_kl >= T["topk_kl_min"]))
    elif adv:
        mean_nz = sum(nz) / len(nz) if nz else math.nan
        mean_adv = sum(adv) / len(adv)
        ok = mean_adv >= T["adv_std_min"] and (not _with_reward(algo) or mean_nz >= T["nonzero_reward_frac_min"])
        said = f"non-zero {mean_nz:.2f}" if nz else "non-zero not measured"
        cell("signal", (f"{said}, adv std {mean_adv:.3g}", ok))
    else:
        cell("signal", None)
    kl, clip = _finite(train, "inv/logprob_mismatch_kl"), _finite(train, "inv/clip_frac")
    if kl or clip:  # a measure no step reported is said so, never shown (and passed) as 0
        max_kl = max(kl) if kl else None
        mean_clip = sum(clip) / len(clip) if clip else None
        said = [
            f"KL max {max_kl:.2g} ({len(kl)} of {len(train)} steps)" if max_kl is not None else "KL not measured",
            f"clip {mean_clip:.3f}" if mean_clip is not None else "clip not measured",
        ]
        ok = (max_kl is None or max_kl <= T["mismatch_kl_max"]) and (
            mean_clip is None or mean_clip <= T["clip_frac_max"]
        )
        cell("on_policy_gap", (", ".join(said), ok))
    else:
        cell("on_policy_gap", None)
    eff = _finite(train, "inv/effective_token_rate")
    cell(
        "effective_samples",
        (f"token rate {sum(eff) / len(eff):.2f}", sum(eff) / len(eff) >= T["effective_token_rate_min"])
        if eff
        else None,
    )
    beh = _finite(train, "inv/behaviour_entropy")
    trend = _trend(beh, float(lrn.get("behaviour_floor") or 0.0))
    if trend is not None:
        ok = beh[-1] >= T["behaviour_ratio_min"] * beh[0] and beh[-1] >= float(lrn.get("behaviour_floor") or 0.0)
        trend = (trend[0], ok)
    cell("behaviour", trend)
    return out


def matrix(run_dirs: list[str]) -> list[tuple[str, str, dict[str, tuple[str, str]]]]:
    """``[(mode, run folder, matrix_row)]`` for each run folder (its mode from ``config.json``'s
    ``trainer.algo``; ``?`` without a config)."""
    out = []
    for run_dir in run_dirs:
        config = _config(run_dir)
        mode = (config.get("trainer", {}) or {}).get("algo", "?")
        out.append((mode, run_dir, matrix_row(load_metrics(run_dir), config)))
    return out


def matrix_markdown(table: list[tuple[str, str, dict[str, tuple[str, str]]]]) -> list[str]:
    """The matrix as markdown lines: ``| mode | run | entropy | ... |``, each cell ``verdict figures``."""
    lines = ["| mode | run | " + " | ".join(MATRIX_COLUMNS) + " |", "|---|---|" + "---|" * len(MATRIX_COLUMNS)]
    for mode, run_dir, row in table:
        cells = [f"{row[c][1]} {row[c][0]}".strip() for c in MATRIX_COLUMNS]
        lines.append(f"| {mode} | {os.path.basename(os.path.normpath(run_dir))} | " + " | ".join(cells) + " |")
    return lines


def _config(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write_html(out_dir: str, table: list, images: dict[str, list[str]]) -> str:
    """``out_dir/index.html``: the matrix, then each run's plots (``images``: run folder -> PNG paths).

    Returns the written path."""
    import html

    head = ["mode", "run", *MATRIX_COLUMNS]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>clawray report</title>",
        "<style>body{font-family:sans-serif}td,th{border:1px solid #ccc;padding:4px 8px}"
        "table{border-collapse:collapse}.ok{color:#060}.risk{color:#a00}</style></head><body>",
        "<h1>clawray report</h1><h2>Invariant matrix</h2><table><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in head)
        + "</tr>",
    ]
    for mode, run_dir, row in table:
        cells = [f"<td>{html.escape(mode)}</td>", f"<td>{html.escape(run_dir)}</td>"]
        for c in MATRIX_COLUMNS:
            figures, verdict = row[c]
            css = "ok" if verdict == "✓" else "risk" if verdict == "●" else ""
            cells.append(f"<td class='{css}'>{verdict} {html.escape(figures)}</td>")
        parts.append("<tr>" + "".join(cells) + "</tr>")
    parts.append(
        "</table><p>✓ holds, ● at risk, – no data; thresholds: "
        + html.escape(", ".join(f"{k} {v:g}" for k, v in THRESHOLDS.items()))
        + "</p>"
    )
    for run_dir, paths in images.items():
        parts.append(f"<h2>{html.escape(run_dir)}</h2>")
        for p in paths:
            rel = os.path.relpath(p, out_dir)
            parts.append(f"<div><img src='{html.escape(rel)}' alt='{html.escape(os.path.basename(p))}'></div>")
    parts.append("</body></html>")
    path = os.path.join(out_dir, "index.html")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")
    return path


def write_reports(run_dirs: list[str]) -> list[str]:
    """:func:`write_report` for each run folder, then the matrix of all of them appended to the
    first one's ``report/summary.md`` and its ``report/index.html``; returns the written paths."""
    written, images = [], {}
    for run_dir in run_dirs:
        paths = write_report(run_dir)
        written += paths
        images[run_dir] = [p for p in paths if p.endswith(".png")]
    table = matrix(run_dirs)
    out_dir = os.path.join(run_dirs[0], "report")
    with open(os.path.join(out_dir, "summary.md"), "a") as f:
        f.write("\n## Invariant matrix\n\n" + "\n".join(matrix_markdown(table)) + "\n")
    written.append(write_html(out_dir, table, images))
    return written


def write_report(run_dir: str) -> list[str]:
    """Write ``eval.png`` (when the run evaluated), one PNG per panel (:func:`panels`) and
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
    gate_lines = _plot_deploy(plt, load_versions(run_dir), os.path.join(out_dir, "deploy.png"))
    if gate_lines:
        written.append(os.path.join(out_dir, "deploy.png"))
    steps = [r["step"] for r in train]
    for name, (title, keys) in panels(train).items():
        present = [k for k in keys if any(k in r for r in train)]
        fig, axes = plt.subplots(
            len(present) or 1, 1, figsize=(7, 1.9 * max(len(present), 1)), sharex=True, squeeze=False
        )
        for ax, key in zip(axes[:, 0], present):
            ax.plot(steps, per_step(train, key), marker="o", ms=3)
            for value, label in limits.get(key, []):
                ax.axhline(value, color="tab:red", ls="--", lw=1)
                ax.annotate(
                    label,
                    (1.0, value),
                    xycoords=("axes fraction", "data"),
                    ha="right",
                    va="bottom",
                    fontsize=7,
                    color="tab:red",
                )
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
    lines = [
        f"# clawray report: {run_dir}",
        "",
        f"{len(train)} steps, {len(evals)} evaluations.",
        *gate_lines,
        "",
        "| panel | metric | rows with a value | first | min | mean | max | last |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {inv} | `{key}` | {n}/{len(evals) if inv == 'eval' else len(train)} | "
        + " | ".join(f"{v:.4g}" for v in vals)
        + " |"
        for inv, key, n, *vals in summarize(rows)
    ]
    path = os.path.join(out_dir, "summary.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    written.append(path)
    return written


def _with_reward(algo: str) -> bool:
    """Whether the samples of ``trainer.algo`` = ``algo`` carry a reward (pure OPD's do not); True for
    a name this version does not know (a run of an older or newer clawray)."""
    from clawray.algos.algorithm import algorithm_class

    try:
        return algorithm_class(algo).with_reward
    except ValueError:
        return True

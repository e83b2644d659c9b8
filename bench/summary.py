"""One table of clawray's performance figures (issue #29): runs the benches, each in its own process,
and prints per measure its target, its figure and the ratio to its limit (the plain loop, the raw
engine, static batches, ...). README's "Performance" section is this table.

    PYTHONPATH=. python bench/summary.py                                   # tiny model, hf engine (~7 min)
    PYTHONPATH=. python bench/summary.py --model ~/.cache/clawray/models/smollm2-135m-instruct \\
        --backend vllm                                                     # README's figures (~40 min)
    PYTHONPATH=. python bench/summary.py --only learner,ttft --out figures.json

Each bench is run as ``python bench/<name>.py <its args> --json <file>`` (the commands are printed, so
any row can be re-run alone); a bench that fails is a row saying so, and the exit status is 1. A
ratio is figure / limit, so ``met`` reads against the target's bound. Run it on a quiet machine: the
benches share its cores with nothing else, and each takes them all.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Measure:
    """One row: ``ratio(results)`` against ``bound`` (``">="`` or ``"<="``); ``figure`` says it in units."""

    name: str
    limit: str  # what the ratio is taken against
    op: str  # ">=" or "<="
    bound: float
    ratio: Callable[[dict], float]
    figure: Callable[[dict], str]
    note: str = ""  # where the target applies, when not here


@dataclass(frozen=True)
class Bench:
    """One bench script run; ``args(model, backend)`` are its quick arguments."""

    key: str
    script: str
    args: Callable[[str, str], list[str]]
    measures: tuple[Measure, ...]


def _model(model: str, backend: str) -> list[str]:
    return ["--model", model] if model else []


def _median_ratio(r: dict, key: str, single: float) -> float:
    """learner_throughput's ratio ``key``: the median over its runs (``--runs``), else ``single``."""
    return statistics.median(r.get("ratios", {}).get(key) or [single])


def _spread(values: list[float], extra: str = "") -> str:
    """`` (ratio: median of N runs, min-max[; extra])`` for a ratio measured over several runs, else ""."""
    if len(values) < 2:
        return ""
    return f" (ratio: median of {len(values)} runs, {min(values):.2f}-{max(values):.2f}{extra})"


def _runs_spread(r: dict) -> str:
    """sync_pause's spread over its runs (``--runs``): the run shown is the median one (the ratio the
    row reads), then the runs' min-max and the pooled p99's ratio; "" for one run."""
    values = r.get("ratios") or []
    extra = f"; pooled p99 of {r['pooled_overlapping']} requests {r['pooled_ratio']:.2f}x" if len(values) > 1 else ""
    return _spread(values, extra)


def _own_cpu() -> list[str]:
    """sync_pause's engine on the first CPU this process may use and the rest (Ray, the sender) on the
    others, as on a GPU host, where decoding does not share the sync's CPUs; nothing with 1 CPU."""
    cpus = os.sched_getaffinity(0)
    return ["--engine-cpus", str(min(cpus)), "--engine-threads", "1"] if len(cpus) >= 2 else []


def _engine(model: str, backend: str) -> list[str]:
    return _model(model, backend) + ["--backend", backend]


def _serving(r: dict) -> tuple[str, float, float]:
    """The 16-session endpoint throughput and its limit: ``(limit's name, endpoint tokens/s, limit's
    tokens/s)``; the limit is vLLM's own engine when measured (``--raw``), else the rollout engine actor
    called directly."""
    paths = r["16"]
    base = "raw" if "raw" in paths else "direct"
    return base, paths["endpoint"]["tokens_per_s"], paths[base]["tokens_per_s"]


def _sync_row(r: dict) -> dict:
    """weight_sync.py's one row (``--only`` names a single state)."""
    return next(iter(r.values()))


BENCHES: tuple[Bench, ...] = (
    Bench(
        "learner",
        "learner_throughput.py",
        lambda m, b: _model(m, b) + ["--steps", "3", "--runs", "5" if m else "1"],
        (
            Measure(
                "learner tokens/s, 1 rank",
                "a plain single-process PyTorch loop",
                ">=",
                0.9,
                lambda r: _median_ratio(r, "1_vs_plain", r["ranks_tokens_per_s"]["1"] / r["plain_tokens_per_s"]),
                lambda r: (
                    f"{r['ranks_tokens_per_s']['1']:.1f} vs {r['plain_tokens_per_s']:.1f} tokens/s"
                    + _spread(r.get("ratios", {}).get("1_vs_plain") or [])
                ),
            ),
            Measure(
                "learner tokens/s, 2 ranks",
                "1 rank",
                ">=",
                1.5,
                lambda r: _median_ratio(r, "2_vs_1", r["ranks_tokens_per_s"]["2"] / r["ranks_tokens_per_s"]["1"]),
                lambda r: (
                    f"{r['ranks_tokens_per_s']['2']:.1f} vs {r['ranks_tokens_per_s']['1']:.1f} tokens/s"
                    + _spread(r.get("ratios", {}).get("2_vs_1") or [])
                ),
            ),
        ),
    ),
    Bench(
        "serving",
        "serve_overhead.py",
        lambda m, b: _engine(m, b) + ["--concurrency", "16", "--rounds", "8"] + (["--raw"] if b == "vllm" else []),
        (
            Measure(
                "serving throughput, 16 sessions",
                "the same requests on vLLM's own engine (vllm), or on the engine actor (hf)",
                ">=",
                0.9,
                lambda r: _serving(r)[1] / _serving(r)[2],
                lambda r: "{1:.1f} vs {2:.1f} tokens/s ({0})".format(*_serving(r)),
            ),
        ),
    ),
    Bench(
        "ttft",
        "ttft.py",
        lambda m, b: _engine(m, b) + ["--trials", "4", "--long", "8", "--long-tokens", "128"],
        (
            Measure(
                "time to first token of a late short request, p99",
                "static batches",
                "<=",
                1.0,
                lambda r: r["continuous"]["p99_s"] / r["static"]["p99_s"],
                lambda r: f"{r['continuous']['p99_s']:.3f} vs {r['static']['p99_s']:.3f} s",
                "lower than static",
            ),
        ),
    ),
    Bench(
        "sync_pause",
        "sync_pause.py",
        lambda m, b: (
            _engine(m, b)
            + ["--modes", "interrupt,inflight", "--gap", "3", "--max-tokens", "32", "--syncs", "30", "--interval", "4"]
            + ["--transport", "auto", "--runs", "5" if m else "1"]
            + _own_cpu()
        ),
        tuple(
            Measure(
                f"latency a weight sync adds ({mode}), p99",
                "the sync's transfer + load",
                "<=",
                1.5,
                lambda r, mode=mode: r[mode]["p99"] / r[mode]["transfer_load_s"],
                lambda r, mode=mode: (
                    f"{r[mode]['p99']:.3f} s added vs {r[mode]['transfer_load_s']:.3f} s"
                    + (f" (engine on CPU {r[mode]['engine_cpus']})" if r[mode].get("engine_cpus") else "")
                    + _runs_spread(r[mode])
                ),
            )
            for mode in ("interrupt", "inflight")
        ),
    ),
    Bench(
        "weight_sync",
        "weight_sync.py",
        lambda m, b: ["--only", "smollm2" if m else "tiny", "--reps", "3"],
        (
            Measure(
                "weight sync bandwidth, 1 -> 2 (gloo)",
                "one flat broadcast of the same bytes",
                ">=",
                0.9,
                lambda r: _sync_row(r)["flat"] / _sync_row(r)["clawray"],
                lambda r: "{:.2f} GB/s on {:.0f} MB".format(
                    _sync_row(r)["bytes"] / 1e9 / _sync_row(r)["clawray"], _sync_row(r)["bytes"] / 1e6
                ),
            ),
        ),
    ),
    Bench(
        "loop",
        "loop_throughput.py",
        lambda m, b: _engine(m, b) + ["--steps", "4"],
        (
            Measure(
                "samples trained per minute, async loop",
                "the serial loop",
                ">=",
                1.8,
                lambda r: r["async"]["per_min"] / r["serial"]["per_min"],
                lambda r: f"{r['async']['per_min']:.1f} vs {r['serial']['per_min']:.1f} samples/min",
                "on one GPU (#16); on 2 CPU cores both loops share the cores",
            ),
        ),
    ),
)


def command(bench: Bench, model: str, backend: str, json_path: str) -> list[str]:
    """The bench's command line, as run (``sys.executable``, the script's path, ``--json json_path``)."""
    return [sys.executable, os.path.join(HERE, bench.script), *bench.args(model, backend), "--json", json_path]


def rows(bench: Bench, results: dict | None, error: str = "") -> list[dict]:
    """The table rows of one bench run: ``{"measure", "target", "figure", "ratio", "met"}`` per measure;
    ``results`` None (the bench failed: ``error``), a figure the results lack or a ratio that is not
    finite gives ``ratio`` None and ``met`` False, with the reason as the figure."""
    out = []
    for m in bench.measures:
        target = f"{m.op} {m.bound:g}x {m.limit}" + (f" ({m.note})" if m.note else "")
        try:
            if results is None:
                raise LookupError(error or "no results")
            ratio, figure = m.ratio(results), m.figure(results)
        except (LookupError, TypeError, ZeroDivisionError) as e:
            out.append({"measure": m.name, "target": target, "figure": f"failed: {e}", "ratio": None, "met": False})
            continue
        if not math.isfinite(ratio):  # e.g. no request overlapped a sync
            out.append(
                {"measure": m.name, "target": target, "figure": f"no figure: {figure}", "ratio": None, "met": False}
            )
            continue
        met = ratio >= m.bound if m.op == ">=" else ratio <= m.bound
        out.append({"measure": m.name, "target": target, "figure": figure, "ratio": ratio, "met": met})
    return out


def table(all_rows: list[dict]) -> str:
    """The markdown table README's "Performance" section holds."""
    lines = ["| measure | target (ratio to its limit) | figure | ratio | met |", "|---|---|---|---|---|"]
    for r in all_rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(f"| {r['measure']} | {r['target']} | {r['figure']} | {ratio} | {'yes' if r['met'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="HF folder (default: each bench builds the tiny model)")
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--only", default=",".join(b.key for b in BENCHES), help="benches to run, by key")
    ap.add_argument("--out", default="", help="also write the rows (and each bench's command) as JSON here")
    args = ap.parse_args(argv)
    model = os.path.expanduser(args.model) if args.model else ""
    wanted = args.only.split(",")
    unknown = set(wanted) - {b.key for b in BENCHES}
    if unknown:
        ap.error(f"unknown bench(es) {sorted(unknown)}; known: {[b.key for b in BENCHES]}")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))
    )
    all_rows, report = [], []
    for bench in (b for b in BENCHES if b.key in wanted):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "figures.json")
            cmd = command(bench, model, args.backend, path)
            print(f"[summary] {bench.key}: {' '.join(cmd[1:])}", flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env)
            seconds = time.perf_counter() - t0
            results, error = None, ""
            if proc.returncode != 0 or not os.path.exists(path):
                error = f"bench exited {proc.returncode}"
            else:
                with open(path) as f:
                    results = json.load(f)
        print(f"[summary] {bench.key}: {seconds:.0f} s", flush=True)
        bench_rows = rows(bench, results, error)
        all_rows += bench_rows
        report.append(
            {"bench": bench.key, "command": cmd[1:-2], "seconds": seconds, "results": results, "rows": bench_rows}
        )
    print(f"\nmodel={model or 'tiny (built per bench)'} backend={args.backend}")
    print(table(all_rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if any(r["ratio"] is None for r in all_rows) else 0


if __name__ == "__main__":
    sys.exit(main())

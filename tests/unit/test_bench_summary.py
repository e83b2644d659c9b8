"""bench/summary.py: the rows it builds from each bench's JSON figures (ratios, met, failures) and the
commands it runs."""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def summary():
    spec = importlib.util.spec_from_file_location("clawray_bench_summary", os.path.join(ROOT, "bench", "summary.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


def bench(summary, key):
    return next(b for b in summary.BENCHES if b.key == key)


def test_learner_rows_are_ratios_to_the_plain_loop_and_to_one_rank(summary):
    # what learner_throughput.py --json writes (int rank keys become strings in JSON)
    results = {"tokens_per_step": 764, "plain_tokens_per_s": 72.0, "ranks_tokens_per_s": {"1": 63.0, "2": 99.0}}
    one, two = summary.rows(bench(summary, "learner"), results)
    assert one["ratio"] == pytest.approx(63.0 / 72.0) and one["met"] is False  # 0.875 < 0.9
    assert one["figure"] == "63.0 vs 72.0 tokens/s"
    assert two["ratio"] == pytest.approx(99.0 / 63.0) and two["met"] is True  # 1.571 >= 1.5
    assert one["target"] == ">= 0.9x a plain single-process PyTorch loop"


def test_serving_is_measured_against_the_raw_engine_when_there_is_one(summary):
    b = bench(summary, "serving")
    paths = {"direct": {"tokens_per_s": 150.0}, "endpoint": {"tokens_per_s": 140.0}}
    (row,) = summary.rows(b, {"16": paths})
    assert row["ratio"] == pytest.approx(140 / 150) and row["met"] is True and row["figure"].endswith("(direct)")
    (row,) = summary.rows(b, {"16": dict(paths, raw={"tokens_per_s": 200.0})})
    assert (
        row["ratio"] == pytest.approx(0.7) and row["met"] is False and row["figure"] == "140.0 vs 200.0 tokens/s (raw)"
    )
    assert "--raw" in b.args("m", "vllm") and "--raw" not in b.args("m", "hf")


def test_upper_bounds_pass_at_or_below_the_bound(summary):
    (ttft,) = summary.rows(bench(summary, "ttft"), {"continuous": {"p99_s": 0.35}, "static": {"p99_s": 19.0}})
    assert ttft["ratio"] == pytest.approx(0.35 / 19.0) and ttft["met"] is True
    pause = bench(summary, "sync_pause")
    inflight = {"inflight": {"p99": 0.4, "transfer_load_s": 0.5}}
    row, row2 = summary.rows(pause, {"interrupt": {"p99": 1.5, "transfer_load_s": 1.0}, **inflight})
    assert row["ratio"] == 1.5 and row["met"] is True and row["measure"].endswith("(interrupt), p99")
    assert row2["ratio"] == pytest.approx(0.8) and row2["met"] is True and row2["measure"].endswith("(inflight), p99")
    row, row2 = summary.rows(pause, {"interrupt": {"p99": 1.479, "transfer_load_s": 0.891}, **inflight})
    assert row["ratio"] == pytest.approx(1.66, abs=0.005) and row["met"] is False
    row, row2 = summary.rows(pause, {"interrupt": {"p99": float("nan"), "transfer_load_s": 0.008}})  # no overlap
    assert row["ratio"] is None and row["figure"] == "no figure: nan s added vs 0.008 s"
    assert row2["ratio"] is None and row2["figure"] == "failed: 'inflight'"
    assert "interrupt,inflight" in pause.args("", "hf")


def test_a_failed_bench_or_a_missing_figure_is_a_row_that_says_so(summary):
    rows = summary.rows(bench(summary, "learner"), None, "bench exited 1")
    assert [(r["figure"], r["ratio"], r["met"]) for r in rows] == [("failed: bench exited 1", None, False)] * 2
    (row,) = summary.rows(bench(summary, "loop"), {"async": {"per_min": 20.7}})  # serial missing
    assert row["ratio"] is None and row["figure"] == "failed: 'serial'"
    text = summary.table(rows[:1])
    assert text.splitlines()[2] == (
        "| learner tokens/s, 1 rank | >= 0.9x a plain single-process PyTorch loop | failed: bench exited 1 | - | no |"
    )


def test_commands_carry_the_model_backend_and_json_path(summary):
    cmd = summary.command(bench(summary, "ttft"), "/m", "vllm", "/tmp/f.json")
    assert cmd[1].endswith(os.path.join("bench", "ttft.py"))
    assert cmd[2:] == ["--model", "/m", "--backend", "vllm", "--trials", "4", "--long", "8", "--long-tokens", "128"] + [
        "--json",
        "/tmp/f.json",
    ]
    assert summary.command(bench(summary, "weight_sync"), "", "hf", "f")[2:4] == ["--only", "tiny"]
    with pytest.raises(SystemExit):
        summary.main(["--only", "learner,nope"])


def test_the_sync_pause_rows_run_30_syncs_with_the_engine_on_its_own_cpu_where_there_are_two(summary, monkeypatch):
    pause = bench(summary, "sync_pause")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    args = pause.args("m", "vllm")
    assert args[args.index("--syncs") + 1] == "30" and args[args.index("--transport") + 1] == "auto"
    assert args[args.index("--engine-cpus") + 1] == "0" and args[args.index("--engine-threads") + 1] == "1"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3})  # taskset -c 2,3: the first allowed one
    assert pause.args("m", "vllm")[-4:] == ["--engine-cpus", "2", "--engine-threads", "1"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # one CPU: nothing to keep apart
    assert "--engine-cpus" not in pause.args("m", "vllm")
    row, _ = summary.rows(
        pause, {"interrupt": {"p99": 0.767, "transfer_load_s": 0.556, "engine_cpus": "0"}, "inflight": {}}
    )
    assert row["figure"] == "0.767 s added vs 0.556 s (engine on CPU 0)" and row["ratio"] == pytest.approx(
        1.3795, abs=1e-4
    )


def test_learner_rows_take_the_median_ratio_over_runs_with_its_spread(summary):
    """learner_throughput.py --runs 5 (the issue's median of 5): each ratio is the median of the per-run ratios."""
    b = bench(summary, "learner")
    assert b.args("m", "vllm")[-2:] == ["--runs", "5"] and b.args("", "hf")[-2:] == ["--runs", "1"]
    results = {
        "tokens_per_step": 764,
        "plain_tokens_per_s": 72.0,
        "ranks_tokens_per_s": {"1": 69.0, "2": 99.0},
        "ratios": {"1_vs_plain": [0.92, 1.00, 0.95, 0.96, 0.94], "2_vs_1": [1.04, 1.52, 1.50, 1.38, 1.51]},
    }
    one, two = summary.rows(b, results)
    assert one["ratio"] == pytest.approx(0.95) and one["met"] is True
    assert two["ratio"] == pytest.approx(1.50) and two["met"] is True
    assert two["figure"] == "99.0 vs 69.0 tokens/s (ratio: median of 5 runs, 1.04-1.52)"


def _load_bench(name):
    spec = importlib.util.spec_from_file_location(f"clawray_bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sync_pause_runs_are_summarized_by_the_median_run_with_the_pooled_p99():
    """sync_pause.py --runs N: the row is the run with the median ratio; the pooled p99 covers every run."""
    sp = _load_bench("sync_pause")
    runs = [  # ratios 1.8, 1.2, 1.4: the median run is the third
        {"p99": 0.9, "transfer_load_s": 0.5, "added_s": [0.1, 0.9]},
        {"p99": 0.6, "transfer_load_s": 0.5, "added_s": [0.2, 0.6]},
        {"p99": 0.84, "transfer_load_s": 0.6, "added_s": [0.3, 0.84]},
    ]
    row = sp.summarize_runs(runs)
    assert row["p99"] == 0.84 and row["transfer_load_s"] == 0.6
    assert row["ratios"] == pytest.approx([1.8, 1.2, 1.4])
    # 6 pooled values sorted 0.1 0.2 0.3 0.6 0.84 0.9: nearest rank int(0.99 * 6) = 5 -> 0.9
    assert row["pooled_overlapping"] == 6 and row["pooled_p99"] == 0.9
    assert row["pooled_ratio"] == pytest.approx(0.9 / ((0.5 + 0.5 + 0.6) / 3))
    even = sp.summarize_runs(runs[:2])  # an even count: the lower middle run
    assert even["p99"] == 0.6
    with pytest.raises(ValueError, match="no runs"):
        sp.summarize_runs([])


def test_the_sync_pause_rows_take_the_median_of_5_runs_on_a_real_model(summary, monkeypatch):
    pause = bench(summary, "sync_pause")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert pause.args("m", "vllm")[-2:] == ["--runs", "5"] and pause.args("", "hf")[-2:] == ["--runs", "1"]
    middle = {"p99": 0.767, "transfer_load_s": 0.556, "engine_cpus": "0", "ratios": [1.62, 1.3795, 1.30, 1.2, 1.5]}
    row, _ = summary.rows(
        pause, {"interrupt": dict(middle, pooled_overlapping=110, pooled_ratio=1.449), "inflight": {}}
    )
    assert row["ratio"] == pytest.approx(1.3795, abs=1e-4) and row["met"] is True
    assert row["figure"] == (
        "0.767 s added vs 0.556 s (engine on CPU 0) (ratio: median of 5 runs, 1.20-1.62; "
        "pooled p99 of 110 requests 1.45x)"
    )

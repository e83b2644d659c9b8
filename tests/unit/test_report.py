"""clawray report on a hand-written metrics.jsonl: per-step increments of running totals, evaluation
rows that share step numbers with training rows, the guards' bounds, integer step ticks."""

import json
import math

from clawray.report import bounds, panels, per_step, split_rows, summarize, write_report

TRAIN = [
    {
        "step": 1,
        "samples": 4,
        "reward_mean": 0.5,
        "samples_dropped": 4,
        "inv/dropped_samples/stale": 0,
        "inv/staleness_max": 1,
        "inv/ratio_max": 1.1,
        "inv/entropy": 2.0,
        "inv/degenerate_batches": 0,
    },
    {
        "step": 2,
        "samples": 6,
        "reward_mean": None,
        "samples_dropped": 10,
        "inv/dropped_samples/stale": 3,
        "inv/staleness_max": 2,
        "inv/ratio_max": 1.3,
        "inv/entropy": 1.5,
        "inv/degenerate_batches": 1,
    },
    {
        "step": 3,
        "samples": 5,
        "reward_mean": 1.0,
        "samples_dropped": 11,
        "inv/dropped_samples/stale": 3,
        "inv/staleness_max": 1,
        "inv/ratio_max": 1.0,
        "inv/entropy": 1.2,
        "inv/degenerate_batches": 1,
    },
]
EVALS = [
    {
        "step": 0,
        "policy_version": 0,
        "eval/solved": 0.25,
        "eval/solved_lo": 0.2,
        "eval/solved_hi": 0.3,
        "eval/seconds": 9.0,
    },
    {
        "step": 3,
        "policy_version": 3,
        "eval/solved": 0.75,
        "eval/solved_lo": 0.7,
        "eval/solved_hi": 0.8,
        "eval/seconds": 8.0,
    },
]


def test_split_and_per_step_values():
    premise = {"step": 0, "premise/items": 8.0, "premise/p_helps": 0.03, "policy_version": 0}  # OPD's, before step 1
    rows = [premise, EVALS[0], *TRAIN, EVALS[1]]
    train, evals = split_rows(rows)
    assert [r["step"] for r in train] == [1, 2, 3] and [r["step"] for r in evals] == [0, 3]  # the premise row: neither
    assert per_step(train, "samples_dropped") == [4.0, 6.0, 1.0]  # deltas of 4, 10, 11
    assert per_step(train, "inv/dropped_samples/stale") == [0.0, 3.0, 0.0]
    assert per_step(train, "inv/degenerate_batches") == [0.0, 1.0, 0.0]
    r = per_step(train, "reward_mean")
    assert r[0] == 0.5 and math.isnan(r[1]) and r[2] == 1.0  # null stays a gap, not a 0
    table = {key: vals for _, key, _, *vals in summarize(rows)}
    assert table["samples_dropped (per step)"] == [4.0, 1.0, 11 / 3, 6.0, 1.0]  # first, min, mean, max, last
    assert table["eval/solved"] == [0.25, 0.25, 0.5, 0.75, 0.75]
    assert "eval/solved_lo" not in table and "eval/seconds" not in table


def test_bounds_from_config():
    b = bounds({"queue": {"max_staleness": 2}, "learner": {"eps": 0.2, "eps_high": 0.28, "entropy_floor": 0.5}})
    assert b["inv/staleness_max"] == [(2.0, "cap 2")]
    assert [v for v, _ in b["inv/ratio_max"]] == [1.28, 0.8]
    assert b["inv/entropy"] == [(0.5, "floor")]
    assert "inv/entropy" not in bounds({"learner": {"eps": 0.2, "eps_high": 0.28, "entropy_floor": 0.0}})


def test_write_report_eval_first_and_integer_ticks(tmp_path, monkeypatch):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for row in [EVALS[0], *TRAIN, EVALS[1]]:
            f.write(json.dumps(row) + "\n")
    (tmp_path / "config.json").write_text(
        json.dumps({"queue": {"max_staleness": 2}, "learner": {"eps": 0.2, "eps_high": 0.28}})
    )
    import matplotlib.figure

    ticks, lines = [], []
    save = matplotlib.figure.Figure.savefig

    def spy(fig, path, *a, **k):
        for ax in fig.axes:
            ticks.extend(t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1])
            lines.extend(ln.get_ydata()[0] for ln in ax.get_lines() if ln.get_linestyle() == "--")
        return save(fig, path, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    paths = write_report(str(tmp_path))
    names = [p.rsplit("/", 1)[1] for p in paths]
    assert names[:2] == ["eval.png", "reward.png"] and names[-1] == "summary.md"
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert 2.0 in lines and 1.28 in lines and 0.8 in lines  # staleness cap, clip range drawn
    assert "3 steps, 2 evaluations." in open(paths[-1]).read()


def _run(tmp_path, name, algo, rows, learner=None):
    d = tmp_path / name
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    (d / "config.json").write_text(json.dumps({"trainer": {"algo": algo}, "learner": learner or {}}))
    return str(d)


def test_invariant_matrix_one_row_per_mode_with_verdicts(tmp_path):
    from clawray.report import matrix, matrix_markdown, write_reports

    rl = _run(
        tmp_path,
        "rl",
        "rl",
        [
            {
                "step": 1,
                "inv/entropy": 2.0,
                "inv/nonzero_reward_frac": 1.0,
                "inv/adv_std": 0.9,
                "inv/logprob_mismatch_kl": 0.001,
                "inv/clip_frac": 0.0,
                "inv/effective_token_rate": 1.0,
            },
            {
                "step": 2,
                "inv/entropy": 1.2,
                "inv/nonzero_reward_frac": 0.5,
                "inv/adv_std": 0.7,
                "inv/logprob_mismatch_kl": 0.002,
                "inv/clip_frac": 0.1,
                "inv/effective_token_rate": 0.8,
            },
        ],
    )
    opd = _run(
        tmp_path,
        "opd",
        "opd",
        [
            {
                "step": 1,
                "inv/entropy": 2.0,
                "inv/nonzero_reward_frac": 0.0,
                "inv/adv_std": 0.3,
                "inv/logprob_mismatch_kl": 0.05,
                "inv/clip_frac": 0.3,
                "inv/effective_token_rate": 0.4,
                "inv/behaviour_entropy": 1.0,
            },
            {
                "step": 2,
                "inv/entropy": 0.9,
                "inv/nonzero_reward_frac": 0.0,
                "inv/adv_std": 0.3,
                "inv/logprob_mismatch_kl": None,
                "inv/clip_frac": 0.1,
                "inv/effective_token_rate": 0.4,
                "inv/behaviour_entropy": 0.4,
            },
        ],
        learner={"entropy_floor": 1.0},
    )
    topk = _run(
        tmp_path,
        "topk",
        "opd_topk",
        [
            {"step": 1, "inv/adv_std": 0.0, "inv/effective_token_rate": 0.9, "opd/topk_kl": 0.2},
            {"step": 2, "inv/adv_std": 0.0, "inv/effective_token_rate": 0.8, "opd/topk_kl": 0.1},
        ],
    )
    table = matrix([rl, opd])
    (m1, _, r1), (m2, _, r2) = table
    # top-k distillation: no advantage at all; its signal is the teacher's KL (mean 0.15 >= 0.001)
    (_, _, r3), *_ = matrix([topk])
    assert r3["signal"] == ("top-k KL 0.15", "✓") and r3["effective_samples"] == ("token rate 0.85", "✓")
    # a run whose steps never measured the mismatch KL says so (was "KL max 0 (0 of 2 steps)", passed)
    clip_only = _run(
        tmp_path, "clip_only", "rl", [{"step": 1, "inv/clip_frac": 0.02}, {"step": 2, "inv/clip_frac": 0.04}]
    )
    (_, _, r4), *_ = matrix([clip_only])
    assert r4["on_policy_gap"] == ("KL not measured, clip 0.030", "✓")
    assert (m1, m2) == ("rl", "opd")
    # rl: entropy 2.0 -> 1.2 (>= 1.0), non-zero 0.75, adv std 0.8, KL max 0.002, clip 0.05, rate 0.9
    assert {c: v for c, (_, v) in r1.items()} == {
        "entropy": "✓",
        "signal": "✓",
        "on_policy_gap": "✓",
        "effective_samples": "✓",
        "behaviour": "–",
    }
    assert (
        r1["signal"][0] == "non-zero 0.75, adv std 0.8"
        and r1["on_policy_gap"][0] == "KL max 0.002 (2 of 2 steps), clip 0.050"
    )
    # opd: 0.9 is under the floor 1.0; no rewards is fine for OPD; KL 0.05 > 0.01 and clip 0.2 mean;
    # rate 0.4 < 0.5; behaviour entropy 1.0 -> 0.4 < 0.5 x 1.0
    assert {c: v for c, (_, v) in r2.items()} == {
        "entropy": "●",
        "signal": "✓",
        "on_policy_gap": "●",
        "effective_samples": "●",
        "behaviour": "●",
    }
    # the opd run measured the mismatch at one step of two
    assert r2["on_policy_gap"][0] == "KL max 0.05 (1 of 2 steps), clip 0.200"
    lines = matrix_markdown(table)
    assert lines[0] == "| mode | run | entropy | signal | on_policy_gap | effective_samples | behaviour |"
    assert lines[2].startswith("| rl | rl | ✓ 2 → 1.2 |")
    written = write_reports([rl, opd])
    html = open(tmp_path / "rl" / "report" / "index.html").read()
    assert "<td class='risk'>● 2 → 0.9</td>" in html and "../../opd/report/entropy.png" in html
    assert "## Invariant matrix" in open(tmp_path / "rl" / "report" / "summary.md").read()
    assert str(tmp_path / "rl" / "report" / "index.html") in written


def test_eval_plot_against_steps_and_wall_minutes(tmp_path, monkeypatch):
    rows = [{**EVALS[0], "time/elapsed_s": 90.0}, *TRAIN, {**EVALS[1], "time/elapsed_s": 570.0}]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    import matplotlib.figure

    figs = []
    save = matplotlib.figure.Figure.savefig

    def spy(fig, path, *a, **k):
        if path.endswith("eval.png"):
            figs.append([(ax.get_xlabel(), [list(ln.get_xdata()) for ln in ax.get_lines()]) for ax in fig.axes])
        return save(fig, path, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    write_report(str(tmp_path))
    (axes,) = figs
    # one measure with a step column and a wall-time column (90 s -> 1.5 min, 570 s -> 9.5 min)
    assert [xs for _, xs in axes] == [[[0, EVALS[1]["step"]]], [[1.5, 9.5]]]
    assert [label for label, _ in axes] == ["step (policy updates)", "wall time (minutes since start)"]


def test_tracker_rows_carry_elapsed_seconds_continued_on_resume(tmp_path, monkeypatch):
    import time as _time

    from clawray.metrics_log import MetricsLog

    now = [1000.0]
    monkeypatch.setattr(_time, "monotonic", lambda: now[0])
    t = MetricsLog(str(tmp_path), "disabled")
    now[0] = 1012.5
    t.log({"loss": 1.0}, step=1)
    now[0] = 1020.0
    t.log({"loss": 2.0}, step=2)
    now[0] = 5000.0  # a resume from step 1 continues from that row's 12.5 s
    r = MetricsLog(str(tmp_path), "disabled", resume_step=1)
    now[0] = 5003.0
    r.log({"loss": 3.0}, step=2)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(x["step"], x["time/elapsed_s"]) for x in rows] == [(1, 12.5), (2, 15.5)]


def test_the_gate_plot_draws_candidates_against_the_served_version(tmp_path, monkeypatch):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for row in TRAIN:
            f.write(json.dumps(row) + "\n")
    versions = [
        {"version": 0, "decision": "baseline", "mean": 0.5},
        {"version": 1, "decision": "promoted", "candidate_mean": 0.6, "promoted_mean": 0.5, "reason": "promoted: ok"},
        {
            "version": 2,
            "decision": "rejected",
            "candidate_mean": 0.2,
            "promoted_mean": 0.6,
            "reason": "rejected: worse",
        },
        {"version": 2, "decision": "withdrawn", "reason": "the sync failed"},
    ]
    with open(tmp_path / "versions.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in versions) + "\n")
    import matplotlib.figure

    drawn = {}
    save = matplotlib.figure.Figure.savefig

    def spy(fig, path, *a, **k):
        if str(path).endswith("deploy.png"):
            ax = fig.axes[0]
            drawn["served"] = [list(ln.get_ydata()) for ln in ax.get_lines()]
            drawn["points"] = [c.get_offsets().tolist() for c in ax.collections]
        return save(fig, path, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    paths = write_report(str(tmp_path))
    assert "deploy.png" in [p.rsplit("/", 1)[1] for p in paths]
    assert drawn["points"] == [[[1.0, 0.6]], [[2.0, 0.2]]]  # promoted v1, rejected v2, by decision order
    assert [0.5, 0.6] in drawn["served"] and [0.5, 0.5] in drawn["served"]  # served means, baseline line
    summary = open(paths[-1]).read()
    assert (
        "Promotion gate: 1 promoted, 1 rejected, serving v1" in summary and "- v2 rejected: rejected: worse" in summary
    )
    (tmp_path / "versions.jsonl").unlink()
    assert "deploy.png" not in [p.rsplit("/", 1)[1] for p in write_report(str(tmp_path))]


def test_an_opd_run_gets_the_distillation_panel(tmp_path):
    """OPD/Combine rows carry adv/opd_abs_mean: their report adds opd.png and its summary rows (the
    teacher's failures per step, not the running total); an RL run's rows (NaN) get none."""
    rows = [
        {"step": 1, "judge/hint_acceptance_rate": 0.9, "adv/opd_abs_mean": 1.0, "adv/rl_abs_mean": 0.0},
        {"step": 2, "judge/hint_acceptance_rate": 0.6, "adv/opd_abs_mean": 0.25, "adv/rl_abs_mean": 0.0},
    ]
    rows[0]["teacher/errors"], rows[1]["teacher/errors"] = 2, 5
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    names = [p.rsplit("/", 1)[1] for p in write_report(str(tmp_path))]
    assert names[-2:] == ["opd.png", "summary.md"] and "reward.png" in names
    table = {(panel, key): vals for panel, key, _, *vals in summarize(rows)}
    assert table[("opd", "adv/opd_abs_mean")] == [1.0, 0.25, 0.625, 1.0, 0.25]  # first, min, mean, max, last
    assert table[("opd", "teacher/errors (per step)")] == [2, 2, 2.5, 3, 3]
    rl = [{"step": 1, "adv/opd_abs_mean": float("nan"), "adv/rl_abs_mean": 1.0}]
    assert "opd" not in panels(rl) and list(panels(rows))[-1] == "opd"

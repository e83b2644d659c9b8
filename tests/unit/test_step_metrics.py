"""The step's metrics row and line (clawray.step_metrics): judge figures, drop counts, generation
throughput between steps and the printed step line, hand-computed."""

import pytest

from clawray.step_metrics import GenerationMeter, drop_counts, judge_metrics, step_line, traffic


def test_judge_metrics_hand_computed():
    judges = [
        {
            "turns": 2,
            "votes": 6,
            "invalid_votes": 1,
            "agree_votes": 4,
            "hint_turns": 2,
            "hint_votes": 6,
            "hint_invalid_votes": 2,
            "hints_accepted": 1,
            "hint_chars": 30,
        },
        {
            "turns": 1,
            "votes": 3,
            "invalid_votes": 2,
            "agree_votes": 1,
            "hint_turns": 2,
            "hint_votes": 6,
            "hint_invalid_votes": 0,
            "hints_accepted": 2,
            "hint_chars": 24,
        },
    ]
    teachers = [{"scored": 2, "seconds": 0.5}, {"scored": 1, "seconds": 0.25}]
    out = judge_metrics(
        judges,
        teachers,
        {"dispatch/hint+score": 2, "dispatch/nohint": 1, "samples": 3, "teacher_errors": 1, "hint_mixtures": 1},
    )
    assert out == {
        "judge/votes_per_turn": 3.0,
        "judge/invalid_vote_rate": 3 / 9,
        "judge/agreement_rate": 5 / 6,
        "judge/hint_acceptance_rate": 0.75,
        "judge/hint_invalid_vote_rate": 2 / 12,
        "judge/mean_hint_chars": 18.0,
        "timing/teacher_scoring_s": 0.75,
        "teacher/scored": 3,
        "teacher/errors": 1,
        "teacher/hint_mixtures": 1,
        "judge/dispatch/hint+score": 2,
        "judge/dispatch/nohint": 1,
    }
    # nothing judged yet: no rate is divided by zero; all votes invalid: agreement is NaN, not 0
    assert judge_metrics([{}], None, {}) == {}
    nan = judge_metrics([{"turns": 1, "votes": 3, "invalid_votes": 3}], None, {})["judge/agreement_rate"]
    assert nan != nan
    # a teacher killed before its counters first answered reads as {} (run_stats' default): the step
    # goes on (it raised KeyError('seconds') and ended bench/chaos.py's teacher+queue+tracker run)
    assert judge_metrics([{}], [{}, {"seconds": 0.5, "scored": 2}], {"teacher_errors": 1}) == {
        "timing/teacher_scoring_s": 0.5,
        "teacher/scored": 2,
        "teacher/errors": 1,
        "teacher/hint_mixtures": 0,
    }


def test_drop_counts_merge_tracker_queue_and_driver_reasons():
    tstats = {"dropped/no_next_state": 4, "dropped/branch": 1, "samples": 9}
    qstats = {"dropped": {"stale": 2}}
    assert drop_counts(tstats, qstats, 3, None) == {
        "dropped/no_next_state": 4,
        "dropped/branch": 1,
        "dropped/stale": 2,
        "dropped/all_masked": 3,
    }
    assert drop_counts({}, {"dropped": {}}, 0, 5) == {"dropped/all_masked": 0, "dropped/zero_variance": 5}


def test_generation_meter_counts_tokens_between_steps():
    meter = GenerationMeter()
    first = meter.update([{"name": "rollout-0", "tokens": 100, "gen_seconds": 2.0, "cancelled": 1}])
    assert first == {
        "rollout/tokens": 100.0,
        "rollout/tokens_per_s": 50.0,
        "serve/cancelled": 1.0,
        "rollout/engine_errors": 0.0,
    }
    both = [
        {"name": "rollout-0", "tokens": 160, "gen_seconds": 5.0, "errors": 2},  # +60 tokens in 3 s
        {"name": "rollout-1", "tokens": 40, "gen_seconds": 0.0},  # no generation time: no rate
    ]
    out = meter.update(both)
    assert out["rollout/tokens"] == 100.0 and out["rollout/tokens_per_s"] == pytest.approx(20.0)
    assert out["rollout/engine_errors"] == 2.0


def test_step_line_hand_written():
    metrics = {
        "samples": 4,
        "reward_mean": 0.5,
        "sync/pause_s": 0.39,
        "sync/interrupted_requests": 2.0,
        "policy_version": 1,
        "inv/staleness_mean": 1.0,
        "inv/effective_sample_rate": 1.0,
        "samples_dropped": 4,
    }
    line = step_line(
        1,
        3,
        metrics,
        {"dropped/no_next_state": 4, "dropped/stale": 0},
        {"loss": -0.487},
        True,
        "",
        0.41,
        None,
        39.0,
        50.3,
    )
    assert line == (
        "[clawray] step 1/3 | samples 4 | reward +0.50 | loss -0.4870 | sync 0.41s pause 0.39s (2 interrupted) | "
        "policy v1 | staleness 1.0 | trained 100% of judged | dropped so far 4 (no_next_state 4) | "
        "wait 39.0s train 50.3s"
    )
    metrics.update({"sync/interrupted_requests": 0.0, "samples_dropped": 0})
    line = step_line(2, -1, metrics, {}, {}, False, "degenerate", 0.0, "sync timed out", 1.0, 0.0)
    assert "step 2 | " in line and "reward  n/a | loss   --    |" in line
    assert "sync 0.00s FAILED pause 0.39s |" in line and "policy v1 (skipped: degenerate) |" in line
    assert "dropped so far 0 |" in line
    metrics.update({"sync/inflight_requests": 3.0})  # sync.mode inflight: nothing paused, 3 went on
    line = step_line(3, -1, metrics, {}, {}, False, "", 0.5, None, 1.0, 0.0)
    assert "sync 0.50s pause 0.39s (3 in flight) |" in line
    # deploy.gate: the version users are served and the candidate's decision
    metrics.update({"deploy/serving_version": 3.0, "deploy/promoted": 0.0})
    assert "policy v1 (serving v3, candidate rejected) |" in step_line(4, -1, metrics, {}, {}, False, "", 0, None, 0, 0)
    metrics.update({"deploy/promoted": 1.0})
    assert "policy v1 (serving v3, candidate promoted) |" in step_line(4, -1, metrics, {}, {}, False, "", 0, None, 0, 0)
    del metrics["deploy/promoted"]  # a version the gate does not probe (deploy.every_versions)
    assert "policy v1 (serving v3) |" in step_line(4, -1, metrics, {}, {}, False, "", 0, None, 0, 0)


def test_traffic_funnel_from_the_replicas_and_the_tracker_and_its_part_of_the_step_line():
    serve = {
        "requests": 14,
        "main_turns": 10,
        "side_turns": 3,
        "side_turns/memory_flush": 1,
        "side_turns/compaction_summary": 2,
        "unattributable": 1,
        "prompts_spliced": 4,
    }
    tracker = {"paired": 8, "paired_after_rewrite": 1, "judged": 7, "samples": 5, "dropped/zero_score": 2}
    funnel = traffic(serve, tracker)
    assert funnel == {
        "traffic/requests": 14,
        "traffic/main": 10,
        "traffic/side": 3,
        "traffic/unattributable": 1,
        "traffic/paired": 8,
        "traffic/paired_after_rewrite": 1,
        "traffic/judged": 7,
        "traffic/samples": 5,
        "traffic/side/memory_flush": 1,
        "traffic/side/compaction_summary": 2,
    }
    assert traffic({}, {})["traffic/main"] == 0
    metrics = {
        "samples": 2,
        "reward_mean": 1.0,
        "sync/pause_s": 0.0,
        "policy_version": 3,
        "inv/staleness_mean": 0.0,
        "inv/effective_sample_rate": 0.5,
        "samples_dropped": 2,
        **funnel,
    }
    line = step_line(3, 5, metrics, {"dropped/zero_score": 2}, {"loss": 0.1}, True, "", 0.1, None, 1.0, 2.0)
    assert "| turns 10 (side 3, unattributable 1) paired 8 judged 7 | dropped so far 2 (zero_score 2) |" in line

"""clawray eval: the Wilson interval, the model/checkpoint resolution and a tiny-model run (hf)."""

import json
import os

import pytest

from clawray.evaluation import Evaluator, flat_metrics, format_change, resolve_model_dir, summarize, wilson_interval


def test_wilson_interval_hand_computed():
    # 56/100: p = .56, z^2 = 3.8415; center = (.56 + .019207) / 1.038415 = .55778,
    # half = 1.96 * sqrt(.002464 + .000096) / 1.038415 = .09550 -> [.4623, .6533]
    lo, hi = wilson_interval(56, 100)
    assert (round(lo, 3), round(hi, 3)) == (0.462, 0.653)
    # 0/10: center = half = (z^2/20) / (1 + z^2/10) = .13877 -> [0, .2775]; 10/10 mirrors it
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0  # exact, no residue
    assert wilson_interval(10, 10) == pytest.approx((0.72247, 1.0), abs=1e-5)
    # 1/2: center .5, half = 1.96 * sqrt(.125 + .96) / 2.92073 = .69904 / ... -> [.0945, .9055]
    assert wilson_interval(1, 2) == pytest.approx((0.09453, 0.90547), abs=1e-5)
    for bad in [(1, 0), (-1, 5), (6, 5)]:
        with pytest.raises(ValueError):
            wilson_interval(*bad)


def test_summarize_and_formatting():
    scores = [{"solved": True, "correct": True}] * 56 + [{"solved": False, "correct": True}] * 44
    m = summarize(scores)
    assert m["solved"]["mean"] == 0.56 and m["solved"]["n"] == 100 and m["solved"]["successes"] == 56
    assert (round(m["solved"]["lo"], 3), round(m["solved"]["hi"], 3)) == (0.462, 0.653)
    assert m["correct"]["mean"] == 1.0 and m["correct"]["hi"] == 1.0
    flat = flat_metrics(m)
    assert set(flat) == {
        "eval/solved",
        "eval/solved_lo",
        "eval/solved_hi",
        "eval/correct",
        "eval/correct_lo",
        "eval/correct_hi",
    }
    after = summarize([{"solved": True, "correct": True}] * 90 + [{"solved": False, "correct": True}] * 10)
    lines = format_change(m, after)
    assert lines[0] == "solved: 56.0% [46.2, 65.3] -> 90.0% [82.6, 94.5] (+34.0 points, CIs do not overlap)"
    assert lines[1].endswith("(+0.0 points, CIs overlap)")
    with pytest.raises(ValueError):
        summarize([{"x": 2.0}])


def test_resolve_model_dir(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert resolve_model_dir(str(model)) == str(model)
    ckpts = tmp_path / "run" / "checkpoints"
    for name in ("ckpt-000001", "ckpt-000002"):
        (ckpts / name / "model").mkdir(parents=True)
        (ckpts / name / "model" / "config.json").write_text("{}")
    assert resolve_model_dir(str(ckpts / "ckpt-000001")) == str(ckpts / "ckpt-000001" / "model")
    (ckpts / "latest").write_text("ckpt-000001\n")
    assert resolve_model_dir(str(ckpts)) == str(ckpts / "ckpt-000001" / "model")
    with pytest.raises(FileNotFoundError, match="neither a model folder"):
        resolve_model_dir(str(tmp_path / "nothing"))


def test_requests_are_seeded_per_sample_and_rendered_with_the_chat_template(tiny_model):
    from transformers import AutoTokenizer

    from clawray.envs import make_env

    tok = AutoTokenizer.from_pretrained(tiny_model)
    ev = Evaluator(make_env("sums"), tok, n=3, num_prompts=2, temperature=0.5, seed=4, max_tokens=5)
    reqs = ev.requests()
    assert [r.seed for r in reqs] == [4 * 1_000_003 + k for k in range(6)]
    text = tok.apply_chat_template(make_env("sums").opening(ev.tasks[1]), add_generation_prompt=True, tokenize=False)
    assert reqs[3].prompt_ids == tok.encode(text, add_special_tokens=False)
    assert all(r.temperature == 0.5 and r.max_tokens == 5 for r in reqs)
    # replies are scored on the parsed text: a stop token is not part of it
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    assert ev.reply_message(tok.encode("44", add_special_tokens=False) + [eos])["content"] == "44"
    result = ev.run(
        lambda rs: (
            [
                {
                    "response_ids": tok.encode(str(ev.tasks[0].answer), add_special_tokens=False) + [eos],
                    "policy_version": 3,
                }
            ]
            * len(rs)
        )
    )
    assert result["samples"] == 6 and result["policy_versions"] == [3]
    assert result["metrics"]["solved"]["successes"] == 3  # the right number for prompt 0's 3 samples only
    from clawray.envs.base import Environment

    class Empty(Environment):
        def all_tasks(self):
            return []

    with pytest.raises(ValueError, match="has no eval prompts"):
        Evaluator(Empty(), tok)


def test_cli_eval_on_the_tiny_model_with_hf(tiny_model, tmp_path):
    from clawray.cli import main

    out = tmp_path / "eval.json"
    rc = main(
        [
            "eval",
            tiny_model,
            "--env",
            "sums",
            "--backend",
            "hf",
            "--num-prompts",
            "3",
            "--n",
            "2",
            "--max-tokens",
            "4",
            "--temperature",
            "1.0",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["prompts"] == 3 and result["samples"] == 6 and result["split"] == "eval"
    assert set(result["metrics"]) == {"solved", "correct", "number_only"}
    for m in result["metrics"].values():
        assert m["n"] == 6 and 0 <= m["lo"] <= m["mean"] <= m["hi"] <= 1
    from clawray.envs import make_env

    held = {t.question for t in make_env("sums").prompts("eval")}
    assert all(r["question"] in held for r in result["replies"])
    assert main(["eval", str(tmp_path / "missing"), "--env", "sums", "--backend", "hf"]) == 1
    assert os.path.exists(out)


def test_run_evaluations_schedule_record_and_failure(tmp_path, capsys):
    from types import SimpleNamespace

    from clawray.evaluation import RunEvaluations

    class FakeEvaluator:
        def __init__(self, fail=False):
            self.fail = fail

        def run(self, generate):
            if self.fail:
                raise RuntimeError("no engine")
            return {
                "metrics": {"solved": {"mean": 0.5, "lo": 0.1, "hi": 0.9}},
                "seconds": 1.0,
                "env": "sums",
                "split": "eval",
                "prompts": 2,
                "n": 1,
                "temperature": 0.7,
            }

    evals = RunEvaluations(SimpleNamespace(enabled=True, every_steps=2), None, str(tmp_path))
    assert [evals.due(s, last=False) for s in (1, 2, 3, 4)] == [False, True, False, True]
    assert not evals.due(4, last=True)  # the closing evaluation covers the last step
    logged = []
    evals._evaluator = FakeEvaluator()
    record = evals.run("step", 4, 3, "unused", None, lambda m, step: logged.append((step, m)))
    assert (record["when"], record["step"], record["policy_version"]) == ("step", 4, 3)
    assert logged == [
        (
            4,
            {
                "eval/solved": 0.5,
                "eval/solved_lo": 0.1,
                "eval/solved_hi": 0.9,
                "eval/seconds": 1.0,
                "policy_version": 3,
            },
        )
    ]
    with open(tmp_path / "eval.json") as f:
        assert json.load(f)[0]["step"] == 4
    evals._evaluator = FakeEvaluator(fail=True)  # a failed evaluation never ends the run
    assert evals.run("after", 5, 3, "unused", None, None) is None and len(evals.results) == 1
    assert "eval (after) failed: RuntimeError: no engine" in capsys.readouterr().out
    off = RunEvaluations(SimpleNamespace(enabled=False, every_steps=1), None, str(tmp_path))
    assert off.run("before", 0, 0, "unused", None, None) is None


def test_a_resume_keeps_the_runs_evaluations_up_to_its_checkpoint_and_fills_the_one_a_kill_lost(tmp_path, capsys):
    """A resumed run used to start ``eval.json`` afresh: the run's first (base-model) evaluation was
    lost and the closing before -> after lines compared the resumed policy with the last one. Now the
    evaluations up to the checkpoint's step stay; those after it (weights the resume discards) go;
    the resumed policy is evaluated only when a kill came before its evaluation was written."""
    from types import SimpleNamespace

    from clawray.closing import eval_change_lines
    from clawray.evaluation import RunEvaluations

    def record(when, step, version, solved):
        return {
            "when": when,
            "step": step,
            "policy_version": version,
            "metrics": {"solved": {"mean": solved, "lo": solved - 0.1, "hi": solved + 0.1, "n": 10}},
            "env": "sums",
            "split": "eval",
            "samples": 10,
        }

    class FakeEvaluator:
        calls = 0

        def run(self, generate):
            FakeEvaluator.calls += 1
            out = record("x", 0, 0, 0.6)
            return {k: out[k] for k in ("metrics", "env", "split", "samples")} | {
                "seconds": 1.0,
                "prompts": 5,
                "n": 2,
                "temperature": 0.7,
            }

    cfg = SimpleNamespace(enabled=True, every_steps=2)
    written = [record("before", 0, 0, 0.2), record("step", 2, 2, 0.4), record("step", 4, 4, 0.5)]
    (tmp_path / "eval.json").write_text(json.dumps(written))
    # killed after step 3's checkpoint: step 4's evaluation judged weights the resume discards
    evals = RunEvaluations(cfg, None, str(tmp_path))
    held = evals.results
    evals.resume(3)
    assert evals.results is held and [(r["step"], r["policy_version"]) for r in held] == [(0, 0), (2, 2)]
    evals._evaluator = FakeEvaluator()
    log = lambda m, step: None  # noqa: E731
    rec = evals.run("resume", 3, 3, "unused", None, log)  # step 3's policy was never evaluated: it is now
    assert FakeEvaluator.calls == 1 and (rec["when"], rec["step"], rec["policy_version"]) == ("resume", 3, 3)
    evals.run("after", 5, 5, "unused", None, log)
    on_disk = json.loads((tmp_path / "eval.json").read_text())
    assert [(r["when"], r["step"]) for r in on_disk] == [("before", 0), ("step", 2), ("resume", 3), ("after", 5)]
    assert eval_change_lines(evals.results)[0].endswith(
        "step 0 (v0) -> step 5 (v5)"
    )  # the run's gain, not the resume's

    # killed after step 2's checkpoint and its evaluation: the resume does not evaluate that policy again
    again = RunEvaluations(cfg, None, str(tmp_path))
    again.resume(2)
    again._evaluator = FakeEvaluator()
    assert (
        again.run("resume", 2, 2, "unused", None, log) is None and FakeEvaluator.calls == 2
    )  # resume and after above; none here
    assert [r["step"] for r in again.results] == [0, 2]
    # a resume before the first checkpoint keeps the base evaluation and skips its repeat
    first = RunEvaluations(cfg, None, str(tmp_path))
    first.resume(0)
    assert [r["step"] for r in first.results] == [0] and first.evaluated(0, 0)

    # an unreadable eval.json is said and left out; a missing one keeps nothing
    (tmp_path / "eval.json").write_text("{not json")
    broken = RunEvaluations(cfg, None, str(tmp_path))
    broken.resume(3)
    assert broken.results == [] and "eval.json not read on resume (JSONDecodeError" in capsys.readouterr().out
    missing = RunEvaluations(cfg, None, str(tmp_path / "nowhere"))
    missing.resume(3)
    assert missing.results == []


def test_cli_eval_refuses_bad_arguments_before_it_evaluates_and_names_an_unloadable_folder(
    tiny_model, tmp_path, capsys
):
    """``--out DIR`` failed with IsADirectoryError after the whole evaluation had run (its results
    lost); ``--temperature -1`` was accepted (the hf engine ran it greedy and the JSON said T=-1); a
    folder with config.json but no weights was a traceback."""
    import shutil

    from clawray.cli import main

    args = ["eval", tiny_model, "--env", "sums", "--backend", "hf", "--num-prompts", "1", "--n", "1"]
    assert main([*args, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"clawray: --out {tmp_path} is a folder; give a file name"
    assert main([*args, "--out", str(tmp_path / "no" / "e.json")]) == 2
    assert f"the folder {tmp_path / 'no'} does not exist" in capsys.readouterr().err
    assert main([*args, "--temperature", "-1", "--out", str(tmp_path / "e.json")]) == 2
    assert "--temperature -1.0 is negative (0 is greedy)" in capsys.readouterr().err
    assert main([*args, "--temperature", "nan", "--out", str(tmp_path / "e.json")]) == 2
    weightless = tmp_path / "weightless"
    shutil.copytree(tiny_model, weightless)
    for name in os.listdir(weightless):
        if name.endswith(".safetensors"):
            os.remove(weightless / name)
    assert main(["eval", str(weightless), *args[2:], "--out", str(tmp_path / "w.json")]) == 1
    err = capsys.readouterr().err
    assert "clawray: OSError:" in err and "Traceback" not in err and not os.path.exists(tmp_path / "w.json")

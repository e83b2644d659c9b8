import random

import pytest

from clawray.actors.judge import feedback_score
from clawray.envs import ENVIRONMENTS, env_from_config, make_env, split_of
from clawray.envs.base import Problem
from clawray.envs.arith import calculator, feedback, grade, make_problems


def test_problems_are_deterministic_and_answers_match_the_text():
    a, b = make_problems(50, seed=3), make_problems(50, seed=3)
    assert a == b
    assert make_problems(50, seed=4) != a
    p = make_problems(1, seed=0)[0]
    assert isinstance(p.answer, int) and p.question.endswith("?")


def test_calculator():
    assert calculator("2*(3+4)") == "14"
    assert calculator("7/2") == "3.5"
    assert calculator("1/0").startswith("error:")
    assert calculator("__import__('os')").startswith("error:")


def test_grade_and_feedback_drive_the_feedback_judge():
    p = make_problems(1, seed=0)[0]
    good = f"We add and subtract step by step.\nAnswer: {p.answer}"
    md = f"**Steps**\n- add\nAnswer: {p.answer}"
    wrong = f"Answer: {p.answer + 1}"
    assert grade(good, p) == (True, True, False)
    assert grade(md, p) == (True, True, True)
    assert grade(wrong, p) == (True, False, False)
    assert grade("no idea", p) == (False, False, False)
    texts = {k: feedback(v, p) for k, v in {"good": good, "md": md, "wrong": wrong, "none": "no idea"}.items()}
    assert texts["good"][1] is True and all(not texts[k][1] for k in ("md", "wrong", "none"))
    scores = {k: feedback_score([{"role": "user", "content": t}]) for k, (t, _) in texts.items()}
    assert scores == {"good": 1, "md": -1, "wrong": -1, "none": -1}


def test_levels():
    easy = make_problems(20, seed=1, level=1)
    for p in easy:
        x, op, y = p.question.removeprefix("What is ").removesuffix("?").split()
        assert op == "+" and 1 <= int(x) <= 5 and 1 <= int(y) <= 5 and p.answer == int(x) + int(y)
    assert all("How many" in p.question for p in make_problems(5, level=2))
    with pytest.raises(ValueError, match="unknown problem level"):
        make_problems(1, level=4)


ENV_CASES = [("arith", 1), ("arith", 2), ("arith", 3), ("sums", 1), ("brief", 1)]


@pytest.mark.parametrize("name, level", ENV_CASES)
def test_train_and_eval_splits_never_overlap_and_are_deterministic(name, level):
    env = make_env(name, level)
    train, held = env.prompts("train", seed=0), env.prompts("eval", seed=0)
    assert train and held
    assert not {t.question for t in train} & {t.question for t in held}
    assert all(env.split(t) == "train" for t in train) and all(env.split(t) == "eval" for t in held)
    # another seed orders (or, for generated sets, selects) differently but never crosses the split
    other = env.prompts("eval", seed=1)
    assert all(split_of(t.question, env.eval_fraction) == "eval" for t in other)
    assert env.prompts("eval", seed=0) == held
    if env.all_tasks() is not None:  # a finite task set: the two splits are all of it
        assert sorted(t.question for t in train + held) == sorted(t.question for t in env.all_tasks())
        assert sorted(t.question for t in other) == sorted(t.question for t in held)


def test_split_is_a_fixed_hash_of_the_question():
    # pinned values: the split must not change between processes or releases
    env = make_env("arith", 1)
    assert sorted(t.question for t in env.prompts("eval")) == [
        "What is 1 + 2?",
        "What is 2 + 5?",
        "What is 5 + 3?",
        "What is 5 + 4?",
    ]
    assert len(make_env("sums").prompts("eval")) == 117 and len(make_env("sums").prompts("train")) == 508
    assert split_of("x", 0.0) == "train" and split_of("x", 1.0) == "eval"


@pytest.mark.parametrize("name, level", ENV_CASES)
def test_the_simulated_user_draws_train_tasks_only(name, level):
    env = make_env(name, level)
    rng = random.Random(0)
    drawn = [env.sample(rng) for _ in range(300)]
    assert all(env.split(t) == "train" for t in drawn)
    with pytest.raises(ValueError, match="unknown split"):
        env.prompts("test")


def test_arith_sampling_is_the_old_generator_minus_the_eval_split():
    # the simulated user's behaviour is unchanged except that eval-split problems are skipped
    env, rng = make_env("arith", 3), random.Random(7)
    old = [p for p in make_problems(200, seed=7) if env.split(p) == "train"]
    assert [env.sample(rng) for _ in range(len(old))] == old


def test_sums_check_feedback_and_score_agree():
    env = make_env("sums")
    task = env.prompts("eval")[0]  # What is 21 + 23? -> 44
    assert (task.question, task.answer) == ("What is 21 + 23?", 44)
    cases = {
        "44": (True, True, True),
        " 44.\n": (True, True, True),
        "The answer is 44.": (False, True, False),
        "**44**": (False, True, False),
        "45": (False, False, True),
        "I don't know": (False, False, False),
        "": (False, False, False),
    }
    for reply, (solved, correct, number_only) in cases.items():
        assert env.grade(task, reply) == {"solved": solved, "correct": correct, "number_only": number_only}, reply
        text, done = env.feedback(task, reply)
        assert done is solved
        # the feedback judge reads the user's text: +1 exactly when the user's check passed
        assert feedback_score([{"role": "user", "content": text}]) == (1 if solved else -1), (reply, text)
        msgs = env.opening(task) + [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": text},
            {"role": "assistant", "content": "44"},
        ]
        assert env.check(task, msgs) == env.grade(task, reply)  # only the FIRST reply counts
    assert env.opening(task) == [{"role": "user", "content": "What is 21 + 23? Reply with the number only."}]
    assert env.tools is None


def test_arith_env_wraps_the_old_check():
    env = make_env("arith", 1)
    task = env.prompts("eval")[0]
    assert env.opening(task)[0]["content"] == f"{task.question} Reply in one short sentence, no markdown."
    assert env.tools[0]["function"]["name"] == "calculator"
    for reply in [f"It is {task.answer}.", f"**{task.answer}**", "no idea", f"{task.answer + 1}"]:
        has_answer, correct, markdown = grade(reply, task)
        assert env.grade(task, reply) == {
            "solved": correct and not markdown,
            "correct": correct,
            "no_markdown": not markdown,
            "has_answer": has_answer,
        }
        assert env.feedback(task, reply) == feedback(reply, task)
    # a pure tool call as the first reply has no text: unsolved
    assert (
        env.check(task, env.opening(task) + [{"role": "assistant", "content": None, "tool_calls": []}])["solved"]
        is False
    )


def test_unknown_environment():
    assert ENVIRONMENTS == ("arith", "sums", "brief", "terse", "concise", "plain", "student", "teacher")
    with pytest.raises(ValueError, match="unknown environment"):
        make_env("chess")
    with pytest.raises(ValueError, match="unknown problem level"):
        make_env("arith", 4)


def test_env_from_config_takes_the_env_section_with_the_schema_defaults():
    from omegaconf import OmegaConf

    from clawray.config import ConfigError, EnvConfig

    env = env_from_config({"name": "arith"})  # a mapping of some keys: the rest are EnvConfig's
    assert (env.name, env.level) == ("arith", 3)
    assert env_from_config(EnvConfig(name="arith", level=1)).level == 1
    assert env_from_config(OmegaConf.structured(EnvConfig(name="sums"))).name == "sums"  # an omegaconf node
    with pytest.raises(ConfigError, match="nmae"):  # a misspelt key is an error, not the arith default
        env_from_config({"nmae": "sums"})


def test_terse_asks_plainly_and_says_the_preference_only_when_correcting():
    env = make_env("terse")
    task = env.prompts("eval", 0)[0]
    assert env.opening(task) == [{"role": "user", "content": task.question}]  # no stated preference
    assert env.feedback(task, str(task.answer)) == ("Correct, thanks! That is exactly what I wanted.", True)
    said, solved = env.feedback(task, f"{task.question[8:-1]} equals {task.answer}.")
    assert not solved and "please redo it as just the number, no words, no equation" in said
    assert env.grade(task, f"The answer is {task.answer}.") == {"solved": False, "correct": True, "number_only": False}
    assert [t.question for t in env.prompts("eval", 3)] == [t.question for t in make_env("sums").prompts("eval", 3)]


def test_concise_asks_to_be_brief_and_corrects_like_terse():
    env = make_env("concise")
    task = env.prompts("eval", 0)[0]
    assert env.opening(task) == [{"role": "user", "content": f"{task.question} Be brief."}]
    assert env.feedback(task, f"{task.answer}.") == ("Correct, thanks! That is exactly what I wanted.", True)
    said, solved = env.feedback(task, f"{task.question[8:-1]} = {task.answer}")
    assert not solved and said == make_env("terse").feedback(task, f"{task.question[8:-1]} = {task.answer}")[0]
    assert env.grade(task, f"{task.answer + 1}") == {"solved": False, "correct": False, "number_only": True}
    assert [t.question for t in env.prompts("eval", 3)] == [t.question for t in make_env("terse").prompts("eval", 3)]


def test_plain_asks_plainly_and_its_correction_names_what_was_wrong():
    from clawray.envs.plain import ACCEPTED, CORRECTIONS

    env = make_env("plain")
    task = Problem("Zoe has 16 pencils and gives 5 to Tom. How many pencils does Zoe have left?", 11)
    assert env.opening(task) == [{"role": "user", "content": task.question}]  # no stated preference
    assert env.feedback(task, env.preferred_reply(task)) == (ACCEPTED, True)
    # the question's numbers may be repeated; any other number than the answer is wrong
    assert env.grade(task, "Zoe has 11 pencils left after giving 5 to Tom.")["solved"] is True
    assert env.grade(task, "She has 16 - 5 = 11 pencils left.")["solved"] is True
    assert env.grade(task, "16 - 5 = 12, so 11.") == {
        "solved": False,
        "correct": False,
        "no_formatting": True,
        "short": True,
    }
    # the first failed check is named: formatting, length, a missing answer, a wrong number
    assert env.feedback(task, "Zoe has **11** pencils.") == (CORRECTIONS["formatting"], False)
    assert env.feedback(task, "We subtract:\n\\[ 16 - 5 = 11 \\]") == (CORRECTIONS["formatting"], False)
    assert env.feedback(task, "1. Start with 16.\n2. Subtract 5.") == (CORRECTIONS["formatting"], False)
    assert env.feedback(task, "Zoe had 16.\nShe has 11 left.") == (CORRECTIONS["length"], False)
    assert env.feedback(task, " ".join(["word"] * 30) + " 11") == (CORRECTIONS["length"], False)
    assert env.feedback(task, "Zoe gives some of her pencils to Tom.") == (CORRECTIONS["no_answer"], False)
    assert env.feedback(task, "Zoe had 16 pencils and gave 5 away.") == (CORRECTIONS["no_answer"], False)
    assert env.feedback(task, "Zoe has 21 pencils left.") == (CORRECTIONS["wrong"], False)
    # no drawn task has its answer among its own numbers (stating it could not be told from repeating one)
    tasks = env.prompts("train", 0) + env.prompts("eval", 0)
    assert len(tasks) == 400 and not {t.question for t in env.prompts("train", 0)} & {
        t.question for t in env.prompts("eval", 0)
    }
    assert all(str(t.answer) not in t.question.replace("?", " ").replace(".", " ").split() for t in tasks)


@pytest.mark.parametrize(
    "name, level", [("arith", 1), ("arith", 3), ("sums", 3), ("brief", 3), ("terse", 3), ("concise", 3), ("plain", 3)]
)
def test_every_correction_reads_as_a_complaint_and_every_acceptance_as_praise(name, level):
    """The ``feedback`` judge scores the next state by its words: a correction it read as praise or
    as nothing would never be trained (no hint in OPD, a wrong sign in Binary RL)."""
    from clawray.algos.feedback import user_text_sign

    env = make_env(name, level)
    for task in env.prompts("eval", 0)[:10]:
        for reply in (
            "no idea",
            f"The result: {task.answer + 1}",
            f"**{task.answer}**\n\n- so the sum is {task.answer}",
        ):
            said, solved = env.feedback(task, reply)
            assert not solved and user_text_sign(said) == -1, (reply, said)
        said, solved = env.feedback(task, env.preferred_reply(task))
        assert solved and user_text_sign(said) == 1, said


@pytest.mark.parametrize(
    "name, reply, answer, measure, value",
    [
        # a decimal is read whole: "2.5" was read as 2 and 5, its last number 5 (a wrong reply rewarded)
        ("brief", "2.5", 5, "solved", False),
        ("brief", "0.5", 5, "correct", False),
        ("brief", "5.0", 5, "correct", True),  # was read as 5 and 0: a right reply punished
        ("brief", "2 + 3 = 5.0", 5, "solved", True),
        ("sums", "2.5", 5, "correct", False),
        ("sums", "5.0", 5, "solved", True),
        ("terse", "12.5", 12, "correct", False),
        ("concise", "The sum is 12.0.", 12, "correct", True),
        ("brief", "5.", 5, "number_only", True),  # a full stop is no decimal part
    ],
)
def test_a_decimal_reply_is_read_as_one_number(name, reply, answer, measure, value):
    env = make_env(name)
    assert env.grade(Problem("What is x + y?", answer), reply)[measure] is value


def test_arith_reads_a_decimal_answer_whole():
    task = Problem("Mia has 1 apple and gets 1 more. How many?", 2)
    assert grade("Answer: 2.5", task)[1] is False and grade("The answer is 2.0.", task)[1] is True
    assert grade("Answer: 1,200", Problem("?", 1200))[1] is True


def test_data_and_probe_files_with_a_byte_order_mark_load_and_a_bad_line_is_named(tmp_path):
    """A UTF-8 byte-order mark (Windows editors write one) made every data and probe file unreadable:
    JSONDecodeError "Unexpected UTF-8 BOM"; a JSONL line that is not JSON was named nowhere."""
    from clawray.envs.gsm8k import load_items
    from clawray.envs.probe_file import load_probe_items
    from clawray.monitor import load_probe_file

    bom = "\ufeff"
    listed, lines = tmp_path / "list.json", tmp_path / "lines.jsonl"
    listed.write_text(
        bom + '[{"question": "1+1?", "ground_truth_answer": 2}, {"question": "2+2?", "ground_truth_answer": "4"}]'
    )
    lines.write_text(
        bom + '{"question": "1+1?", "ground_truth_answer": 2}\n\n{"question": "3+3?", "ground_truth_answer": 6}\n'
    )
    assert [(p.question, p.answer) for p in load_items(str(listed))] == [("1+1?", 2), ("2+2?", 4)]
    assert [(p.question, p.answer) for p in load_items(str(lines))] == [("1+1?", 2), ("3+3?", 6)]
    lines.write_text('{"question": "1+1?", "ground_truth_answer": 2}\n{"question": "3+3?", \n')
    with pytest.raises(ValueError, match=rf"{lines}:2: not JSON"):
        load_items(str(lines))
    probe = tmp_path / "probe.jsonl"
    probe.write_text(bom + '{"messages": [{"role": "user", "content": "1+1?"}], "answer": "2"}\n')
    assert len(load_probe_items(str(probe))) == 1 and load_probe_file(str(probe))[0][0]["content"] == "1+1?"
    probe.write_text('{"messages": [{"role": "user", "content": "1+1?"}]}\n{"messages": \n')
    with pytest.raises(ValueError, match=rf"{probe}:2: not JSON"):
        load_probe_file(str(probe))

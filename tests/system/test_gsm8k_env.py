"""The seed's student/teacher environments on GSM8K-style files (clawray.envs.gsm8k)."""

import json
import os

import pytest

from clawray.actors.judge import feedback_score
from clawray.config import ConfigError, load_config
from clawray.envs import make_env
from clawray.envs.base import Problem
from clawray.envs.gsm8k import load_items, pupil_answer


def _find_gsm8k() -> str:
    """``../shared/data/gsm8k_test.json`` beside the clone (CI); a worktree nested one level deeper
    finds it in the first ancestor that has it."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    here = os.path.dirname(repo)
    while True:
        path = os.path.join(here, "shared", "data", "gsm8k_test.json")
        if os.path.isfile(path) or os.path.dirname(here) == here:
            return (
                path
                if os.path.isfile(path)
                else os.path.join(os.path.dirname(repo), "shared", "data", "gsm8k_test.json")
            )
        here = os.path.dirname(here)


GSM8K = _find_gsm8k()
needs_gsm8k = pytest.mark.skipif(
    not os.path.isfile(GSM8K),
    reason=f"{GSM8K} (the 1,319 GSM8K test items, beside "
    "CI's clone) is absent; point a run at a copy with env.data_path",
)


@pytest.fixture
def small_file(tmp_path):
    rows = [
        {
            "question": f"Ann has {i} apples and buys {i + 1} more. How many apples now?",
            "ground_truth_answer": str(2 * i + 1),
        }
        for i in range(60)
    ]
    rows.append({"question": "How many cents in 12 dollars?", "ground_truth_answer": "1,200"})
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@needs_gsm8k
@pytest.mark.parametrize("name", ["student", "teacher"])
def test_gsm8k_file_splits_disjoint_and_fixed(name):
    env = make_env(name, data_path=GSM8K)
    assert len(env.items) == 1319
    train, held = env.prompts("train", 0), env.prompts("eval", 0)
    assert len(train) + len(held) == 1319 and 200 <= len(held) <= 330  # eval_fraction 0.2 of 1,319
    assert not {t.question for t in train} & {t.question for t in held}
    assert {t.question for t in env.prompts("eval", 7)} == {t.question for t in held}  # the seed only orders
    first = json.load(open(GSM8K))[0]
    assert first["ground_truth_answer"] == "36" and any(
        t.answer == 36 and t.question == first["question"].strip() for t in train + held
    )


def test_jsonl_and_comma_answers(small_file):
    items = load_items(small_file)
    assert len(items) == 61 and items[0] == Problem("Ann has 0 apples and buys 1 more. How many apples now?", 1)
    assert items[-1].answer == 1200


def test_missing_file_says_how_to_set_data_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="point env.data_path at a local copy"):
        make_env("student", data_path=str(tmp_path / "nope.json"))
    with pytest.raises(FileNotFoundError, match="env.data_path=/path/to/gsm8k_test.json for clawray run, --data-path"):
        make_env("teacher")
    with pytest.raises(ConfigError, match="env.data_path"):
        load_config(overrides=["env.name=student", f"env.data_path={tmp_path}/nope.json"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"question": "q?", "ground_truth_answer": "2.5"}]))
    with pytest.raises(ValueError, match="not an integer"):
        load_items(str(bad))


def test_student_check_and_feedback(small_file):
    env = make_env("student", data_path=small_file)
    task = Problem("Ann has 3 apples and buys 4 more. How many apples now?", 7)
    good = "Ann starts with 3 apples and buys 4 more, so 3 + 4 = 7. She has 7 apples."
    ai = "Certainly! Let's break it down step by step.\n1. 3 + 4 = 7\n**Answer: 7**"
    no_work = "She has 7 apples."
    wrong = "3 + 4 = 8, so she has 8 apples."
    grades = {k: env.grade(task, v) for k, v in {"good": good, "ai": ai, "no_work": no_work, "wrong": wrong}.items()}
    assert grades["good"] == {"solved": True, "correct": True, "shows_work": True, "natural": True}
    assert grades["ai"] == {"solved": False, "correct": True, "shows_work": True, "natural": False}
    assert grades["no_work"] == {"solved": False, "correct": True, "shows_work": False, "natural": True}
    assert grades["wrong"] == {"solved": False, "correct": False, "shows_work": True, "natural": True}
    votes = {
        k: feedback_score([{"role": "user", "content": env.feedback(task, v)[0]}])
        for k, v in {"good": good, "ai": ai, "no_work": no_work, "wrong": wrong}.items()
    }
    assert votes == {"good": 1, "ai": -1, "no_work": -1, "wrong": -1}
    assert env.opening(task)[0]["content"].startswith(task.question + " I'm a student")


def test_teacher_check_and_feedback(small_file):
    env = make_env("teacher", data_path=small_file)
    tasks = env.all_tasks()
    right = next(t for t in tasks if pupil_answer(t) == t.answer)
    wrong = next(t for t in tasks if pupil_answer(t) != t.answer)
    p = pupil_answer(wrong)
    assert 1 <= abs(p - wrong.answer) <= 9
    assert sum(pupil_answer(t) == t.answer for t in tasks) not in (0, len(tasks))  # both kinds occur
    opening = env.opening(wrong)[0]["content"]
    assert f"My pupil's answer: {p}\n" in opening and wrong.question in opening
    kind = f"Good effort! You wrote {p}, but the correct answer is {wrong.answer}. Keep going!"
    vague = "Good effort, keep going!"
    harsh = f"That was careless: {p} is not {wrong.answer}. Good grief."
    assert env.grade(wrong, kind) == {"solved": True, "specific": True, "friendly": True}
    assert env.grade(wrong, vague) == {"solved": False, "specific": False, "friendly": True}
    assert env.grade(wrong, harsh) == {"solved": False, "specific": True, "friendly": False}
    # a right pupil answer needs only the correct number
    assert env.grade(right, f"Well done, {right.answer} is right!")["solved"] is True
    votes = [feedback_score([{"role": "user", "content": env.feedback(wrong, r)[0]}]) for r in (kind, vague, harsh)]
    assert votes == [1, -1, -1]

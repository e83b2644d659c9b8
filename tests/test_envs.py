from clawray.envs.arith import make_problems
from clawray.envs.sim_user import calculator, feedback, grade
from clawray.actors.judge import feedback_score


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
    import pytest
    with pytest.raises(ValueError, match="unknown problem level"):
        make_problems(1, level=4)

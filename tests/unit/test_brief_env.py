"""The CPU demo's `brief` environment: task set, split size, the user's check and its feedback."""

from clawray.actors.judge import feedback_hint, feedback_score
from clawray.envs import make_env
from clawray.envs.base import Problem


def test_task_set_and_split():
    env = make_env("brief")
    tasks = env.all_tasks()
    assert len(tasks) == 486 and len({t.question for t in tasks}) == 486  # 6 phrasings x 9 x 9
    held, train = env.prompts("eval"), env.prompts("train")
    assert len(held) + len(train) == 486 and len(held) == 108  # >= 100 held-out prompts
    assert not {t.question for t in held} & {t.question for t in train}
    assert env.opening(Problem("Add 3 and 4.", 7))[0]["content"] == "Add 3 and 4. Reply with the number only."


def test_check_is_right_and_brief():
    env = make_env("brief")
    task = Problem("What is 3 + 4?", 7)
    cases = {
        "7": (True, True, True, True),
        "3 + 4 = 7": (True, True, True, False),
        "The answer is 7.": (True, True, True, False),
        "In mathematics, when you add 3 and 4 together you get 7.": (False, True, False, False),  # 11 words
        "7\n\nThat is the sum.": (False, True, False, False),  # two lines
        "8": (False, False, True, True),
        "": (False, False, False, False),
    }
    for reply, (solved, correct, brief, number_only) in cases.items():
        assert env.grade(task, reply) == {
            "solved": solved,
            "correct": correct,
            "brief": brief,
            "number_only": number_only,
        }, reply


def test_feedback_scores_and_hints_carry_the_answer():
    env = make_env("brief")
    task = Problem("What is 3 + 4?", 7)
    long = "In mathematics, when you add 3 and 4 together you get 7."
    for reply, vote in (("7", 1), (long, -1), ("8", -1), ("no idea", -1)):
        text, solved = env.feedback(task, reply)
        assert solved is (vote == 1)
        state = [{"role": "user", "content": text}]
        assert feedback_score(state) == vote, text
        if vote == -1:  # the correction is the OPD hint: it names what the reply lacked
            decision, hint = feedback_hint(state)
            assert decision == 1 and "7" in hint and "number" in hint

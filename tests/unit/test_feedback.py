"""The feedback judge's grammar (clawray/algos/feedback.py) on a table of realistic next states,
both signs, with the traps that a word scan gets wrong (issue #24.3). docs/feedback.md shows the
same table."""

from __future__ import annotations

import json

import pytest

from clawray.algos.feedback import feedback_score, message_text, tool_result_sign, user_text_sign


def tool(content):
    return [{"role": "tool", "tool_call_id": "c1", "content": content}]


def user(content):
    return [{"role": "user", "content": content}]


TOOL_RESULTS = [
    # structured: the keys decide, not the words
    ('{"result": {"temp_c": 21}, "error": null}', 1),  # the input: a clean success
    ('{"result": "error handling added", "error": null}', 1),
    ('{"ok": true, "errors": []}', 1),
    ('{"stdout": "done", "stderr": "", "exit_code": 0}', 1),
    ('{"status": "success", "message": "0 errors"}', 1),
    ('{"status_code": 200, "body": "Internal error page cached"}', 1),
    ('{"error": "file not found: a.txt"}', -1),
    ('{"error": {"code": 404, "message": "missing"}}', -1),
    ('{"ok": false}', -1),
    ('{"success": false, "reason": "quota"}', -1),
    ('{"isError": true, "content": [{"type": "text", "text": "boom"}]}', -1),
    ('{"status": "failed"}', -1),
    ('{"stdout": "", "stderr": "x", "exit_code": 2}', -1),
    ('{"returncode": 127}', -1),
    ('{"status_code": 500}', -1),
    # exit codes in text
    ("Command exited with code 0\nerror.log rotated", 1),
    ("Process exited with code 1", -1),
    ("exit status: 2", -1),
    # text: negations and zero counts are not failures
    ("42", 1),
    ("", 1),
    ("Wrote 3 files. No errors.", 1),
    ("12 passed, 0 failed in 0.4s", 1),
    ("errors: 0, warnings: 2", 1),
    ("error: null", 1),
    ("Finished without error", 1),
    ("created src/errors.go and src/error_page.tsx", 1),  # file names are not failures
    # text failures
    ("error: division by zero", -1),
    ("Traceback (most recent call last):\n  File 'x.py'\nValueError: bad", -1),
    ("3 passed, 2 failed", -1),
    ("bash: foo: command not found", -1),
    ("cat: a.txt: No such file or directory", -1),
    ("open /etc/shadow: permission denied", -1),
    ("Error: no such file", -1),
]


@pytest.mark.parametrize("content, sign", TOOL_RESULTS)
def test_tool_results(content, sign):
    assert tool_result_sign(content) == sign
    assert feedback_score(tool(content)) == sign


USER_TEXTS = [
    ("Correct, thanks!", 1),
    ("👍", 1),
    ("Great, that works now.", 1),
    ("Nothing wrong with it, thanks", 1),
    ("No errors this time, perfect.", 1),
    ("That's not wrong, well done", 1),
    ("That's wrong. Please try again.", -1),
    ("not correct", -1),
    ("Not quite right: the total is 12.", -1),  # "right" after a negation is a complaint
    ("That's not what I asked for.", -1),
    ("It still doesn't work", -1),
    ("The number is right, but I asked for no markdown.", -1),
    ("I get an error when I run it", -1),
    ("thumbs down", -1),
    ("No thanks.", None),  # a decline, not praise
    ("Right, now add 9 + 6.", 1),
    ("That's right.", 1),
    ("The answer looks correct to me.", 1),
    ("It worked!", 1),
    ("ok thanks, now the next one", 1),
    ("[Fri 2026-12-04 00:10 UTC] Correct!", 1),  # OpenClaw's envelope before the praise
    # praise words in requests, questions, conditions and plain use are no signal (a bag of words read
    # "Say thanks in one word." as thanks: a +1 trained in bench/openclaw_turns.py --train)
    ("Say thanks in one word.", None),
    ("[Fri 2026-12-04 00:10 UTC] Say thanks in one word.", None),
    ("Is this right?", None),
    ("Does it work now?", None),
    ("Write the correct answer into answer.txt.", None),
    ("Make sure the output is correct.", None),
    ("Tell me if it works.", None),
    ("Turn right at the corner in the story.", None),
    ("Print great if the test passes.", None),
    ("Write a great poem.", None),
    ("I worked on it yesterday.", None),
    ("What about the weather tomorrow?", None),
    ("ok", None),
]


@pytest.mark.parametrize("text, sign", USER_TEXTS)
def test_user_texts(text, sign):
    assert user_text_sign(text) == sign
    assert feedback_score(user(text)) == sign


def test_content_parts_and_mixed_states():
    parts = [{"type": "text", "text": '{"ok": true,'}, {"type": "text", "text": '"error": null}'}]
    assert message_text(parts) == '{"ok": true,\n"error": null}'
    assert feedback_score(tool(parts)) == 1
    assert feedback_score(user([{"type": "text", "text": "wrong"}, {"type": "image_url", "image_url": {}}])) == -1
    # any failure wins; a success plus no user signal is a success; nothing readable is no signal
    assert feedback_score(tool("42") + tool("Traceback (most recent call last)")) == -1
    assert feedback_score(tool(json.dumps({"error": None})) + user("and now?")) == 1
    assert feedback_score([{"role": "assistant", "content": "wrong"}]) is None
    assert feedback_score([]) is None
    assert feedback_score(tool(None)) == 1

"""The feedback judge's grammar (clawray/algos/feedback.py) on a table of realistic next states,
both signs, with the traps that a word scan gets wrong (issue #24.3). docs/feedback.md shows the
same table."""

from __future__ import annotations

import json
from pathlib import Path

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
    # a text that mentions failures is not a failure: a file a `read` tool returns (OpenClaw's read gives
    # the file's text), a search hit; a program's failure output is (a label at a line's start, a count)
    ("Errors are written to stderr; see the logging section.", 1),
    ("Find the error in this sum: 7 + 8 = 16", 1),
    ("def handle_error(e):\n    log.error(e)\n    raise", 1),
    ("The test failed, so we rewrote it.", 1),
    ("ValueError: invalid literal for int() with base 10: 'x'", -1),
    ("npm ERR! code E404", -1),
    ("error[E0308]: mismatched types", -1),
    ("[ERROR] Build failed", -1),
    ("FAILED tests/test_a.py::test_x - assert 1 == 2", -1),
    ("Failed to open 'a.txt'", -1),
    ("1 error generated.", -1),
    ("Command timed out.", -1),
    ("fatal: not a git repository", -1),
    # failure output a word scan missed: a count with a noun, a labelled count, exit_code, other runtimes
    ("2 tests failed", -1),
    ("Tests run: 5, Failures: 1, Errors: 0", -1),
    ("Tests run: 5, Failures: 0, Errors: 0", 1),
    ("[exit_code: 1]", -1),
    ("exit_code=0", 1),
    ('Exception in thread "main" java.lang.NullPointerException\n\tat Main.main(Main.java:3)', -1),
    ("thread 'main' panicked at 'index out of bounds', src/main.rs:2:5", -1),
    ("--- FAIL: TestSum (0.00s)\nFAIL\texample.com/sum\t0.01s", -1),
    ("ok  \texample.com/sum\t0.01s", 1),
    ("make: *** [Makefile:3: all] Error 1", -1),
    ("curl: (7) Failed to connect to localhost port 80", -1),
    # structured values written as strings, as many tools do
    ('{"success": "false", "reason": "quota"}', -1),
    ('{"exit_code": "1"}', -1),
    ('{"status_code": "500"}', -1),
    ('{"exit_code": "0", "success": "true"}', 1),
    # an HTTP status line, an integral float exit code, a batch of structured results
    ("HTTP/1.1 500 Internal Server Error\nContent-Length: 0", -1),
    ("HTTP/1.1 200 OK\nContent-Length: 2", 1),
    ('{"exit_code": 2.0, "stderr": "No such file"}', -1),
    ('[{"id": 1, "error": "quota exceeded"}, {"id": 2, "error": null}]', -1),
    ('[{"id": 1, "error": null}, {"id": 2, "error": null}]', 1),
    # compiler, npm 10+ and curl failure lines; HTTP status codes in a structured result
    ("npm error code E404\nnpm error 404 Not Found - GET https://registry.npmjs.org/nope", -1),
    ("src/a.ts(3,5): error TS2322: Type 'string' is not assignable to type 'number'.", -1),
    ("gcc: fatal error: no input files\ncompilation terminated.", -1),
    ("main.c:1:10: fatal error: 'foo.h' file not found", -1),
    ("curl: (22) The requested URL returned error: 404", -1),
    ('{"status": 404, "body": "Not Found"}', -1),
    ('{"statusCode": 500, "body": "Internal Server Error"}', -1),
    ('{"status": 200, "body": "ok"}', 1),
    # OpenClaw's own tool errors: the error text is the whole tool message, with no flag
    ("File not found: /ws/homework.txt.", -1),
    (
        "Could not find the exact text in /ws/a.txt. The old text must match exactly including all whitespace and newlines.",
        -1,
    ),
    (
        "Found 2 occurrences of the text in /ws/a.txt. The text must be unique. Please provide more context to make it unique.",
        -1,
    ),
    ("Read requires a file path, but /ws is a directory. List the directory, then read a specific file.", -1),
    ("Tool apply_patch not found", -1),
    ("Operation aborted", -1),
    ("Write verification failed for /ws/a.txt: the persisted regular file does not match the requested content.", -1),
    ("Working directory does not exist: /ws/gone\nCannot execute bash commands.", -1),
    # ... read at the start only: a file or a search hit that holds such words reports no failure
    ("Successfully wrote 12 bytes to /ws/a.txt", 1),
    ("# Setup\nIf the config file is not found, run init first.", 1),
    ("Found 2 occurrences of 'total' in a.py", 1),
    # a failure label whose message opens with 0, None, null or false is a failure; a bare value ends its field
    ("Error: 0 is not a valid port number", -1),
    ("Error: None is not a valid path", -1),
    ("error: null pointer dereference", -1),
    ("Error: false is not a function", -1),
    ("errors: 0, warnings: 2", 1),
    ("error=null warn=1", 1),
    ("Build done. Errors: 0.", 1),
    # dash's missing command, an HTTP error label, the OOM killer, apt, a timeout status
    ("/bin/sh: 1: foo: not found", -1),
    ("Error 404: Not Found", -1),
    ("Killed", -1),
    ("bash: line 1:  1234 Killed                  python train.py", -1),
    ("E: Unable to locate package foo", -1),
    ("TIMEOUT", -1),
    ("Killed 3 stale processes", 1),
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
    ("Way too verbose.", -1),  # a length complaint (the plain environment's "That's too long.")
    ("It's not too long, thanks!", 1),
    ("Write a summary that is not too long.", None),  # a request, not an evaluation
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
    # fault words in fresh requests, conditions and checks are no complaint (a bag of words read
    # "Add error handling to the parser." as a complaint); a request that points at a fault that is
    # there, a fault that is gone and pasted failure output are read
    ("Add error handling to the parser.", None),
    ("[Fri 2026-12-04 00:10 UTC] Add error handling to the parser.", None),
    ("Write a function that raises an error on bad input.", None),
    ("Can you add error handling?", None),
    ("Check the log for errors.", None),
    ("Tell me if anything is wrong.", None),
    ("List common mistakes beginners make.", None),
    ("Write a story where everything goes wrong.", None),
    ("You fixed the error, thanks!", 1),
    ("The bug is gone now, perfect.", 1),
    ("Catch the exception in parse().", -1),
    ("Now write it again without the mistake.", -1),
    ("Add error handling, it crashes with an error.", -1),
    ("Write the correct answer, this one is wrong.", -1),
    ("Check your answer, it's wrong.", -1),
    ("Fix the error.", -1),
    ("TypeError: unsupported operand type(s) for +", -1),
    # a fault word naming a topic ("error messages"), a question about faults, and a fault the user
    # reports seeing ("I get a KeyError") are read as what they are
    ("The error messages are clearer now, thanks!", 1),
    ("Perfect. Now what about error handling for the network calls?", 1),
    ("Thanks, that works. How do I log errors to a file?", 1),
    ("How do I handle errors in Python?", None),
    ("What is the difference between an error and an exception?", None),
    ("What errors can this function raise?", None),
    ("What does this error mean?", -1),
    ("Why do I get a KeyError here?", -1),
    ("It throws an exception on empty input.", -1),
    ("There is still an error.", -1),
    ("Why is this wrong?", -1),
    ("It prints the error message correctly now, thanks.", 1),
    ("Thanks, it no longer throws an exception.", 1),
    ("I don't get the error anymore, thanks!", 1),
    ("No exceptions now, thanks.", 1),
    # a past fault the reply mended is history; a "now" that does not judge the reply keeps it
    ("That was wrong, but now it's correct. Thanks!", 1),
    ("It was broken before. Now it works!", 1),
    ("The last answer was wrong; this time you got it, thanks.", 1),
    ("That was wrong, now fix it.", -1),
    ("It was fine before, but now it's broken.", -1),
    ("That was wrong, and now it's still wrong.", -1),
    ("I get an error message when I run it.", -1),
    # faults as what a text is about are a topic; one that is there is not
    ("I have a question about errors.", None),
    ("Thanks! I have a question about exceptions in Python.", 1),
    ("I was reading about common mistakes in C.", None),
    ("I have a question about this error.", -1),
    ("I have a question about an error I get.", -1),
    # negated praise, "not working", failures named otherwise; asking whether there were any
    ("That doesn't look right.", -1),
    ("I don't think that's right.", -1),
    ("It isn't working, thanks", -1),
    ("Thanks, but it still fails.", -1),
    ("Perfect, except it doesn't compile.", -1),
    ("Don't turn right at the end, thanks.", 1),
    ("Were there any errors?", None),
    ("Did you get any errors?", None),
    ("Any errors? I see a KeyError.", -1),
    # a correct/right naming what the reply should have said is no praise; a conceded mistake is no complaint
    ("Correct answer is 12, you said 14.", None),
    ("Right answer is 12, not 14.", None),
    ("Thanks, but the total should be 12.", -1),
    ("You're right, I was wrong.", 1),
    ("I was wrong, you're right.", 1),
    # a correction in a sentence of its own, an omission pointed out
    ("Thanks. The total should be 12 though.", -1),
    ("Right, but you forgot the units.", -1),
    ("Thanks, you didn't miss anything.", 1),
    # contractions as typed (there's, wasn't, no apostrophe, a typographic one), past tense
    ("Thanks. There's a bug in foo().", -1),
    ("Thanks, but that wasn't what I asked.", -1),
    ("Thanks, but that’s not what I asked.", -1),
    ("thanks but it failed", -1),
    ("Thanks, it crashed.", -1),
    ("Thanks, but it doesnt compile.", -1),
    ("It works, but it's too slow.", -1),
    ("dont worry, it's correct", 1),
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


def _doc_cell(content: str) -> str:
    """A tool result as docs/feedback.md writes it: in backticks, newlines as \\n, '' as (empty)."""
    return "`" + content.replace("\n", "\\n") + "`" if content else "(empty)"


def test_the_docs_table_is_this_table():
    """docs/feedback.md's table holds exactly these rows, in this order (a row in one and not the other
    is a claim nobody checks)."""
    sign = {1: "+1", -1: "-1", None: "none"}
    want = [f"| tool result | {_doc_cell(c)} | {sign[s]} |" for c, s in TOOL_RESULTS]
    want += [f"| user | {t} | {sign[s]} |" for t, s in USER_TEXTS]
    doc = (Path(__file__).parents[2] / "docs" / "feedback.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith(("| tool result |", "| user |"))]
    assert rows == want


def test_praise_at_a_clause_start_is_read_as_the_search_from_every_separator_read_it():
    """Praise opening a clause is matched once per clause: on random statements it reads as the search
    from every separator it replaces, and a run of separators (``","*40000``: 130 s, and quadrupling
    per doubling) or of asterisks in a tool result (``"***"*60000``: 174 s) is read in one pass."""
    import random
    import re

    from clawray.algos import feedback

    word = r"(?:correct|right|thanks?|thank you|great|perfect|well done|excellent)\b"
    fillers = r"(?:ok(?:ay)?|yes|yeah|yep|oh|wow|good|nice|very|all|so|and)"
    searched = re.compile(rf"(?:^|[,;:\]]|\s[-–—])\W*(?:{fillers}\W+)*{word}{feedback._CORRECTION}", re.IGNORECASE)
    parts = ["ok", "so", "thanks", "great", "right", "the", "x", ",", ";", ":", "]", " -", " — ", "-", " ", "!!", "—"]
    parts += ["correct", " answer", "answer"]
    rng = random.Random(1)
    for _ in range(5000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(1, 10))).strip()
        split = any(feedback._PRAISE_OPENING.match(c) for c in feedback._CLAUSE_START.split(text))
        assert split == bool(searched.search(text)), text
    assert user_text_sign("," * 40000) is None and user_text_sign("--- " * 10000) is None
    assert user_text_sign(", " * 20000 + "thanks") == 1
    assert tool_result_sign("***" * 20000) == 1
    assert tool_result_sign("***" * 20000 + " make: *** [all] Error 2") == -1


def test_a_tool_result_nested_too_deep_to_decode_is_read_as_text_and_never_raises():
    """``{"tree": [[[...5000 deep...]]], "error": "disk full"}``: json.loads raised RecursionError out
    of the judge (the turn dropped as judge_error); now it is read as text, as any unstructured result."""
    deep = '{"tree": ' + "[" * 5000 + "]" * 5000 + ', "error": "disk full"}'
    assert tool_result_sign(deep) == 1
    assert tool_result_sign(deep + "\nError: disk full") == -1

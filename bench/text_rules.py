"""Time of clawray's text rules on adversarial inputs at n and 2n characters: linear rules take about
2x when the input doubles, a pattern that rescans the rest of the text from every unclosed opening
takes 4x (``"Runtime: agent=" * 8000``, 120 kB, held a replica 6.3 s before its size was checked;
180 kB of asterisks held the feedback judge 174 s). Each row: the rule, the input, seconds at n and
2n, the growth ratio; the script exits 1 when any ratio exceeds ``--max-ratio``.

    PYTHONPATH=. .venv/bin/python bench/text_rules.py [--chars 60000] [--max-ratio 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

from clawray import client_rules
from clawray.algos import feedback
from clawray.serve import reply

BEGIN = client_rules.INTERNAL_CONTEXT[0]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


#: (rule, input unit, call): each input is the unit repeated to the wanted length
CASES: list[tuple[str, str, Callable[[str], object]]] = [
    ("client_rules.strip_ephemeral", BEGIN, client_rules.strip_ephemeral),
    ("client_rules.session_hint", "Runtime: agent=", lambda t: client_rules.session_hint(_user(t))),
    ("client_rules.side_kind", "Runtime: agent=", lambda t: client_rules.side_kind(_user(t), None)),
    ("client_rules.reply_as_kept", "<think>", client_rules.reply_as_kept),
    ("client_rules.reply_as_kept", "<thinking x", client_rules.reply_as_kept),
    ("client_rules.reply_as_kept", "[[reply_to:", client_rules.reply_as_kept),
    ("client_rules.is_silent_reply", " ", lambda t: client_rules.is_silent_reply(f"NO_REPLY{t}x")),
    ("client_rules.is_silent_reply", "NO_REPLY ", client_rules.is_silent_reply),
    ("feedback.user_text_sign", ",", feedback.user_text_sign),
    ("feedback.user_text_sign", "--- ", feedback.user_text_sign),
    ("feedback.user_text_sign", "ok ", feedback.user_text_sign),
    ("feedback.user_text_sign", "but ", feedback.user_text_sign),
    ("feedback.user_text_sign", "should be ", feedback.user_text_sign),
    ("feedback.tool_result_sign", "***", feedback.tool_result_sign),
    ("feedback.tool_result_sign", "a:", feedback.tool_result_sign),
    ("feedback.tool_result_sign", "a(1,1): fatal ", feedback.tool_result_sign),
    ("feedback.tool_result_sign", "x not found ", feedback.tool_result_sign),
    ("reply.parse_tool_block", "<parameter=x>", lambda t: _quiet(reply.parse_tool_block, "<function=f>" + t)),
    ("reply.parse_tool_block", "<function=", lambda t: _quiet(reply.parse_tool_block, t)),
    ("reply.parse_reply_text", "<tool_call><function=a>", reply.parse_reply_text),
    ("reply.untagged_tool_calls", " ", lambda t: reply.untagged_tool_calls(f"```json\n{{}}{t}x", {})),
]


def _quiet(fn: Callable[[str], object], text: str) -> object:
    try:
        return fn(text)
    except ValueError:  # a malformed block is the expected answer here
        return None


def _seconds(fn: Callable[[str], object], text: str) -> float:
    t0 = time.perf_counter()
    fn(text)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chars", type=int, default=60000, help="n: the smaller input's length in characters")
    ap.add_argument("--max-ratio", type=float, default=3.0, help="the largest growth ratio accepted for 2n vs n")
    args = ap.parse_args()
    worst = 0.0
    print(f"{'rule':30s} {'input unit':26s} {'n s':>8s} {'2n s':>8s} {'ratio':>6s}")
    for name, unit, fn in CASES:
        small, large = (unit * (k * args.chars // len(unit)) for k in (1, 2))
        times = [min(_seconds(fn, text) for _ in range(3)) for text in (small, large)]
        ratio = times[1] / max(times[0], 1e-4)  # below 0.1 ms the ratio is noise
        worst = max(worst, ratio if times[1] > 1e-3 else 0.0)
        print(f"{name:30s} {unit!r:26s} {times[0]:8.4f} {times[1]:8.4f} {ratio:6.1f}")
    print(f"worst growth (inputs over 1 ms): {worst:.1f}x (limit {args.max_ratio:g}x)")
    return 0 if worst <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())

"""A simulated user: multi-turn sessions through the official ``openai`` client.

The user asks an arithmetic problem (``env.level``, see :mod:`clawray.envs.arith`) and states a
preference: one short sentence, no markdown. After each reply it gives feedback in
plain words ("Correct, thanks!", "That's wrong, try again", "please no markdown", ...), which is the
next state the judge reads. A calculator tool is offered; tool calls are executed and their result is
sent back as a ``tool`` message. A session ends (``X-Session-Done: true``) when the answer is right
or after ``max_turns`` replies.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
import threading
import time
import uuid
from collections import Counter
from typing import Any

import ray

from clawray.envs.arith import Problem, make_problem

PREFERENCE = "Reply in one short sentence, no markdown."

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate ``+ - * /`` arithmetic safely; returns the result or ``"error: ..."``."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("unsupported expression")
    try:
        value = ev(ast.parse(str(expression), mode="eval").body)
        return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
    except Exception as e:
        return f"error: {e}"


_MARKDOWN = re.compile(r"(\*\*|__|^#{1,6}\s|^\s*[-*+]\s|^\s*\d+[.)]\s|`)", re.MULTILINE)
_ANSWER = re.compile(r"answer\s*[:=]?\s*\$?(-?\d[\d,]*)", re.IGNORECASE)


def grade(reply: str, problem: Problem) -> tuple[bool, bool, bool]:
    """``(has_answer, correct, markdown)`` for a reply.

    The answer is the last ``Answer: N`` in the reply, else the last number on the last line.
    """
    found = _ANSWER.findall(reply)
    if not found:
        lines = [ln for ln in reply.strip().splitlines() if ln.strip()]
        found = re.findall(r"-?\d[\d,]*", lines[-1]) if lines else []
    if not found:
        return False, False, bool(_MARKDOWN.search(reply))
    value = int(found[-1].replace(",", ""))
    return True, value == problem.answer, bool(_MARKDOWN.search(reply))


def feedback(reply: str, problem: Problem) -> tuple[str, bool]:
    """The user's next message for ``reply`` and whether the task is solved."""
    has_answer, correct, markdown = grade(reply, problem)
    if correct and not markdown:
        return "Correct, thanks! That is exactly what I wanted.", True
    if correct:
        return "The number is right, but I asked for no markdown. Please redo it as one plain sentence.", False
    if not has_answer:
        return "I can't find the answer in that. Please try again in one short sentence.", False
    return "That's wrong. Please try again, in one plain sentence.", False


class SimUserPool:
    """Runs ``concurrency`` simulated sessions in threads until :meth:`stop`.

    Args:
        base_url: the policy endpoint (``http://127.0.0.1:PORT/v1``).
        cfg: the ``env`` config section (plain dict).
        model: the served model name.
    """

    def __init__(self, base_url: str, cfg: dict, model: str = "clawray-policy"):
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key="EMPTY", timeout=cfg["request_timeout_s"], max_retries=0)
        self.cfg, self.model = cfg, model
        self.rng = random.Random(cfg["seed"])
        self.lock = threading.Lock()
        self.stats: Counter[str] = Counter()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the session threads (returns at once)."""
        for i in range(self.cfg["concurrency"]):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True, name=f"sim-user-{i}")
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float = 5.0) -> dict:
        """Stop after the current requests; returns the counters."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=timeout_s)
        return self.get_stats()

    def get_stats(self) -> dict:
        """Counters: sessions, requests, solved, tool_calls, errors."""
        with self.lock:
            return dict(self.stats)

    def _count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.stats[key] += n

    def _loop(self, worker: int) -> None:
        while not self._stop.is_set():
            with self.lock:
                problem = make_problem(self.rng, self.cfg["level"])
            try:
                self.run_session(problem)
            except Exception as e:  # keep the traffic going; the error is counted
                self._count("errors")
                self._count(f"error/{type(e).__name__}")
                time.sleep(1.0)

    def _ask(self, session: str, messages: list[dict], done: bool = False, max_tokens: int | None = None) -> Any:
        self._count("requests")
        return self.client.chat.completions.create(
            model=self.model, messages=messages, tools=[CALCULATOR_TOOL],
            max_tokens=max_tokens or self.cfg["max_tokens"], temperature=self.cfg["temperature"],
            extra_headers={"X-Session-Id": session, "X-Session-Done": "true" if done else "false"})

    def run_session(self, problem: Problem) -> bool:
        """One session; returns whether the problem was solved."""
        session = f"sim-{uuid.uuid4().hex[:12]}"
        self._count("sessions")
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"{problem.question} {PREFERENCE}"}]
        for turn in range(self.cfg["max_turns"]):
            if self._stop.is_set():
                return False
            msg = self._ask(session, messages).choices[0].message
            assistant: dict[str, Any] = {"role": "assistant", "content": msg.content}
            if msg.tool_calls:
                self._count("tool_calls")
                assistant["tool_calls"] = [c.model_dump() for c in msg.tool_calls]
                messages.append(assistant)
                for call in msg.tool_calls:
                    try:
                        expr = json.loads(call.function.arguments).get("expression", "")
                    except (json.JSONDecodeError, AttributeError):
                        expr = ""
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(expr)})
                continue
            messages.append(assistant)
            text, solved = feedback(msg.content or "", problem)
            last = solved or turn == self.cfg["max_turns"] - 1
            messages.append({"role": "user", "content": text})
            if last:
                # the closing message carries the feedback on the last reply; its own reply is not
                # trained (no next state), so it only needs a short acknowledgement
                self._ask(session, messages, done=True, max_tokens=16)
                self._count("solved" if solved else "unsolved")
                return solved
        self._ask(session, messages + [{"role": "user", "content": "Let's stop here."}], done=True, max_tokens=16)
        self._count("unsolved")
        return False


SimUserPoolActor = ray.remote(SimUserPool)

"""A simulated user: multi-turn sessions through the official ``openai`` client.

Owns: the users' threads and sessions (the ``X-Session-*`` headers, the executed tool calls), the
hold/release gate and the request log. Must not: grade a reply or phrase the feedback (the
environment's), draw from the eval split, or reach the policy other than through its OpenAI endpoint.

The user asks a task of the environment ``env.name`` (:mod:`clawray.envs`; ``arith`` at
``env.level`` by default), drawn from its TRAIN split only, and states the environment's
preference. After each reply it gives the environment's feedback in plain words ("Correct,
thanks!", "That's wrong, try again", "please no markdown", ...), which is the next state the judge
reads. When the environment offers tools (``arith``: a calculator), tool calls are executed and
their result is sent back as a ``tool`` message. A session ends (``X-Session-Done: true``, with
``X-Session-Outcome`` 1 when solved, else -1) when the task is solved or after ``max_turns`` replies.
Resample mode (``env.resample_n`` = n > 1): each drawn problem is asked in n sessions in a row, with
the same opening messages (so the same prompt tokens), giving ``trainer.advantage: grpo`` real groups
of first turns (``trainer.group_by: prompt``) or of turn k of sessions with one opening
(``session_prefix``).

Serial loop (``trainer.overlap: false``): :meth:`SimUserPool.hold` stops the users at their next
request and waits for the requests in flight to be answered; :meth:`SimUserPool.release` lets them go
on. Invariant: between ``hold`` returning 0 and ``release``, no request of this pool is in flight.
Every request's wall-clock ``[start, end]`` (``time.time()``, seconds) is kept
(:meth:`SimUserPool.request_log`, the newest 4,096) so a run can check what overlapped what.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import Counter, deque
from typing import Any

import ray

from clawray.config import EnvConfig, section
from clawray.envs import env_from_config
from clawray.envs.arith import calculator
from clawray.envs.base import Problem


class _Stopped(Exception):
    """The pool was stopped while a user waited at a hold."""


class SimUserPool:
    """Runs ``concurrency`` simulated sessions in threads until :meth:`stop`.

    Args:
        base_url: the policy endpoint (``http://127.0.0.1:PORT/v1``).
        cfg: the ``env`` config section (:class:`~clawray.config.EnvConfig`; an omegaconf node or a
            mapping of some of its keys is converted by :func:`~clawray.config.section`): ``name``,
            ``level`` and ``data_path`` pick the environment.
        model: the served model name.
    """

    def __init__(self, base_url: str, cfg: EnvConfig, model: str = "clawray-policy"):
        from openai import OpenAI

        cfg = section(EnvConfig, cfg)
        self.client = OpenAI(base_url=base_url, api_key="EMPTY", timeout=cfg.request_timeout_s, max_retries=0)
        self.cfg, self.model = cfg, model
        self.env = env_from_config(cfg)
        self.rng = random.Random(cfg.seed)
        self.lock = threading.Lock()
        self.stats: Counter[str] = Counter()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._gate = threading.Condition()  # guards _held and _in_flight
        self._held = False
        self._in_flight = 0  # requests sent and not answered yet
        self._log: deque[tuple[float, float]] = deque(maxlen=4096)  # (start, end) of each request

    def start(self) -> None:
        """Start the session threads (returns at once)."""
        for i in range(self.cfg.concurrency):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True, name=f"sim-user-{i}")
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float = 5.0) -> dict:
        """Stop after the current requests (users waiting at a hold stop too); returns the counters."""
        self._stop.set()
        with self._gate:
            self._gate.notify_all()
        for t in self._threads:
            t.join(timeout=timeout_s)
        return self.get_stats()

    def hold(self, timeout_s: float = 600.0) -> int:
        """Stop every user at its next request and wait (up to ``timeout_s`` seconds) until the
        requests in flight are answered; returns how many are still in flight (0 unless timed out).
        The users' sessions stay open: after :meth:`release` each goes on with its next request."""
        deadline = time.monotonic() + timeout_s
        with self._gate:
            self._held = True
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._gate.wait(left)
            return self._in_flight

    def release(self) -> None:
        """Let the users held by :meth:`hold` send their requests again."""
        with self._gate:
            self._held = False
            self._gate.notify_all()

    def request_log(self) -> list[tuple[float, float]]:
        """``(start, end)`` wall-clock seconds (``time.time()``) of the newest 4,096 answered or
        failed requests, oldest first."""
        with self._gate:
            return list(self._log)

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
                problem = self.env.sample(self.rng, "train")
            for _ in range(self.cfg.resample_n):  # resample mode: the same opening n times
                if self._stop.is_set():
                    break
                try:
                    self.run_session(problem)
                except _Stopped:
                    return
                except Exception as e:  # keep the traffic going; the error is counted
                    self._count("errors")
                    self._count(f"error/{type(e).__name__}")
                    time.sleep(1.0)

    def _ask(
        self,
        session: str,
        messages: list[dict],
        done: bool = False,
        max_tokens: int | None = None,
        outcome: float | None = None,
    ) -> Any:
        tools = {"tools": self.env.tools} if self.env.tools else {}
        headers = {"X-Session-Id": session, "X-Session-Done": "true" if done else "false"}
        if outcome is not None:  # the session's score for long-horizon credit (trainer.credit)
            headers["X-Session-Outcome"] = f"{outcome:g}"
        with self._gate:  # a held pool sends nothing (serial loop, see hold)
            if self._held:
                while self._held and not self._stop.is_set():
                    self._gate.wait()
                if self._stop.is_set():  # stopped while held: the request is not sent
                    raise _Stopped()
            self._in_flight += 1
        self._count("requests")
        t0 = time.time()
        try:
            return self.client.chat.completions.create(
                model=self.model,
                messages=messages,
                **tools,
                max_tokens=max_tokens or self.cfg.max_tokens,
                temperature=self.cfg.temperature,
                extra_headers=headers,
            )
        finally:
            with self._gate:
                self._in_flight -= 1
                self._log.append((t0, time.time()))
                self._gate.notify_all()

    def run_session(self, problem: Problem) -> bool:
        """One session; returns whether the problem was solved."""
        session = f"sim-{uuid.uuid4().hex[:12]}"
        self._count("sessions")
        messages: list[dict[str, Any]] = self.env.opening(problem)
        for turn in range(self.cfg.max_turns):
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
            text, solved = self.env.feedback(problem, msg.content or "")
            last = solved or turn == self.cfg.max_turns - 1
            messages.append({"role": "user", "content": text})
            if last:
                # the closing message carries the feedback on the last reply; its own reply is not
                # trained (no next state), so it only needs a short acknowledgement
                self._ask(session, messages, done=True, max_tokens=16, outcome=1.0 if solved else -1.0)
                self._count("solved" if solved else "unsolved")
                return solved
        self._ask(
            session,
            messages + [{"role": "user", "content": "Let's stop here."}],
            done=True,
            max_tokens=16,
            outcome=-1.0,
        )
        self._count("unsolved")
        return False


SimUserPoolActor = ray.remote(SimUserPool)

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

OpenClaw mode (``env.client: openclaw``): each user thread talks through a real OpenClaw agent of its
own (:mod:`clawray.envs.openclaw_user`) instead of the ``openai`` client. OpenClaw runs the tools and
sends its own requests, without session headers (clawray attributes them from the conversation). A
session's last reply gets its next state like any other (the user's verdict, sent as one more agent
turn), and the session is not closed by a header: the tracker's idle timeout ends it, and the reply
to the verdict is dropped as ``no_next_state``. There is no session outcome (``trainer.credit: turn``).

Serial loop (``trainer.overlap: false``): :meth:`SimUserPool.hold` stops the users at their next
request and waits for the requests in flight to be answered; :meth:`SimUserPool.release` lets them go
on. Invariant: between ``hold`` returning 0 and ``release``, no request of this pool is in flight.
Every request's wall-clock ``[start, end]`` (``time.time()``, seconds) is kept
(:meth:`SimUserPool.request_log`, the newest 4,096) so a run can check what overlapped what.
"""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
import uuid
from collections import Counter, deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

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
        self.base_url, self.cfg, self.model = base_url, cfg, model
        self._agents: list[Any] = []  # env.client=openclaw: one OpenClawUser per user thread
        self._agents_dir: Path | None = None
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
        """Start the session threads (returns once they run; with ``env.client=openclaw`` after
        installing OpenClaw once and configuring one agent per thread).

        Raises:
            clawray.openclaw.OpenClawUnavailable, RuntimeError, ValueError: ``env.client=openclaw`` and
                OpenClaw cannot be set up (see :func:`clawray.envs.openclaw_user.make_users`).
        """
        if self.cfg.client == "openclaw" and not self._agents:
            from clawray.envs.openclaw_user import make_users

            self._agents, self._agents_dir = make_users(
                self.cfg.concurrency,
                self.base_url,
                self.model,
                "EMPTY",
                self.cfg.max_tokens,
                self.cfg.openclaw_lean,
                self.cfg.request_timeout_s,
                self.cfg.openclaw_root,
            )
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
        if self._agents_dir is not None and not any(t.is_alive() for t in self._threads):
            shutil.rmtree(self._agents_dir, ignore_errors=True)  # a turn still running keeps its folder
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
        """Counters: sessions, requests, solved, unsolved, tool_calls, errors (``error/<kind>``); with
        ``env.client=openclaw`` also agent_turns (``requests`` then counts the policy requests
        OpenClaw reported, ``agent_seconds`` the agent turns' wall time)."""
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
                    self.run_session(problem, worker)
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
        with self._sending():
            self._count("requests")
            return self.client.chat.completions.create(
                model=self.model,
                messages=messages,
                **tools,
                max_tokens=max_tokens or self.cfg.max_tokens,
                temperature=self.cfg.temperature,
                extra_headers=headers,
            )

    @contextmanager
    def _sending(self) -> Iterator[None]:
        """One request (or OpenClaw agent turn) in flight: waits while the pool is held (serial loop,
        see :meth:`hold`), counts it in flight and logs its ``(start, end)``.

        Raises:
            _Stopped: the pool was stopped while held (nothing is sent).
        """
        with self._gate:
            if self._held:
                while self._held and not self._stop.is_set():
                    self._gate.wait()
                if self._stop.is_set():
                    raise _Stopped()
            self._in_flight += 1
        t0 = time.time()
        try:
            yield
        finally:
            with self._gate:
                self._in_flight -= 1
                self._log.append((t0, time.time()))
                self._gate.notify_all()

    def _agent_turn(self, worker: int, session: str, message: str) -> str:
        """``message`` through worker ``worker``'s OpenClaw agent in ``session``; returns the agent's
        final reply (:class:`clawray.envs.openclaw_user.AgentTurn`'s ``text``)."""
        with self._sending():
            turn = self._agents[worker].say(session, message)
        self._count("agent_turns")
        self._count("requests", turn.requests)
        self._count("tool_calls", turn.tool_calls)
        with self.lock:
            self.stats["agent_seconds"] += round(turn.seconds, 1)
        return turn.text

    def run_openclaw_session(self, problem: Problem, worker: int = 0) -> bool:
        """One session through worker ``worker``'s OpenClaw agent (``env.client=openclaw``); returns
        whether the problem was solved. Each of the ``max_turns`` agent turns is graded on its final
        reply; the verdict on the last one is sent as one more agent turn (its next state)."""
        from clawray.envs.openclaw_user import HOMEWORK_MESSAGE

        session = f"sim-{uuid.uuid4().hex[:12]}"
        self._count("sessions")
        task = "\n\n".join(str(m.get("content") or "") for m in self.env.opening(problem) if m["role"] != "assistant")
        message = task
        if self.cfg.openclaw_homework:
            self._agents[worker].write_homework(task)
            message = HOMEWORK_MESSAGE
        for turn in range(self.cfg.max_turns):
            if self._stop.is_set():
                return False
            reply = self._agent_turn(worker, session, message)
            message, solved = self.env.feedback(problem, reply)
            if solved or turn == self.cfg.max_turns - 1:
                self._agent_turn(worker, session, message)  # the last reply's next state
                self._count("solved" if solved else "unsolved")
                return solved
        return False

    def run_session(self, problem: Problem, worker: int = 0) -> bool:
        """One session (through worker ``worker``'s OpenClaw agent with ``env.client=openclaw``);
        returns whether the problem was solved."""
        if self.cfg.client == "openclaw":
            return self.run_openclaw_session(problem, worker)
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

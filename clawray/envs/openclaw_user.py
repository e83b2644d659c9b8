"""The simulated user's agent: the real OpenClaw (``env.client: openclaw``) between the user and the policy.

Owns: one user's OpenClaw (its own home, state, config and workspace folder), running an agent turn
(``openclaw agent --local --session-id ID -m MESSAGE --json``) and reading the agent's final reply.
Must not: grade a reply (the environment's), or tell clawray which session a request belongs to:
OpenClaw sends no session header, and clawray attributes its requests from the conversation itself
(:mod:`clawray.client_rules`, ``docs/openclaw.md``), as it does for a real user's agent.

The seed's homework scenario (``env.openclaw_homework``): before a session the user writes the task
(the environment's opening text, preference included) into ``homework.txt`` in the agent's workspace
and asks the agent to read and solve it, so the agent's first move is a ``read`` tool call; the user
grades the agent's final reply of each turn and answers in words. Otherwise the user types the task
into the chat. OpenClaw offers its own tools (``read``, ``write``, ``exec`` with the lean config),
not the environment's (``arith``'s calculator).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from clawray import openclaw

#: what the user types in the homework scenario; the task itself is in ``homework.txt``
HOMEWORK_MESSAGE = "Read homework.txt in your workspace and do what it asks. Reply with the answer."


@dataclass(frozen=True)
class AgentTurn:
    """One OpenClaw agent turn: ``text`` (the agent's final visible reply, what the user reads),
    ``tool_calls`` (tool calls OpenClaw ran in the turn), ``requests`` (policy requests the turn made:
    one per assistant message, so tool round trips add one each) and ``seconds`` (wall time of the
    whole turn, OpenClaw's own start-up and work included)."""

    text: str
    tool_calls: int
    requests: int
    seconds: float = 0.0


class AgentTurnFailed(RuntimeError):
    """``openclaw agent`` exited with an error, timed out, or printed no JSON result."""


def _get(obj: object, *path: str) -> object:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def parse_agent_output(stdout: str) -> AgentTurn:
    """The turn that ``openclaw agent --local --json`` printed on ``stdout`` (OpenClaw 2026.9.6):
    ``meta.finalAssistantVisibleText`` is the reply (else the texts of ``payloads`` joined by
    newlines: those also hold OpenClaw's own notices, such as "Reply truncated"); tool calls are
    ``meta.toolSummary.calls`` (else the length of ``meta.agentMeta.terminalReceipt.successfulToolNames``,
    else 0); requests are ``meta.agentMeta.assistantTurns`` (else 1).

    Raises:
        AgentTurnFailed: no JSON object in ``stdout``.
    """
    start = stdout.find("{")
    try:
        result = json.loads(stdout[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        raise AgentTurnFailed(f"openclaw agent printed no JSON result: {stdout[-300:]!r}")
    text = _get(result, "meta", "finalAssistantVisibleText")
    if not isinstance(text, str):
        payloads = result.get("payloads") if isinstance(result.get("payloads"), list) else []
        text = "\n".join(p["text"] for p in payloads if isinstance(p, dict) and isinstance(p.get("text"), str))
    calls = _get(result, "meta", "toolSummary", "calls")
    if not isinstance(calls, int):
        names = _get(result, "meta", "agentMeta", "terminalReceipt", "successfulToolNames")
        calls = len(names) if isinstance(names, list) else 0
    requests = _get(result, "meta", "agentMeta", "assistantTurns")
    return AgentTurn(text, calls, requests if isinstance(requests, int) and requests > 0 else 1)


class OpenClawUser:
    """One simulated user's OpenClaw, talking to the clawray endpoint ``base_url``.

    Args:
        claw: the installed OpenClaw (:func:`clawray.openclaw.install`); this user gets a fresh home
            of its own under ``root`` (sessions and state never meet another user's or run's).
        root: a folder for this user's home and workspace (made if missing).
        base_url, model, api_key: the endpoint (``http://127.0.0.1:PORT/v1``), the served model name
            and the key OpenClaw sends.
        context_window, max_tokens: what the config declares (the endpoint's ``max_model_len`` and
            the reply budget); OpenClaw budgets its prompt and compacts its history on them.
        lean: OpenClaw's knobs for small local models (:func:`clawray.openclaw.write_config`).
        timeout_s: an agent turn's limit (OpenClaw's ``--timeout``; the process gets 60 s more).

    Raises:
        ValueError: ``context_window`` under OpenClaw's minimum (4,000 tokens) or ``max_tokens`` not
            below it.
    """

    def __init__(
        self,
        claw: openclaw.OpenClaw,
        root: Path,
        base_url: str,
        model: str,
        api_key: str,
        context_window: int,
        max_tokens: int,
        lean: bool = True,
        timeout_s: float = 600.0,
    ):
        root.mkdir(parents=True, exist_ok=True)
        home = root / "home"
        home.mkdir(mode=0o700, exist_ok=True)
        self.claw = replace(claw, home_dir=home)
        self.workspace = root / "workspace"
        self.timeout_s = timeout_s
        openclaw.write_config(self.claw, base_url, model, api_key, context_window, max_tokens, self.workspace, lean)

    def write_homework(self, task: str) -> None:
        """Put ``task`` into the workspace's ``homework.txt`` (and clear an earlier ``answer.txt``)."""
        (self.workspace / "homework.txt").write_text(task.rstrip() + "\n")
        (self.workspace / "answer.txt").unlink(missing_ok=True)

    def say(self, session: str, message: str) -> AgentTurn:
        """Send ``message`` in OpenClaw session ``session`` and wait for the agent's turn to end.

        Raises:
            AgentTurnFailed: OpenClaw exited non-zero, outlasted ``timeout_s`` + 60 s, or printed no
                JSON result (its last stderr lines are in the message).
        """
        argv = self.claw.command(
            ["agent", "--local", "--session-id", session, "-m", message, "--json", "--timeout", f"{self.timeout_s:.0f}"]
        )
        t0 = time.monotonic()
        try:
            done = subprocess.run(
                argv, env=self.claw.environment(), capture_output=True, text=True, timeout=self.timeout_s + 60
            )
        except subprocess.TimeoutExpired:
            raise AgentTurnFailed(f"openclaw agent outlasted {self.timeout_s + 60:.0f} s") from None
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise AgentTurnFailed(f"openclaw agent exited {done.returncode}: {tail}")
        return replace(parse_agent_output(done.stdout), seconds=time.monotonic() - t0)


def make_users(
    n: int,
    base_url: str,
    model: str,
    api_key: str,
    max_tokens: int,
    lean: bool,
    timeout_s: float,
    install_root: str = "",
) -> tuple[list[OpenClawUser], Path]:
    """``n`` users, each with its own OpenClaw home and workspace in a fresh temporary folder (returned:
    remove it when done), configured for the endpoint's own context window (``/v1/models``'s
    ``max_model_len``). OpenClaw (pinned Node.js + ``openclaw``) is installed once into
    ``install_root`` ("" = ``~/.cache/clawray/openclaw``).

    Raises:
        clawray.openclaw.OpenClawUnavailable: OpenClaw cannot be installed here.
        RuntimeError: the endpoint does not answer ``/v1/models``.
        ValueError: its context window is under OpenClaw's 4,000 tokens (raise ``rollout.max_model_len``).
    """
    claw = openclaw.install(install_root or openclaw.DEFAULT_ROOT)
    served = openclaw.served_model(base_url, api_key, timeout_s=30.0)
    if served is None or "max_model_len" not in served:
        raise RuntimeError(f"the policy endpoint {base_url} does not answer /models with its max_model_len")
    folder = Path(tempfile.mkdtemp(prefix="clawray-openclaw-users-"))
    try:
        users = [
            OpenClawUser(
                claw,
                folder / f"user-{i}",
                base_url,
                model,
                api_key,
                served["max_model_len"],
                max_tokens,
                lean,
                timeout_s,
            )
            for i in range(n)
        ]
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return users, folder

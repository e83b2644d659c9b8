"""clawray.openclaw and `clawray openclaw`: the isolated OpenClaw config, its environment, and the
errors of an install that cannot happen (the real install and run: tests/system/test_openclaw.py)."""

import dataclasses
import json
import os
import stat

import pytest

from clawray import openclaw
from clawray.cli import main


def test_write_config_points_one_provider_at_the_endpoint_with_the_models_budget(tmp_path):
    claw = openclaw.OpenClaw(tmp_path, tmp_path / "bin" / "node", tmp_path / "openclaw.mjs")
    path = openclaw.write_config(claw, "http://127.0.0.1:8000/v1/", "tiny", "k3y", 32768, 4096, tmp_path / "ws")
    assert path == tmp_path / "home" / "openclaw.json" and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    config = json.loads(path.read_text())
    provider = config["models"]["providers"]["clawray"]
    assert (provider["baseUrl"], provider["apiKey"], provider["api"]) == (
        "http://127.0.0.1:8000/v1",
        "k3y",
        "openai-completions",
    )
    assert [(m["id"], m["contextWindow"], m["maxTokens"]) for m in provider["models"]] == [("tiny", 32768, 4096)]
    assert config["models"]["mode"] == "replace"
    assert config["agents"]["defaults"] == {"workspace": str(tmp_path / "ws"), "model": {"primary": "clawray/tiny"}}
    assert (tmp_path / "ws").is_dir()
    env = claw.environment({"PATH": "/usr/bin", "HOME": "/root"})
    assert env["PATH"] == f"{tmp_path / 'bin'}{os.pathsep}/usr/bin"
    assert env["HOME"] == env["OPENCLAW_HOME"] == str(tmp_path / "home")
    assert env["OPENCLAW_CONFIG_PATH"] == str(path) and env["OPENCLAW_STATE_DIR"] == str(tmp_path / "home" / "state")
    assert claw.command(["agent", "-m", "hi"]) == [
        str(tmp_path / "bin" / "node"),
        str(tmp_path / "openclaw.mjs"),
        "agent",
        "-m",
        "hi",
    ]


def test_a_home_of_its_own_holds_state_and_config_and_the_shared_home_is_untouched(tmp_path):
    """OpenClaw attests the workspaces it initialised in its state: a run given ``home_dir`` (tests,
    benches) keeps its state and config there, never in the install's shared ``root/home``."""
    claw = openclaw.OpenClaw(tmp_path, tmp_path / "bin" / "node", tmp_path / "openclaw.mjs")
    own = dataclasses.replace(claw, home_dir=tmp_path / "run-home")
    path = openclaw.write_config(own, "http://127.0.0.1:8000/v1", "tiny", "k", 32768, 4096, tmp_path / "ws")
    assert path == tmp_path / "run-home" / "openclaw.json" and path.is_file()
    env = own.environment({"PATH": "/usr/bin"})
    assert env["HOME"] == env["OPENCLAW_HOME"] == str(tmp_path / "run-home")
    assert env["OPENCLAW_STATE_DIR"] == str(tmp_path / "run-home" / "state")
    assert env["OPENCLAW_CONFIG_PATH"] == str(path) and not (tmp_path / "home").exists()


def test_a_lean_config_keeps_three_tools_and_no_bootstrap_files_or_skills(tmp_path, monkeypatch):
    """OpenClaw's own knobs for a small model: 7k characters of system prompt and 4 tool schemas
    instead of 40k and 12 (bench/openclaw_turns.py --lean)."""
    claw = openclaw.OpenClaw(tmp_path, tmp_path / "node", tmp_path / "openclaw.mjs")
    path = openclaw.write_config(claw, "http://h:1/v1", "m", "k", 32768, 64, tmp_path / "ws", lean=True)
    config = json.loads(path.read_text())
    assert config["tools"] == {"allow": ["read", "write", "exec"], "toolSearch": False}
    defaults = config["agents"]["defaults"]
    assert (defaults["skipBootstrap"], defaults["contextInjection"], defaults["skills"]) == (True, "never", [])
    path.unlink()
    monkeypatch.setattr(openclaw, "install", lambda root: claw)  # `clawray openclaw --lean` writes the same
    assert main(["openclaw", "--url", "http://127.0.0.1:9/v1", "--model", "m", "--api-key", "k", "--lean"]) == 0
    assert json.loads(path.read_text())["tools"] == config["tools"]


def test_session_headers_load_clawrays_plugin_without_an_exclusive_allow_list(tmp_path, monkeypatch):
    """The plugin folder holds OpenClaw's manifest (its id, the clawray provider) and the entry the
    package names; no ``plugins.allow`` (exclusive: it would unload OpenClaw's bundled plugins)."""
    claw = openclaw.OpenClaw(tmp_path, tmp_path / "node", tmp_path / "openclaw.mjs")
    path = openclaw.write_config(claw, "http://h:1/v1", "m", "k", 32768, 64, tmp_path / "ws", session_headers=True)
    config = json.loads(path.read_text())
    assert config["plugins"] == {"load": {"paths": [str(openclaw.PLUGIN_DIR)]}}
    manifest = json.loads((openclaw.PLUGIN_DIR / "openclaw.plugin.json").read_text())
    package = json.loads((openclaw.PLUGIN_DIR / "package.json").read_text())
    assert (manifest["id"], manifest["providers"]) == ("clawray-session", [openclaw.PROVIDER])
    (entry,) = package["openclaw"]["extensions"]
    source = (openclaw.PLUGIN_DIR / entry).read_text()
    assert 'id: "clawray-session"' in source and '"X-Session-Id": ctx.sessionId' in source
    assert "plugins" not in json.loads(
        openclaw.write_config(claw, "http://h:1/v1", "m", "k", 32768, 64, tmp_path / "ws").read_text()
    )
    path.unlink()
    monkeypatch.setattr(openclaw, "install", lambda root: claw)  # `clawray openclaw --session-headers`
    assert (
        main(["openclaw", "--url", "http://127.0.0.1:9/v1", "--model", "m", "--api-key", "k", "--session-headers"]) == 0
    )
    assert json.loads(path.read_text())["plugins"] == config["plugins"]


@pytest.mark.parametrize("window, max_tokens", [(3999, 1000), (8192, 8192), (8192, 0)])
def test_write_config_refuses_a_window_openclaw_refuses_or_a_reply_budget_that_does_not_fit(
    tmp_path, window, max_tokens
):
    claw = openclaw.OpenClaw(tmp_path, tmp_path / "node", tmp_path / "openclaw.mjs")
    with pytest.raises(ValueError):
        openclaw.write_config(claw, "http://127.0.0.1:8000/v1", "m", "k", window, max_tokens, tmp_path / "ws")
    assert not (tmp_path / "home" / "openclaw.json").exists()


def test_install_without_npm_or_with_a_failing_npm_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(openclaw.shutil, "which", lambda name: None)
    with pytest.raises(openclaw.OpenClawUnavailable, match="npm is not installed"):
        openclaw.install(tmp_path / "a")
    with pytest.raises(openclaw.OpenClawUnavailable, match="cannot run"):
        openclaw.install(tmp_path / "b", npm=str(tmp_path / "no-npm"))
    failing = tmp_path / "npm"
    failing.write_text("#!/bin/sh\necho 'E404 not found' >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(openclaw.OpenClawUnavailable, match=r"failed \(exit 3\):\nE404 not found"):
        openclaw.install(tmp_path / "c", npm=str(failing))


def test_cli_openclaw_exits_1_when_it_cannot_install_and_2_for_a_window_openclaw_refuses(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(openclaw.shutil, "which", lambda name: None)
    assert main(["openclaw", "--root", str(tmp_path / "none"), "--url", "http://127.0.0.1:9/v1"]) == 1
    assert "cannot install OpenClaw: npm is not installed" in capsys.readouterr().err
    claw = openclaw.OpenClaw(tmp_path, tmp_path / "node", tmp_path / "openclaw.mjs")
    monkeypatch.setattr(openclaw, "install", lambda root: claw)
    argv = ["openclaw", "--root", str(tmp_path), "--url", "http://127.0.0.1:9/v1", "--context-window", "2048"]
    assert main(argv) == 2
    assert "at least 4000 tokens" in capsys.readouterr().err
    assert main([*argv[:-1], "16384", "--model", "m"]) == 0  # no ARGS: configure only
    config = json.loads((tmp_path / "home" / "openclaw.json").read_text())
    assert config["models"]["providers"]["clawray"]["models"][0]["contextWindow"] == 16384
    assert config["agents"]["defaults"]["workspace"] == str(tmp_path / "workspace")

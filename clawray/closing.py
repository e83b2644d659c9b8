"""What a run prints when it ends: where the trained model is, the commands that use it (serve,
evaluate, report) with paths that work when pasted, and each evaluation measure before -> after.

Owns: the text of those lines and the ``clawray eval`` command that reproduces the job's own
evaluation. Must not: read actors or write files.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any

from omegaconf import DictConfig


def clawray_command() -> str:
    """The ``clawray`` executable to print in a command a user pastes: the one beside this Python
    (``.venv/bin/clawray``, absolute) when it exists, else ``clawray``."""
    exe = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "clawray")
    return shlex.quote(exe) if os.path.isfile(exe) else "clawray"


def eval_command(cfg: DictConfig, model: str) -> str:
    """The ``clawray eval`` command that reproduces the job's own evaluation of ``model``: the same
    environment, prompts, samples, temperature, seeds, token cap, engine backend and precision; paths
    absolute and quoted for a POSIX shell."""
    from clawray.checkpoint import engine_dtype

    env, ev, ro = cfg.env, cfg.eval, cfg.rollout
    data = f" --data-path {_path(env.data_path)}" if env.name in ("student", "teacher") else ""
    return (
        f"{clawray_command()} eval {_path(model)} --env {env.name} --level {env.level}{data} --n {ev.n} "
        f"--num-prompts {ev.num_prompts} --temperature {ev.temperature} --seed {ev.seed} "
        f"--max-tokens {env.max_tokens} --backend {ro.backend} --dtype {engine_dtype(ro.backend, ro.dtype)}"
        + (" --untagged-tool-calls" if cfg.serve.untagged_tool_calls else "")
    )


def closing_lines(cfg: DictConfig, last_checkpoint: dict[str, Any] | None) -> list[str]:
    """Where the trained model is and the commands that use it (serve, evaluate, report), with
    absolute paths and the ``clawray`` beside this Python, so they work when pasted."""
    run_dir = os.path.abspath(cfg.run_dir)
    exe = clawray_command()
    lines = []
    if last_checkpoint is not None:
        model = os.path.join(os.path.abspath(last_checkpoint["path"]), "model")
        slim = "" if not cfg.checkpoint.save_optimizer else "; checkpoint.save_optimizer=false keeps only the model"
        lines += [
            f"trained model (policy v{last_checkpoint['version']}): {model} "
            f"(checkpoint {last_checkpoint['bytes'] / 2**20:.0f} MiB{slim})",
            f"serve it:    {exe} serve {_path(model)}{_serve_address(cfg)}   (as it is, no training; train on: "
            f"{exe} run ... model.path={_path(model)})",
        ]
        if cfg.env.enabled or cfg.eval.enabled:
            lines.append(f"evaluate it: {eval_command(cfg, model)}")
    lines.append(f"report:      {exe} report {_path(run_dir)}   (plots in {os.path.join(run_dir, 'report')}/)")
    return lines


def _serve_address(cfg: DictConfig) -> str:
    """`` serve.host=H serve.port=P`` where the job served elsewhere than the default address (so
    the printed serve command answers where the job's clients were pointed), else ``""``."""
    from clawray.config import ServeConfig

    default = ServeConfig()
    return "".join(
        f" serve.{key}={shlex.quote(str(cfg.serve[key]))}"
        for key in ("host", "port")
        if cfg.serve[key] != getattr(default, key)
    )


def _path(path: str) -> str:
    """``path`` absolute (``~`` expanded), quoted for a POSIX shell where it needs quotes."""
    return shlex.quote(os.path.abspath(os.path.expanduser(path)))


def eval_change_lines(results: list[dict[str, Any]]) -> list[str]:
    """The closing lines: each eval measure before -> after with its 95% CI (first and last
    evaluation of the run); ``[]`` with fewer than two evaluations."""
    from clawray.evaluation import format_change

    if len(results) < 2:
        return []
    first, last = results[0], results[-1]
    head = (
        f"eval on {last['env']} {last['split']} ({last['samples']} samples each): step {first['step']} "
        f"(v{first['policy_version']}) -> step {last['step']} (v{last['policy_version']})"
    )
    return [head, *(f"  {line}" for line in format_change(first["metrics"], last["metrics"]))]

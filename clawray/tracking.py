"""Metrics: wandb (offline by default) plus a ``metrics.jsonl`` in the run folder."""

from __future__ import annotations

import json
import os
from typing import Any


class Tracker:
    """Logs one dict of scalars per policy update.

    Args:
        run_dir: the run folder (``metrics.jsonl``, rewritten from scratch, and the offline wandb run go there).
        mode: wandb mode: ``"offline"`` (default; ``wandb sync`` uploads later), ``"online"`` or
            ``"disabled"`` (jsonl only).
        project, name: wandb project and run name.
        config: the resolved run config, stored with the run.
    """

    def __init__(self, run_dir: str, mode: str = "offline", project: str = "clawray", name: str = "",
                 config: dict | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        open(self.path, "w").close()  # one run per folder: a rerun starts the file afresh
        self.run = None
        if mode != "disabled":
            import wandb

            self.run = wandb.init(project=project, name=name or None, dir=run_dir, mode=mode, config=config or {},
                                  reinit="finish_previous")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Append ``metrics`` (scalars) for ``step`` to wandb and ``metrics.jsonl``."""
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self) -> None:
        """Close the wandb run."""
        if self.run is not None:
            self.run.finish()
            self.run = None

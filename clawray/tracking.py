"""Metrics: wandb (offline by default) plus a ``metrics.jsonl`` in the run folder."""

from __future__ import annotations

import json
import math
import os
from typing import Any


class Tracker:
    """Logs one dict of scalars per policy update.

    Args:
        run_dir: the run folder (``metrics.jsonl`` and the offline wandb run go there).
        mode: wandb mode: ``"offline"`` (default; ``wandb sync`` uploads later), ``"online"`` or
            ``"disabled"`` (jsonl only).
        project, name: wandb project and run name.
        config: the resolved run config, stored with the run.
        resume_step: a resumed run keeps the ``metrics.jsonl`` rows up to this step (later ones, from
            after the checkpoint, are dropped); None (a fresh run) starts the file afresh.
    """

    def __init__(self, run_dir: str, mode: str = "offline", project: str = "clawray", name: str = "",
                 config: dict | None = None, resume_step: int | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        kept = []
        if resume_step is not None and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= resume_step]
        with open(self.path, "w") as f:
            f.writelines(kept)
        self.run = None
        if mode != "disabled":
            import wandb

            self.run = wandb.init(project=project, name=name or None, dir=run_dir, mode=mode, config=config or {},
                                  reinit="finish_previous")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Append ``metrics`` (scalars) for ``step`` to wandb and ``metrics.jsonl`` (a non-finite
        value, i.e. a metric undefined at this step, is written as ``null``: strict JSON)."""
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **row}) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self) -> None:
        """Close the wandb run."""
        if self.run is not None:
            self.run.finish()
            self.run = None

"""Metrics: wandb (offline by default) plus a ``metrics.jsonl`` in the run folder.

Owns: the run's wandb run (its id, mode and resume), ``metrics.jsonl`` (strict JSON rows, cut back to
the checkpoint's step on resume) and ``config.json``. Must not: compute a metric (the row is
:mod:`clawray.step_metrics`'s) or end the run over a row the disk refused (it is counted and said).

A resumed run continues the same wandb run: the driver stores :attr:`MetricsLog.run_id` in each
checkpoint's ``driver.json`` and passes it back (``run_id``), and wandb reopens that id with
``resume="allow"``. Online this appends to the one history. Offline, wandb writes a second
``offline-run-*-<id>`` folder with the same id; ``wandb sync`` uploads the folders of one id in order
of their start time into that one run. The config is logged through :func:`clawray.config.redacted`:
API keys and URL passwords never reach wandb.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from clawray.config import redacted
from clawray.file_modes import open_private, private_dir, private_tree, private_umask
from clawray.records import append_whole, read_jsonl


class MetricsLog:
    """Logs one dict of scalars per policy update.

    Args:
        run_dir: the run folder (``metrics.jsonl``, ``config.json`` and the offline wandb run go there).
        mode: wandb mode: ``"offline"`` (default; ``wandb sync`` uploads later), ``"online"`` or
            ``"disabled"`` (jsonl only).
        project, name: wandb project and run name.
        config: the resolved run config, stored with the run.
            Secret fields (:func:`clawray.config.secret`) are replaced by ``"***"`` before logging.
        resume_step: a resumed run keeps the ``metrics.jsonl`` rows up to this step (later ones, from
            after the checkpoint, are dropped); None (a fresh run) starts the file afresh.
        run_id: the wandb run id to continue (a resumed run: the id its checkpoint stored); None
            starts a new wandb run. Online, steps that the old run logged after its checkpoint are
            already in the history: wandb drops re-logged steps that are not past its last one
            (with a warning), while ``metrics.jsonl`` holds the rows of the resumed run.
        resume_row: the checkpointed step's row as its checkpoint stored it (:meth:`row`); a resume
            whose ``metrics.jsonl`` lacks that step (the driver was killed between the checkpoint's
            commit and the row's append) writes it back, to wandb too. Its ``timing/checkpoint_s``
            is absent: the checkpoint was not written yet when the row was stored.
    """

    def __init__(
        self,
        run_dir: str,
        mode: str = "offline",
        project: str = "clawray",
        name: str = "",
        config: dict | None = None,
        resume_step: int | None = None,
        run_id: str | None = None,
        resume_row: dict | None = None,
    ):
        private_dir(run_dir)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.write_errors = 0  # rows the disk refused (left out whole, said on the terminal)
        kept = []  # a row torn by a kill mid-append (or damaged) is left out, and said
        if resume_step is not None:
            rows = read_jsonl(self.path, "metrics", print, skip_damaged=True)
            kept = [row for row in rows if row.get("step", 0) <= resume_step]
        restored = None  # the checkpointed step's row, lost by a kill right after the checkpoint's commit
        if resume_step is not None and resume_row is not None and resume_row.get("step") == resume_step:
            if not any(row.get("step") == resume_step for row in kept):
                restored = resume_row
                kept.append(restored)
        with open_private(self.path) as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
        # every row carries `time/elapsed_s`, wall seconds since the tracker started (a resumed run
        # continues from its last kept row), so `clawray report` can plot against wall time
        last = [row.get("time/elapsed_s") for row in kept]
        self._t0 = time.monotonic() - next((t for t in reversed(last) if isinstance(t, (int, float))), 0.0)
        # the resolved config (secrets hidden) beside the metrics: `clawray report` draws the guards' bounds from it
        with open_private(os.path.join(run_dir, "config.json")) as f:
            json.dump(redacted(config or {}), f, indent=2)
        self.run, self._run_id = None, None
        self.wandb_dir = os.path.join(run_dir, "wandb")
        if mode != "disabled":
            import wandb

            resume = {"id": run_id, "resume": "allow"} if run_id else {}
            private_dir(os.path.join(run_dir, "wandb"))
            old_umask = private_umask()  # the wandb service this starts writes 0600 files
            try:
                self.run = wandb.init(
                    project=project,
                    name=name or None,
                    dir=run_dir,
                    mode=mode,
                    config=redacted(config or {}),
                    reinit="finish_previous",
                    **resume,
                )
            finally:
                os.umask(old_umask)
            self._run_id = self.run.id
            if restored is not None:
                self.run.log({k: v for k, v in restored.items() if k != "step"}, step=resume_step)

    @property
    def run_id(self) -> str | None:
        """The wandb run id (stored with each checkpoint so a resume continues this run), also after
        :meth:`finish`; None when wandb is disabled."""
        return self._run_id

    def row(self, metrics: dict[str, Any], step: int) -> dict[str, Any]:
        """The ``metrics.jsonl`` row of ``metrics`` (scalars) at ``step``: ``{"step": step, ...}``
        with ``time/elapsed_s`` (wall seconds since the run started) added and a non-finite value
        (a metric undefined at this step) as ``None``, so the row is strict JSON."""
        metrics = {**metrics, "time/elapsed_s": round(time.monotonic() - self._t0, 3)}
        return {
            "step": step,
            **{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()},
        }

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Append ``metrics`` (scalars) for ``step`` to wandb and ``metrics.jsonl`` as :meth:`row`
        writes it."""
        row = self.row(metrics, step)
        line = (json.dumps(row) + "\n").encode()
        try:
            with open_private(self.path, "a+") as f:  # readable: append_whole cuts a torn last row
                append_whole(f.fileno(), line)  # whole or not at all: never a torn row
        except OSError as e:  # a full disk loses this row (counted, said), never the run
            self.write_errors += 1
            print(
                f"[clawray] metrics.jsonl: step {step}'s row not written ({e.strerror or type(e).__name__})", flush=True
            )
        if self.run is not None:
            self.run.log({**metrics, "time/elapsed_s": row["time/elapsed_s"]}, step=step)

    def finish(self) -> None:
        """Close the wandb run."""
        if self.run is not None:
            self.run.finish()
            self.run = None
            private_tree(self.wandb_dir)

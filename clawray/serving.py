"""``clawray serve``: serve a trained policy as it is, with no learner, judge or checkpoint.

Owns: the life of ``clawray serve`` (run folder lock, Ray, engines, :class:`ServingTracker`,
endpoint, all stopped at a signal), the overrides read from a policy card and the serving tracker.
Must not: judge, train, queue samples, sync weights or write a checkpoint.

Training (``clawray run``) serves the policy it is changing; a user who wants to use or A/B the
trained agent needs the same endpoint on fixed weights. :func:`serve_policy` starts the rollout
engines on a model folder (a checkpoint's ``model/``), the :class:`~clawray.serve.app.PolicyServer`
and a :class:`ServingTracker` that keeps the session book (session inference, exact prompt splicing
across turns) and records every served main-line turn to ``RUN_DIR/records/turns.jsonl`` (with
``records.enabled``), but judges and trains nothing. Replies carry the checkpoint's own policy
version (its policy card, ``model/clawray.json``); the engine runs in the precision the policy was
sampled in (the card's ``rollout.backend`` and ``rollout.dtype``) unless the command line says
otherwise.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import ray

from clawray.checkpoint import engine_dtype
from clawray.config import ClawrayConfig, section
from clawray.records import TurnRecords
from clawray.serve.instance import APP_NAME, ServeLease
from clawray.session_book import SessionBook
from clawray.types import Turn


class ServingTracker:
    """The session tracker of plain serving: :class:`~clawray.session_book.SessionBook` bookkeeping (the
    server's lookup and turn indexes) and turn records; nothing is judged or queued.

    Args:
        cfg: the run's config (:class:`~clawray.config.ClawrayConfig`, or a mapping of the keys that
            differ from its defaults): ``session.idle_timeout_s`` (sessions without a request for this
            long are closed; 0 = never), ``records.max_mb`` and ``keep_files`` (the records' rotation).
        records_dir: where ``turns.jsonl`` goes, or None for no records.
    """

    def __init__(self, cfg: Any = None, records_dir: str | None = None):
        cfg = section(ClawrayConfig, cfg or {})
        self.book = SessionBook()
        self.records = TurnRecords(records_dir, int(cfg.records.max_mb * 2**20), cfg.records.keep_files)
        self.idle_timeout_s = cfg.session.idle_timeout_s
        self.counts = {
            "turns": 0,
            "paired": 0,
            "paired_after_rewrite": 0,
            "sessions_closed": 0,
            "sessions_idle_closed": 0,
        }

    async def lookup(
        self,
        session_id: str | None,
        keys: dict[int, str],
        render_key: str | None = None,
        auto_only: bool = False,
        exact: dict[int, str] | None = None,
        hint: str | None = None,
        user: str | None = None,
        last_reply: str | None = None,
    ) -> dict:
        """:meth:`clawray.session_book.SessionBook.find`."""
        return self.book.find(session_id, keys, render_key, auto_only, exact, hint, user, last_reply)

    async def record_turns(self, turns: list[Turn], done: bool = False, outcome: float | None = None) -> list[int]:
        """Record one request's served main-line turns; returns their 1-based indexes (``outcome`` is
        accepted and ignored: nothing is trained)."""
        for sid in self.book.idle(self.idle_timeout_s) if self.idle_timeout_s > 0 else ():  # 0 = never
            self.book.close(sid, idle=True)  # its conversation may come back: found among the closed ones
            self.counts["sessions_idle_closed"] += 1
        s = self.book.open(turns[0].session_id, turns[0].messages)
        if s.pending:
            pairing = self.book.pair(s, turns[0].messages)
            self.counts["paired"] += pairing.chosen is not None
            self.counts["paired_after_rewrite"] += pairing.rewritten
        self.book.add(s, turns)
        for turn in turns:
            self.records.turn(turn)
        self.counts["turns"] += len(turns)
        if done:
            await self.close_session(turns[0].session_id, outcome)
        return [t.turn_index for t in turns]

    async def set_outcome(self, session_id: str, outcome: float) -> None:
        """Accepted and ignored (nothing is trained)."""

    async def close_session(self, session_id: str, outcome: float | None = None) -> None:
        """Close a session (``X-Session-Done``)."""
        if self.book.close(session_id) is not None:
            self.counts["sessions_closed"] += 1

    async def stats(self) -> dict:
        """Counters: turns, turns paired with a next state (nothing judges them), sessions closed (by
        the client, idle) and open sessions."""
        return {**self.counts, "open_sessions": len(self.book)}


ServingTrackerActor = ray.remote(ServingTracker)


def serving_overrides(model_dir: str) -> list[str]:
    """The overrides that serve ``model_dir`` as its job sampled it: ``model.path`` and, from its
    policy card, ``rollout.backend`` and ``rollout.dtype`` (nothing more for a plain model folder).
    The user's own overrides come after these and win."""
    from clawray.checkpoint import read_policy_card

    out = [f"model.path={model_dir}"]
    engine = (read_policy_card(model_dir) or {}).get("engine") or {}
    if engine.get("backend") in ("vllm", "hf"):
        out.append(f"rollout.backend={engine['backend']}")
    if isinstance(engine.get("dtype"), str):
        out.append(f"rollout.dtype={engine['dtype']}")
    return out


def policy_version_of(model_dir: str) -> int:
    """The policy version in ``model_dir``'s policy card (0 for a plain model folder)."""
    from clawray.checkpoint import read_policy_card

    version = (read_policy_card(model_dir) or {}).get("policy_version", 0)
    return version if isinstance(version, int) and version >= 0 else 0


class PolicyService:
    """The running pieces of ``clawray serve`` (:meth:`start`, :meth:`stop`).

    Args:
        cfg: the config (``model.path`` is the model folder to serve; ``rollout``, ``serve``,
            ``records``, ``session``, ``ray`` and ``run_dir`` are read).
    """

    def __init__(self, cfg: Any):
        from clawray.config import model_path
        from clawray.run_lock import RunFolderLock

        self.cfg = cfg
        self.model_dir = model_path(cfg)
        self.run_dir = os.path.abspath(cfg.run_dir)
        self.version = policy_version_of(self.model_dir)
        self.engines: list = []
        self.tracker = None
        self.base_url = ""
        self._lock = RunFolderLock(self.run_dir)
        self._owns_ray = False
        self.serve = ServeLease(APP_NAME)  # stops all of Serve at the end only if this started it

    def start(self) -> str:
        """Start Ray (local unless ``ray.address``), the engines, the tracker and the endpoint;
        returns the base URL (``.../v1``). On a failure, everything started is stopped first.

        Raises:
            RunFolderInUse: another run owns ``run_dir``.
            RuntimeError: an engine or the server did not start.
        """
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> str:
        from omegaconf import OmegaConf

        from clawray.actors.rollout import RolloutEngineActor
        from clawray.file_modes import private_dir
        from clawray.ray_env import init_ray
        from clawray.recovery import engine_options
        from clawray.serve.deploy import start_policy_server

        cfg, ro = self.cfg, self.cfg.rollout
        private_dir(self.run_dir)
        self._lock.acquire()
        self._owns_ray = not ray.is_initialized()
        init_ray(cfg.ray.address, cfg.ray.num_cpus)
        rollout = OmegaConf.to_object(ro)  # as the job's engines: the same precision
        self.engines = [
            RolloutEngineActor.options(
                num_cpus=ro.num_cpus,
                num_gpus=ro.num_gpus,
                resources=dict(ro.resources) or None,
                **engine_options(ro.max_restarts),
            ).remote(self.model_dir, rollout, name=f"rollout-{i}", seed=cfg.seed, version=self.version)
            for i in range(ro.num_engines)
        ]
        ray.get([e.ready.remote() for e in self.engines])
        records = os.path.join(self.run_dir, "records") if cfg.records.enabled else None
        self.tracker = ServingTrackerActor.options(num_cpus=0).remote(OmegaConf.to_object(cfg), records)
        serve_cfg = OmegaConf.to_object(cfg.serve)
        self.base_url = self.serve.deploy(
            lambda: start_policy_server(self.model_dir, self.engines, self.tracker, serve_cfg, ro.max_model_len)
        )
        return self.base_url

    def stop(self) -> None:
        """Stop the endpoint, the actors and (when this started it) Ray; release the run folder.
        Idempotent."""
        try:
            if ray.is_initialized():
                try:
                    self.serve.release()
                except Exception:  # noqa: BLE001 - the rest must still be released
                    pass
                for actor in [*self.engines, self.tracker]:
                    if actor is not None:
                        try:
                            ray.kill(actor)
                        except Exception:  # noqa: BLE001 - already gone
                            pass
                if self._owns_ray:
                    ray.shutdown()
            self.engines, self.tracker = [], None
        finally:
            self._lock.release()


def serve_policy(cfg: Any, stop: threading.Event | None = None) -> int:
    """``clawray serve``: serve ``cfg.model.path`` until SIGINT/SIGTERM (or ``stop`` is set); returns
    the exit status (0)."""
    service = PolicyService(cfg)
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        t0 = time.perf_counter()
        url = service.start()
        ro = cfg.rollout
        dtype = engine_dtype(ro.backend, ro.dtype)
        print(
            f"[clawray] serving {service.model_dir} (policy v{service.version}) at {url} in {time.perf_counter() - t0:.1f}s: "
            f"{ro.num_engines} engine(s) ({ro.backend}, {dtype}); no learner, no judge, nothing is trained; "
            "Ctrl-C stops",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
        print("[clawray] stopping", flush=True)
    finally:
        service.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0

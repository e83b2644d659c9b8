"""The simulated users of a run (``env.enabled``): start, stop, and hold them for the serial loop.

Owns: the :class:`~clawray.envs.sim_user.SimUserPoolActor` of a run. Must not: train or judge.
"""

from __future__ import annotations

from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf


class SimUsers:
    """The run's simulated users, talking to the policy server.

    Args:
        cfg: the run's config (``env.*``, ``serve.model_name``, ``trainer.overlap``).

    Attributes:
        pool: the :class:`~clawray.envs.sim_user.SimUserPoolActor` while the users run, else None.
        last_stats: the pool's counters read when it stopped (``{}`` before).
    """

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.pool: Any = None
        self.last_stats: dict = {}

    def start(self, base_url: str) -> None:
        """Start the users against ``base_url`` (a no-op unless ``env.enabled``).

        Raises:
            RuntimeError: ``env.client=openclaw`` and OpenClaw cannot be set up (the cause is named).
        """
        from clawray.envs.sim_user import SimUserPoolActor

        if not self.cfg.env.enabled:
            return
        env = OmegaConf.to_object(self.cfg.env)
        self.pool = SimUserPoolActor.options(num_cpus=0).remote(base_url, env, self.cfg.serve.model_name)
        try:
            ray.get(self.pool.start.remote())
        except ray.exceptions.RayTaskError as e:  # OpenClaw not installable, endpoint's context too short
            ray.kill(self.pool)
            self.pool = None
            cause = e.cause if e.cause is not None else e
            raise RuntimeError(
                f"the simulated users (env.client={self.cfg.env.client}) cannot start: {cause}"
            ) from None

    def stop(self) -> None:
        """Stop the users (waits up to 30 s for their sessions to end) and keep their counters."""
        if self.pool is None:
            return
        try:
            ray.get(self.pool.stop.remote(), timeout=30)
            self.last_stats = ray.get(self.pool.get_stats.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - the users' counters are optional; stopping is not
            pass
        self.pool = None

    def stats(self, read: Any) -> dict:
        """The users' counters: read through ``read(name, ref, default)`` while they run
        (:meth:`clawray.run_stats.RunStats.read`), else the ones kept when they stopped."""
        return read("sim_user", self.pool.get_stats.remote(), {}) if self.pool is not None else self.last_stats

    def hold(self, tracker: Any) -> None:
        """Serial loop (``trainer.overlap: false``): hold the users and wait until their requests in
        flight are answered and ``tracker``'s judgements are done (a no-op in the asynchronous loop,
        or without users)."""
        if self.cfg.trainer.overlap or self.pool is None:
            return
        timeout = self.cfg.env.request_timeout_s
        left = ray.get(self.pool.hold.remote(timeout))
        if left:
            print(f"[clawray] serial loop: {left} request(s) still in flight after {timeout:.0f}s", flush=True)
        ray.get(tracker.drain.remote(timeout))

    def release(self) -> None:
        """Let the users held by :meth:`hold` go on (a no-op in the asynchronous loop)."""
        if not self.cfg.trainer.overlap and self.pool is not None:
            ray.get(self.pool.release.remote())

"""The driver's side of weight sync: :class:`WeightSyncController`.

Owns: the group's generations, the pause and resume around each sync and its deadline, the names of
the failed members, the rebuild after a failure and the sync's step metrics. Must not: pack or move a
weight (each member's transport does, inside its actor) or decide when to sync (:mod:`clawray.driver`,
:mod:`clawray.resume`, :mod:`clawray.recovery`).

It builds the group (one :class:`~clawray.weight_sync.transport.TransportSpec` per generation, a new
rendezvous port or an emptied mailbox each time), pauses the engines, runs one sync under
``timeout_s``, always resumes the engines, names the engines that failed and rebuilds the group before
the next sync when one failed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray

from clawray.engines.base import WeightSpec
from clawray.weight_sync.mailbox import WeightMailboxActor, abort_reason
from clawray.weight_sync.plan import WeightSyncError
from clawray.weight_sync.transport import TransportSpec


def _collect(named: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], dict[str, str]]:
    """Wait up to ``timeout_s`` seconds for every ref; ``(results by name, one-line errors by name)``."""
    refs = list(named.values())
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    ready_set = set(ready)
    results, errors = {}, {}
    for name, ref in named.items():
        if ref not in ready_set:
            errors[name] = f"timed out after {timeout_s:g}s"
            continue
        try:
            results[name] = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - every member failure is reported by name
            errors[name] = abort_reason(e)
    return results, errors


def _group_error(message: str, errors: dict[str, str]) -> WeightSyncError:
    err = WeightSyncError(message)
    err.errors = errors  # {member name: cause}
    return err


class WeightSyncController:
    """The driver's side of weight sync: builds the transport on every member, runs each sync
    under a deadline, never leaves an engine paused, names the members that failed and rebuilds
    the group before the next sync after any failure.

    Args:
        senders: learner actor handles, rank 0 first. Each has ``ready()``,
            ``init_weight_sender(spec, check)``, ``stage_weights(version)`` (gathers the full state
            dict ahead of the pause; ``{"gather_s"}`` on rank 0) and ``sync_weights(version)``
            returning ``{"bytes", "gather_s", "send_s"}`` on rank 0 (every rank is called for both:
            the gather is collective); rank 0 also has ``sync_rendezvous(host)`` (binds the collective's rendezvous
            on its node, returns ``(host, port)``).
        engines: RolloutEngine actor handles (receivers ``1..len(engines)``); each has
            ``init_weight_receiver(rank, spec)``, ``receive_weights(version)``, ``pause``, ``resume``.
        names: the engines' names (``"rollout-0"``, ...), used in errors and metric keys.
        plan: the ordered weight specs (from an engine's ``weight_specs``).
        transport: ``"collective"``, ``"object_store"``, ``"ipc"`` (same host only: refused at
            :meth:`connect` when an engine runs on another host) or ``"auto"`` (``ipc`` when every
            engine shares learner rank 0's host, else ``collective``; decided at each connect:
            :func:`clawray.placement.resolve_transport`).
        bucket_bytes: maximum bytes per flat bucket.
        timeout_s: deadline in seconds of one sync (and of every collective inside it); the group
            rebuild waits up to twice that.
        backend: collective backend, ``"gloo"`` or ``"nccl"``.
        host: address the collective group's rendezvous binds on learner rank 0's node; "" (default)
            = that node's Ray address. Rank 0 binds it and picks the port there (``rendezvous``
            holds the published ``(host, port)`` after :meth:`connect`).
        mode: ``"interrupt"`` (the engines stop their running generations at the current token and
            continue them after the load: partial rollouts), ``"drain"`` (they finish them first) or
            ``"inflight"`` (no pause: each engine receives while it generates and loads between two
            steps, its running generations going on); see :mod:`clawray.actors.rollout`.

    Raises:
        ValueError: an unknown ``transport`` or ``mode``.
    """

    @classmethod
    def from_config(
        cls, sync: Any, senders: list, engines: list, names: list[str], plan: list[WeightSpec]
    ) -> "WeightSyncController":
        """A controller configured by the ``sync`` section (:class:`~clawray.config.SyncConfig`:
        ``transport``, ``bucket_mb``, ``timeout_s``, ``mode``).

        Raises:
            ValueError: an unknown transport or mode.
        """
        return cls(
            senders,
            engines,
            names,
            plan,
            transport=sync.transport,
            bucket_bytes=sync.bucket_mb << 20,
            timeout_s=sync.timeout_s,
            mode=sync.mode,
        )

    def __init__(
        self,
        senders: list,
        engines: list,
        names: list[str],
        plan: list[WeightSpec],
        *,
        transport: str = "collective",
        bucket_bytes: int = 64 << 20,
        timeout_s: float = 120.0,
        backend: str = "gloo",
        host: str = "",
        mode: str = "interrupt",
    ):
        if mode not in ("interrupt", "drain", "inflight"):  # [sync.mode]
            raise ValueError(f"unknown sync mode {mode!r}; expected 'interrupt', 'drain' or 'inflight'")
        self.mode = mode
        self.senders, self.engines, self.names = list(senders), list(engines), list(names)
        self.requested = transport  # [placement] "auto" is resolved into spec.kind at each connect
        self.host = host
        self.rendezvous: tuple[str, int] | None = None  # the collective's published (host, port)
        self.note = ""  # why auto did not pick ipc on one host (no room in /dev/shm), for the placement line
        # raises ValueError for an unknown transport; host, port and mailbox are set per group generation
        self.spec = TransportSpec(
            kind="collective" if transport == "auto" else transport,
            world_size=1 + len(self.engines),
            plan=list(plan),
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            backend=backend,
        )
        self.timeout_s = timeout_s
        self.connected = False  # the group is built and in step
        self.behind = False  # the last sync failed: some engine may lag the learner's version
        self.failures = 0  # failed syncs so far
        self.rebuilds = 0  # group rebuilds after a failure
        self.last_error: str | None = None
        self._mailbox = None

    @property
    def transport(self) -> str:
        """The transport in use: ``sync.transport``, or what ``auto`` resolved to at the last connect."""
        return self.spec.kind

    def _member_names(self) -> list[str]:
        return [f"learner-{i}" for i in range(len(self.senders))] + self.names

    def connect(self, check_plan: bool = True) -> float:
        """(Re)build the transport on the sender and every receiver (a new rendezvous port, or a new
        mailbox), after waiting for each member to finish the jobs it still runs.

        Args:
            check_plan: the sender also checks the plan against the learner's state dict (gathers it).

        Returns:
            seconds taken.

        Raises:
            WeightSyncError: naming every member that was not ready or failed to join, with the cause.
        """
        t0 = time.perf_counter()
        self.connected = False
        members = list(zip(self._member_names(), self.senders + self.engines))
        # a member still busy with a failed sync's job cannot join a new rendezvous: wait for it first
        _, errors = _collect({n: m.ready.remote() for n, m in members}, self.timeout_s)
        if errors:
            raise _group_error(self._describe("rebuilding the sync group", errors, "not ready"), errors)
        self._place()  # [placement] transport for where the members run; rank 0 binds the rendezvous
        if self.spec.kind in ("object_store", "ipc"):  # one mailbox for the controller's lifetime, emptied here
            if self._mailbox is None:
                self._mailbox = WeightMailboxActor.options(num_cpus=0).remote()
            _, errors = _collect({"mailbox": self._mailbox.reset.remote()}, 2 * self.timeout_s + 30)
            if errors:
                raise _group_error(self._describe("starting the weight mailbox", errors), errors)
        host, port = self.rendezvous or ("", 0)
        spec = dataclasses.replace(self.spec, host=host, port=port, mailbox=self._mailbox)
        named = {
            n: s.init_weight_sender.remote(spec, check=check_plan) for n, s in zip(self._member_names(), self.senders)
        }
        named.update(
            {n: e.init_weight_receiver.remote(i + 1, spec) for i, (n, e) in enumerate(zip(self.names, self.engines))}
        )
        _, errors = _collect(named, 2 * self.timeout_s)
        if errors:
            raise _group_error(self._describe("building the sync group", errors), errors)
        self.connected = True
        return time.perf_counter() - t0

    def _place(self) -> None:
        """[placement] Resolve ``auto`` (or refuse a forced ``ipc`` across hosts) from the members' node
        addresses, then, for a collective, have learner rank 0 bind the rendezvous on its own node
        and publish ``(host, port)`` (``self.rendezvous``).

        Raises:
            WeightSyncError: a forced ``ipc`` with an engine on another host, or rank 0 could not bind.
        """
        from clawray.placement import IPC_SHM_ROOM, actor_locations, resolve_transport, shm_free_bytes
        from clawray.weight_sync.plan import plan_bytes

        self.rendezvous = None
        self.note = ""
        if self.requested in ("auto", "ipc"):
            try:
                where = actor_locations(
                    dict(zip(["learner-0", *self.names], [self.senders[0], *self.engines])), self.timeout_s
                )
                sender = where.pop("learner-0")
                shm_free = None
                if self.requested == "auto" and not sender[1]:  # on CPU ipc's buffers live in /dev/shm
                    shm_free = ray.get(self.senders[0].__ray_call__.remote(shm_free_bytes), timeout=self.timeout_s)
                payload = plan_bytes(self.spec.plan)
                kind = resolve_transport(self.requested, sender, where, shm_free, payload)
                if kind != resolve_transport(self.requested, sender, where):  # ipc but for /dev/shm's room
                    self.note = f"auto: /dev/shm has {shm_free >> 20} MiB free, ipc needs {int(IPC_SHM_ROOM * payload) >> 20} MiB"
                self.spec = dataclasses.replace(self.spec, kind=kind)
            except ValueError as e:
                raise _group_error(str(e), {"sync group": str(e)}) from None
            except ray.exceptions.RayError as e:
                raise _group_error(
                    f"locating the sync group's members failed: {abort_reason(e)}", {"sync group": abort_reason(e)}
                ) from None
        if self.spec.kind == "collective":
            results, errors = _collect({"learner-0": self.senders[0].sync_rendezvous.remote(self.host)}, self.timeout_s)
            if errors:
                raise _group_error(self._describe("binding the sync rendezvous", errors), errors)
            self.rendezvous = tuple(results["learner-0"])

    def _describe(self, what: str, errors: dict[str, str], prefix: str = "") -> str:
        engines_first = [n for n in self.names if n in errors] + [n for n in errors if n not in self.names]
        parts = [f"{n} ({prefix + ': ' if prefix else ''}{errors[n]})" for n in engines_first]
        return f"{what} failed on {', '.join(parts)}"

    def sync(self, version: int, hold: bool = False, only: list[int] | None = None) -> dict[str, Any]:
        """Have the learners gather their full weights (the engines still serve), then pause the
        engines, send the weights stamped ``version``, load them, resume: a pause covers the transfer
        and the load only (the gather was 60% of the CPU demo's pauses: 1.05 s of 1.76 s).

        ``hold=True`` (the promotion gate, :mod:`clawray.gate`): after a sync that reached every engine
        the engines stay paused (``held`` in the result; any mode pauses, ``inflight`` as
        ``interrupt``): the users' requests wait while the caller probes the loaded weights with
        probe generations, until :meth:`release` or the next sync. A held sync that failed after the
        pause leaves them paused too (``held`` False, ``paused`` True): some may have loaded weights the
        caller now withdraws, so it resumes them itself (the gate syncs its rollback, then releases the
        engines that serve it).

        ``only`` (engine indexes; the gate's canary, :mod:`clawray.canary`): only those engines are
        paused (``drain``: their running generations finish on the old weights) and load the weights;
        every other engine takes part in the transfer (a broadcast needs every member) off its engine
        thread, drops it and keeps serving its version unpaused.

        Never raises for a member's failure and, unless ``hold``, never leaves an engine paused: the result says what
        happened, and the next call rebuilds the group first and sends its (newer) weights to every
        engine, so lagging engines catch up.

        Returns:
            ``ok`` (bool), ``version``, ``seconds`` (gather -> resume, wall), ``bytes`` (payload sent
            once), ``gather_s`` (learner rank 0's, before the pause), ``send_s``, ``receive_s`` and ``load_s`` (``{engine: seconds}``),
            ``failed`` (names of the members that failed, engines first), ``error`` (one line naming
            them and the cause, or None), ``rebuild_s`` (seconds spent rebuilding the group first, 0
            when it was in step), ``versions`` (``{engine: policy version or None}`` afterwards),
            ``pause_s`` (seconds from pausing the engines until they all resumed: what a request
            arriving meanwhile waits at most; a drain included; inflight: the longest load, the time
            an engine stepped nothing), ``interrupted`` (generations the pause stopped part-way and the
            engines continued on the new weights; 0 in drain and inflight modes) and ``inflight``
            (generations running across an in-flight load; 0 in the other modes), ``held`` (the
            engines stay paused: ``hold`` and every member succeeded), ``paused`` (the engines stay
            paused: ``hold`` and the sync reached the pause, whatever happened after it).
        """
        t0 = time.perf_counter()
        out: dict[str, Any] = {
            "ok": False,
            "version": version,
            "seconds": 0.0,
            "bytes": 0.0,
            "gather_s": 0.0,
            "send_s": 0.0,
            "receive_s": {},
            "load_s": {},
            "failed": [],
            "error": None,
            "rebuild_s": 0.0,
            "pause_s": 0.0,
            "interrupted": 0,
            "inflight": 0,
            "held": False,
            "paused": False,
        }
        errors: dict[str, str] = {}
        if not self.connected:
            try:
                out["rebuild_s"] = self.connect(check_plan=False)
                self.rebuilds += 1
            except WeightSyncError as e:
                return self._finish(out, t0, getattr(e, "errors", None) or {"sync group": str(e)}, str(e))
        # the learners gather the full weights while the engines still serve: a pause covers only
        # the transfer and the load
        t_stage = time.perf_counter()
        staged, errors = _collect(
            {n: s.stage_weights.remote(version) for n, s in zip(self._member_names(), self.senders)}, self.timeout_s
        )
        if errors:
            return self._finish(out, t0, errors, self._describe(f"gathering the weights for v{version}", errors))
        out["gather_s"] = float(staged.get("learner-0", {}).get("gather_s", 0.0))
        errors = self._send(version, out, hold, only)
        out["seconds"] = time.perf_counter() - t_stage
        error = self._describe(f"weight sync to v{version}", errors) if errors else None
        return self._finish(out, t0, errors, error)

    def _send(
        self, version: int, out: dict[str, Any], hold: bool = False, only: list[int] | None = None
    ) -> dict[str, str]:
        """Pause the engines (not in inflight mode), send and load ``version``, resume them (always,
        unless ``hold`` and all went well: see :meth:`sync`); fills ``out``'s transfer fields and
        returns the errors by member name. ``only``: see :meth:`sync`; with ``hold`` the engines stay
        paused, failed or not, unless this raised."""
        t_sync = time.perf_counter()
        loading = set(range(len(self.engines)) if only is None else only)
        inflight = self.mode == "inflight" and not hold and only is None  # [sync.mode] no pause
        interrupt = only is None and (self.mode == "interrupt" or (hold and self.mode == "inflight"))
        pause_errors: dict[str, str] = {}
        resume_errors: dict[str, str] = {}
        paused = {n: e for i, (n, e) in enumerate(zip(self.names, self.engines)) if i in loading}
        if not inflight:
            _, pause_errors = _collect({n: e.pause.remote(interrupt) for n, e in paused.items()}, 30.0)
        try:
            named = {n: s.sync_weights.remote(version) for n, s in zip(self._member_names(), self.senders)}
            named.update(
                {
                    n: e.receive_weights.remote(version, inflight, i in loading)
                    for i, (n, e) in enumerate(zip(self.names, self.engines))
                }
            )
            results, errors = _collect(named, self.timeout_s)
            out["held"] = hold and not errors and not pause_errors
            out["paused"] = hold  # the caller resumes them: some may hold weights it withdraws
        finally:
            if not inflight and not out["paused"]:
                resume_errors = self.release(only)
            out["pause_s"] = time.perf_counter() - t_sync  # [sync.mode]
        for n, err in list(pause_errors.items()) + list(resume_errors.items()):
            errors.setdefault(n, err)
        sent = results.get("learner-0", {})
        out.update(
            bytes=float(sent.get("bytes", 0.0)),
            gather_s=out["gather_s"] + float(sent.get("gather_s", 0.0)),
            send_s=float(sent.get("send_s", 0.0)),
        )
        for n in self.names:
            if n in results and results[n].get("loaded", True):
                out["receive_s"][n] = results[n]["receive_s"]
                out["load_s"][n] = results[n]["load_s"]
                out["interrupted"] += int(results[n].get("interrupted", 0))  # [sync.mode]
                out["inflight"] += int(results[n].get("inflight", 0))
        if inflight:  # nothing was paused: requests waited only while an engine loaded
            out["pause_s"] = max(out["load_s"].values(), default=0.0)
        return errors

    def release(self, only: list[int] | None = None) -> dict[str, str]:
        """Resume every engine, or the ``only`` ones (after a held sync, :meth:`sync` ``hold=True``);
        returns the errors by engine name (an engine that does not answer within 30 s is named, the
        others still resume)."""
        engines = [(n, e) for i, (n, e) in enumerate(zip(self.names, self.engines)) if only is None or i in only]
        _, errors = _collect({n: e.resume.remote() for n, e in engines}, 30.0)
        return errors

    def _finish(self, out: dict, t0: float, errors: dict[str, str], error: str | None) -> dict[str, Any]:
        out["ok"] = not errors
        out["failed"] = [n for n in self.names if n in errors] + [n for n in errors if n not in self.names]
        out["error"] = error
        if errors:
            self.connected = False  # a failed collective leaves the group unusable: rebuild before the next sync
            self.behind = True
            self.failures += 1
            self.last_error = error
        else:
            self.behind = False
        out["versions"] = self.engine_versions()
        if out["seconds"] == 0.0:
            out["seconds"] = time.perf_counter() - t0
        return out

    def resync(
        self, version: int, senders: list | None = None, hold: bool = False, only: list[int] | None = None
    ) -> dict[str, Any]:
        """Rebuild the group, then :meth:`sync` ``version`` to every engine (``hold`` as there): after
        Ray restarted an engine (it lost its transport and holds its initial weights) or after the
        learner group was rebuilt (``senders``: the new learner handles, rank 0 first); ``hold`` and
        ``only`` as there. Returns :meth:`sync`'s result."""
        if senders is not None:
            self.senders = list(senders)
        self.connected = False
        return self.sync(version, hold, only)

    def engine_versions(self, timeout_s: float = 10.0) -> dict[str, int | None]:
        """``{engine name: its policy version}``; None for an engine that did not answer in ``timeout_s``."""
        results, _ = _collect({n: e.get_version.remote() for n, e in zip(self.names, self.engines)}, timeout_s)
        return {n: results.get(n) for n in self.names}

    @staticmethod
    def metrics(result: dict[str, Any], failures: int = 0) -> dict[str, float]:
        """Step metrics of one :meth:`sync` result: ``timing/weight_sync_s``, ``sync/bytes``,
        ``sync/gbytes_per_s`` (payload bytes / 1e9 / the sender's send seconds), ``sync/gather_s``,
        ``sync/send_s``, ``sync/rebuild_s``, ``sync/ok`` (1/0), ``sync/failures`` (cumulative),
        ``sync/load_s_max``, ``sync/load_s/<engine>``, ``sync/receive_s/<engine>``,
        ``engine_version/<engine>`` (-1 when the engine did not answer), ``sync/pause_s`` and
        ``sync/interrupted_requests`` and ``sync/inflight_requests`` (see :meth:`sync`)."""
        m = {
            "timing/weight_sync_s": result["seconds"],
            "sync/bytes": result["bytes"],
            "sync/gbytes_per_s": result["bytes"] / 1e9 / result["send_s"] if result["send_s"] > 0 else 0.0,
            "sync/gather_s": result["gather_s"],
            "sync/send_s": result["send_s"],
            "sync/rebuild_s": result["rebuild_s"],
            "sync/ok": 1.0 if result["ok"] else 0.0,
            "sync/failures": float(failures),
            "sync/load_s_max": max(result["load_s"].values(), default=0.0),
            "sync/pause_s": result.get("pause_s", 0.0),  # [sync.mode]
            "sync/interrupted_requests": float(result.get("interrupted", 0)),
            "sync/inflight_requests": float(result.get("inflight", 0)),
        }
        m.update({f"sync/load_s/{n}": s for n, s in result["load_s"].items()})
        m.update({f"sync/receive_s/{n}": s for n, s in result["receive_s"].items()})
        m.update({f"engine_version/{n}": (-1 if v is None else v) for n, v in result.get("versions", {}).items()})
        return m

    @staticmethod
    def idle_metrics() -> dict[str, float]:
        """The step metrics of a step that synced nothing (a skipped step, every engine up to date): zeros."""
        keys = ("timing/weight_sync_s", "sync/bytes", "sync/gbytes_per_s", "sync/gather_s", "sync/send_s")
        extra = ("sync/load_s_max", "sync/pause_s", "sync/interrupted_requests", "sync/inflight_requests")
        return dict.fromkeys(keys + extra, 0.0)

    def close(self) -> None:
        """Drop the mailbox actor (the members' transports go with their actors)."""
        if self._mailbox is not None:
            ray.kill(self._mailbox)
            self._mailbox = None

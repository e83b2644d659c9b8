"""RolloutEngine: one inference engine (``hf`` or ``vllm``) as an async Ray actor.

Owns: the engine thread and its FIFO of jobs, admission and pausing, parking and continuing interrupted
generations, per-request failure isolation, and the engine's policy version. Must not: sample or score
tokens itself (the backend, :mod:`clawray.engines`), decide when weights sync
(:class:`~clawray.weight_sync.WeightSyncController`), or know sessions and samples.

The backend is owned by a single engine thread that takes jobs in FIFO order: generation requests,
teacher scoring and weight loads. Generation is continuously batched: the thread steps the backend
(:meth:`clawray.engines.base.Backend.step`) and, between steps, adds newly queued requests to the
running batch (up to ``max_batch_size``) and returns every request that finished, so a short reply
never waits for a long one and a new request never waits for a batch to end. Any other job waits
until the generations running when it was taken finish (no request is added meanwhile), then runs
alone. ``pause()`` stops admitting new generation jobs (they wait, they do not fail) until ``resume()``.

Weight syncs, three modes (``sync.mode``):

* ``drain`` (``pause(interrupt=False)``): a weight load is a job in the same FIFO, so the
  generations already running (and queued) finish on the old weights first; every response comes
  from one version.
* ``interrupt`` (``pause(interrupt=True)``, partial rollouts): the running and queued generations
  stop at their current token (the backend's cancel check, polled between tokens), are *parked*
  with what they sampled so far, the load runs at once, and ``resume()`` continues each parked
  request from where it stopped: the same request with prompt + tokens so far as its prompt and
  the remaining ``max_tokens`` (:func:`continue_request`). The caller sees one reply (a stream just
  pauses); the reply's ``logprobs`` stay those of the weights that sampled each token, and
  ``token_versions`` (length R) names that policy version per token. ``policy_version`` is the
  OLDEST token's version, so staleness (consuming version - policy_version) is never understated.
* ``inflight`` (no pause; PipelineRL's in-flight update): the sync is received while the engine
  generates, and the load runs between two backend steps with the running generations left in the
  backend; their KV cache is recomputed on the new weights, so each reply goes on with one request,
  and ``token_versions`` names the weights of each step. Nothing waits but the running generations,
  for the load itself.

Cancellation: when the caller of :meth:`RolloutEngine.generate` / :meth:`generate_stream` goes away
(Ray cancels the actor coroutine: ``ray.cancel`` on its ref, see :func:`await_cancellable`), the job
is marked cancelled: a queued job is dropped before it starts, a running one stops at its next token
(the backend aborts it), frees its batch slot, and is counted in ``stats()["cancelled"]``, never in
``requests`` (finished generations).

Failure isolation: an exception inside the backend fails only the request that caused it. When a
step fails, the backend is cleared and each running request is retried alone (from its tokens so far); a request that fails alone gets an
:class:`EngineError` (a short message without internals; the traceback goes to the log) and is
counted in ``stats()["errors"]``. A request that already streamed tokens of the failed run is not
retried (its client would see them twice): it fails. A request the backend refuses
(:meth:`~clawray.engines.base.Backend.add` raises ``ValueError``) fails alone with
:class:`EngineRefusedError`, an :class:`EngineError` that names the reason (a client error). A fault elsewhere in the engine thread's loop
(``can_add`` or ``abort`` raising) is handled like a failed step (every running request is retried
alone); a stream callback that raises fails its own request only. The engine thread keeps serving.

Shutdown (:meth:`RolloutEngine.shutdown`): the running generations and the jobs queued before it
finish; the parked generations, every job queued after it and every generate call still waiting for
a paused engine's resume fail with :class:`EngineError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import itertools
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import ray

from clawray.config import MAX_CPU_ID, RolloutConfig, section
from clawray.engines import backend_kwargs, engine_seed
from clawray.engines.base import GenerateOutput, GenerateRequest, WeightSpec

if TYPE_CHECKING:
    from clawray.weight_sync import TransportSpec


logger = logging.getLogger("clawray.rollout")


def pin_thread(cpus: list[int]) -> set[int]:
    """Run the calling thread (and the threads it starts from now on) on ``cpus`` only
    (``os.sched_setaffinity`` of this thread: Linux applies an affinity per thread).

    Returns:
        the CPUs it now runs on (``set(cpus)``).

    Raises:
        ValueError: some of ``cpus`` do not exist or are not allowed here (the kernel would silently
            keep the others), naming them and the ones this process may use.
    """
    import os

    wanted, got = set(cpus), set()
    if all(0 <= c <= MAX_CPU_ID for c in wanted):  # else the kernel's CPU mask alone takes up to GBs
        try:
            os.sched_setaffinity(0, wanted)
            got = os.sched_getaffinity(0)
        except OSError:  # EINVAL: none of them usable here
            pass
    if got != wanted:
        raise ValueError(
            f"rollout.cpu_affinity={sorted(wanted)}: CPUs {sorted(wanted - got)} cannot be used; "
            f"this host has {os.cpu_count()} CPUs, and this process was started on {sorted(os.sched_getaffinity(os.getpid()))}"
        )
    return got


class EnginePausedError(RuntimeError):
    """The engine stayed paused (loading new weights) longer than the caller was willing to wait."""


class EngineRestartedError(RuntimeError):
    """Ray restarted this engine (``max_restarts``) and it still serves its initial weights: it refuses
    generation until the driver re-syncs the current policy (:meth:`RolloutEngine.receive_weights`).
    The message names the engine only (no actor id, pid or namespace)."""


class EngineError(RuntimeError):
    """The backend raised while generating this request (the engine itself keeps serving), or the
    engine was shut down before the job could run. The message names the exception type only, never
    a traceback, path or actor id."""


class EngineArmError(RuntimeError):
    """This engine serves a canary (``deploy.canary_fraction``) and the request is not canary traffic,
    or it is reserved for the promotion gate's probe (:meth:`RolloutEngine.set_arm`): the request goes
    to another engine (:class:`~clawray.serve.engine_pool.EnginePool` asks this one's arm again). The
    message names the engine and its arm only."""


class EngineRefusedError(EngineError):
    """The backend refused this request before sampling it (:meth:`Backend.add` raised ``ValueError``,
    e.g. vLLM: the prompt leaves no room for a token within ``max_model_len``): the request's own
    fault, a client error. The message is ``"the engine refused this request: <reason>"``, the reason
    naming the request's sizes only (no traceback, path or actor id)."""


async def await_cancellable(ref: Any) -> Any:
    """Await a Ray actor-method ``ObjectRef``; if the awaiting task is cancelled (a client hung up,
    a timeout fired), cancel the remote call too, so the actor stops the work (``ray.cancel`` raises
    ``asyncio.CancelledError`` inside an async actor's coroutine).

    Raises:
        asyncio.CancelledError: the awaiting task was cancelled (after the remote cancel was sent).
    """
    try:
        return await ref
    except asyncio.CancelledError:
        ray.cancel(ref)
        raise


def continue_request(request: GenerateRequest, done_ids: list[int]) -> GenerateRequest:
    """The request that continues ``request`` after its first ``len(done_ids)`` response tokens (a
    partial rollout resumed after a weight sync): prompt ``prompt_ids + done_ids``, ``max_tokens``
    reduced by ``len(done_ids)``, the same temperature, top-p and stop ids. A seeded request gets a
    seed derived from its seed and ``len(done_ids)`` (deterministic, and not the stream that sampled
    the first tokens). ``request`` itself when ``done_ids`` is empty.

    Raises:
        ValueError: ``done_ids`` already has ``max_tokens`` tokens (nothing is left to sample).
    """
    if not done_ids:
        return request
    left = request.max_tokens - len(done_ids)
    if left < 1:
        raise ValueError(f"nothing left to continue: {len(done_ids)} of max_tokens={request.max_tokens} done")
    seed = None if request.seed is None else (request.seed * 1_000_003 + len(done_ids)) % (1 << 62)
    return dataclasses.replace(
        request, prompt_ids=list(request.prompt_ids) + list(done_ids), max_tokens=left, seed=seed
    )


class _Job:
    _arrivals = itertools.count()  # arrival order of jobs (parked generations resume in it)

    __slots__ = (
        "arrival",
        "kind",
        "payload",
        "future",
        "loop",
        "stream",
        "cancelled",
        "streamed",
        "stopping",
        "ids",
        "logprobs",
        "versions",
        "run_versions",
        "probe",
        "canary",
    )

    def __init__(
        self,
        kind: str,
        payload: Any,
        loop: asyncio.AbstractEventLoop,
        stream: Callable[[list[int]], None] | None = None,
    ):
        self.kind, self.payload, self.loop, self.stream = kind, payload, loop, stream
        self.arrival = next(_Job._arrivals)
        self.future: asyncio.Future = loop.create_future()
        self.cancelled = False  # set from the event loop when the caller went away; read by the engine thread
        self.streamed = False  # tokens of the current run already went to the stream (a retry would repeat them)
        self.stopping = False  # the backend was told to abort it (engine thread only)
        # a generation's response so far (several engine runs when a sync interrupted it)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # the policy version that sampled each token of ids
        self.run_versions: list[int] = []  # the version of each token of the current run, per step
        self.probe = False  # a promotion-gate probe: runs while the engine is paused (see generate)
        self.canary = False  # started on an engine serving a canary (its reply says "canary": True)

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        def _set() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)

        self.post(_set)

    def cancel(self) -> None:
        """Cancel the future (a no-op when the caller's await already cancelled it)."""
        self.post(self.future.cancel)

    def post(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the caller's event loop; nothing when that loop is closed (the caller is gone)."""
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # "Event loop is closed"
            pass


class RolloutEngine:
    """An inference engine with a policy version.

    Args:
        model_path: local HF folder.
        rollout: the ``rollout`` config section (:class:`~clawray.config.RolloutConfig`, or a mapping
            of the keys that differ from its defaults): ``backend``, ``torch_threads`` (intra-op
            threads of the engine thread; Ray sets 1 by default), ``cpu_affinity`` (the CPU ids the
            engine thread runs on: :func:`pin_thread`), ``max_batch_size`` (most requests in
            one engine step) and the backend's own options (:func:`clawray.engines.backend_kwargs`).
        backend: another backend than ``rollout.backend`` (a frozen judge or teacher engine's).
        name: engine name used in logs and errors (e.g. ``"rollout-0"``).
        seed: the run's ``seed``; the engine samples with :func:`clawray.engines.engine_seed` of it
            and ``name`` (:attr:`seed`).
        engine_kwargs: backend options beyond the section's, over them (tests and benches: vLLM's
            chunked prefill, an hf engine in bf16).
        resync_on_restart: a policy engine: when Ray restarts the actor, generation raises
            :class:`EngineRestartedError` until the first weight load (frozen judge/teacher engines: False).
        version: the policy version of ``model_path``'s weights (0: the initial policy; ``clawray
            serve`` of a checkpoint passes its version, so replies carry it).

    Raises:
        ValueError: ``rollout.max_batch_size`` below 1.
        ConfigError: a key the section does not have.
    """

    def __init__(
        self,
        model_path: str,
        rollout: Any = None,
        *,
        backend: str | None = None,
        name: str = "rollout-0",
        seed: int = 0,
        engine_kwargs: dict | None = None,
        resync_on_restart: bool = False,
        version: int = 0,
    ):
        rollout = section(RolloutConfig, rollout or {})
        backend = backend or rollout.backend
        max_batch_size = rollout.max_batch_size
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.name = name
        # [recovery hook] a restarted policy engine holds the initial weights: no generation before a sync
        from clawray.recovery import was_restarted

        restarted = was_restarted()
        self._awaiting_sync = resync_on_restart and restarted
        self.seed = engine_seed(seed, name, restarted)  # per engine: no two engines sample alike
        self.version = version
        self.arm: str | None = None  # None: serves every request; "canary" / "reserved": see set_arm
        self.canary_fraction = 0.0  # the share of sessions a canary arm serves (the routers read it)
        self.max_batch_size = max_batch_size
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        # jobs that run between two steps, the running generations staying in the backend (in-flight loads)
        self._between: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._transport = None
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._backend = None
        self._stats = {
            "requests": 0,
            "tokens": 0,
            "gen_seconds": 0.0,
            "steps": 0,
            "step_requests": 0,
            "loads": 0,
            "last_sync_error": None,
            "cancelled": 0,
            "errors": 0,
            "interrupted": 0,
        }
        self._in_flight = 0  # generate calls entered and not returned (waiting while paused included)
        self._interrupt = False  # set by pause(interrupt=True): running generations stop at their next token
        self._running_now = 0  # generations in the backend when a between-steps job runs (engine thread)
        self._inflight_sync = asyncio.Lock()  # in-flight syncs receive and load one at a time
        self._parked: list[_Job] = []  # generations a sync interrupted (engine thread only), resumed by resume()
        self._stopped = False  # the engine thread has stopped: queued jobs fail (see _fail_queued)
        self._closing = False  # shutdown() was called: generate calls fail instead of waiting for a resume
        self._thread = threading.Thread(
            target=self._run,
            args=(
                backend,
                model_path,
                rollout.torch_threads,
                list(rollout.cpu_affinity),
                {**backend_kwargs(rollout, backend, self.seed), **(engine_kwargs or {})},
            ),
            daemon=True,
            name=f"{name}-engine",
        )
        self._thread.start()

    # ---------------------------------------------------------------- engine thread
    def _run(self, backend: str, model_path: str, torch_threads: int, cpu_affinity: list[int], kwargs: dict) -> None:
        import torch

        from clawray.engines import make_backend

        try:
            if cpu_affinity:  # [rollout.cpu_affinity] this thread only: the threads it starts inherit it
                pinned = pin_thread(cpu_affinity)
                if torch_threads > len(pinned):
                    logger.warning(
                        "%s: rollout.torch_threads=%d on the %d CPU(s) of rollout.cpu_affinity=%s: the engine's "
                        "threads preempt each other at every step",
                        self.name,
                        torch_threads,
                        len(pinned),
                        sorted(pinned),
                    )
            torch.set_num_threads(max(1, torch_threads))
            self._backend = make_backend(backend, model_path, **kwargs)
        except BaseException as e:  # surfaced by ready()
            self._init_error = e
        finally:
            self._ready.set()
        if self._init_error is not None:
            return
        running: dict[int, _Job] = {}  # generations in the backend, by key
        keys = itertools.count()
        held: _Job | None = None  # a non-generation job: runs once the running generations finished
        stopping = False  # shutdown: finish the running generations, then stop
        while True:
            try:
                self._run_between(running)
                if held is None and not stopping:
                    held, stopping = self._take_jobs(running, keys)
                if running:
                    self._step(running)
                elif held is not None:
                    job, held = held, None
                    try:
                        job.resolve(job.payload())
                    except BaseException as e:
                        job.resolve(error=e)
                elif stopping:
                    self._stop()
                    return
            except Exception as e:  # outside a backend step (can_add, abort, ...): the thread must go on serving
                logger.error("%s: the engine loop failed", self.name, exc_info=e)
                self._step_failed(running, e, culprit_known=False)

    def _run_between(self, running: dict[int, _Job]) -> None:
        """Run the queued between-steps jobs (in-flight weight loads) now, the running generations
        staying in the backend; ``self._running_now`` tells a job how many there are."""
        while True:
            try:
                job = self._between.get_nowait()
            except queue.Empty:
                return
            self._running_now = len(running)
            try:
                job.resolve(job.payload())
            except BaseException as e:
                job.resolve(error=e)

    def _take_jobs(self, running: dict[int, _Job], keys: Iterator[int]) -> tuple[_Job | None, bool]:
        """Add the parked generations (after a sync) and the queued ones to the running batch, until
        it holds ``max_batch_size``, the queue is empty or a non-generation job comes (returned, and
        no later job is taken). Blocks on the queue only when nothing runs.

        Returns:
            ``(held, stopping)``: the non-generation job met, if any; whether shutdown was queued.
        """
        while len(running) < self.max_batch_size and (not running or self._backend.can_add()):
            if self._parked and not self._interrupt:  # resumed after a sync: continue the parked ones first
                self._start(self._parked.pop(0), running, keys)
                continue
            try:
                job = self._jobs.get(block=not running)
            except queue.Empty:
                break
            if job is None:
                return None, True
            if job.kind == "wake":  # resume() or an in-flight load: the loop runs it or takes the parked ones
                break
            if job.kind != "generate":
                return job, False
            if (
                self._interrupt and not job.cancelled and not job.probe
            ):  # queued before the sync's pause: runs on the new weights
                self._park(job)
            else:
                self._start(job, running, keys)
        return None, False

    def _start(self, job: _Job, running: dict[int, _Job], keys: Iterator[int]) -> None:
        if job.cancelled:  # its caller went away while it was queued or parked: never (re)starts
            self._cancelled(job, len(job.ids))
            return
        key = next(keys)
        try:
            self._backend.add(key, continue_request(job.payload, job.ids))
        except ValueError as e:  # refused (e.g. too long for the engine): fails alone, the request's fault
            self._stats["errors"] += 1
            logger.warning("%s: the backend refused a request: %s", self.name, e)
            job.resolve(error=EngineRefusedError(f"the engine refused this request: {e}"))
            return
        except Exception as e:  # the backend failed while adding it: fails alone
            self._failed(job, e)
            return
        job.stopping = job.streamed = False  # a new run: its stream has sent nothing yet
        job.run_versions = []
        running[key] = job

    def _park(self, job: _Job) -> None:
        """Keep an interrupted (or queued) generation for resume(), in arrival order: a request queued
        during the step that the interrupt stopped is parked first, yet resumes after the older one."""
        self._stats["interrupted"] += 1
        at = len(self._parked)
        while at and self._parked[at - 1].arrival > job.arrival:
            at -= 1
        self._parked.insert(at, job)

    def _stop(self) -> None:
        """Shutdown: fail the parked generations and everything still queued; later jobs fail at once."""
        self._stopped = True
        parked, self._parked = self._parked, []
        for job in parked:
            if job.cancelled:
                self._cancelled(job, len(job.ids))
            else:
                job.resolve(error=EngineError("the engine shut down while this request waited for a weight sync"))
        self._fail_queued()

    def _fail_queued(self) -> None:
        """Fail every queued job with :class:`EngineError` (the engine thread has stopped). Called by
        the engine thread as it stops and by :meth:`_enqueue` after a put that came too late, so no job
        is left in the queue whichever comes last."""
        while True:
            try:
                self._between.get_nowait().resolve(error=EngineError(f"{self.name} has shut down"))
            except queue.Empty:
                break
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None or job.kind == "wake":
                continue
            if job.kind == "generate" and job.cancelled:
                self._cancelled(job, 0)
            else:
                job.resolve(error=EngineError(f"{self.name} has shut down"))

    def _cancelled(self, job: _Job, tokens: int) -> None:
        self._stats["cancelled"] += 1
        logger.info("%s: generation cancelled by its caller after %d tokens", self.name, tokens)
        job.cancel()

    def _step(self, running: dict[int, _Job]) -> None:
        """One backend step: abort the generations whose caller went away (or all, for a sync's
        interrupt), stream the new tokens and finish the generations that ended."""
        gone = [k for k, job in running.items() if not job.stopping and self._stops(job)]
        for key in gone:
            running[key].stopping = True
        if gone:
            self._backend.abort(gone)
        t0 = time.perf_counter()
        try:
            out = self._backend.step()
        except BaseException as e:  # any failure: the engine thread must go on serving
            self._stats["gen_seconds"] += time.perf_counter() - t0
            self._step_failed(running, e)
            return
        self._stats["gen_seconds"] += time.perf_counter() - t0
        self._stats["steps"] += 1
        self._stats["step_requests"] += len(running)
        for key, ids in out.new_tokens.items():
            job = running.get(key)  # None: failed by its stream in this step
            if job is None:
                continue
            job.run_versions += [self.version] * len(ids)
            if job.stream is not None:
                self._stream(key, job, ids, running)
        for key, result in out.finished.items():
            job = running.pop(key, None)
            if job is not None:  # None: failed by its stream (the backend returns it once aborted)
                self._finish(job, result)

    def _stream(self, key: int, job: _Job, ids: list[int], running: dict[int, _Job]) -> None:
        """Send a step's new tokens to the job's stream; a stream that raises fails its job alone
        (dropped from the batch and aborted in the backend; its output is ignored)."""
        job.streamed = True
        try:
            job.stream(ids)
        except Exception as e:
            del running[key]
            self._failed(job, e)
            self._backend.abort([key])

    def _step_failed(self, running: dict[int, _Job], error: BaseException, culprit_known: bool = True) -> None:
        """Clear the backend and retry each running request alone (see the module doc). A single
        request fails without a retry when the failed step ran it alone (``culprit_known``); none is
        retried when the backend cannot even be cleared."""
        jobs = list(running.values())
        running.clear()
        retry = len(jobs) > 1 or not culprit_known
        try:
            self._backend.clear()
        except Exception as e:
            logger.error("%s: clearing the backend failed", self.name, exc_info=e)
            retry = False
        if retry:
            logger.warning(
                "%s: a step of %d requests failed (%s: %s); retrying them one by one",
                self.name,
                len(jobs),
                type(error).__name__,
                error,
            )
        for job in jobs:
            if job.cancelled:
                self._cancelled(job, len(job.ids))
            elif job.streamed or not retry:  # streamed: its client already has tokens of the failed run
                self._failed(job, error)
            else:
                self._retry_alone(job)

    def _stops(self, job: _Job) -> bool:
        """Whether a running generation stops at its next token: its caller went away, or a sync's
        interrupt (which a gate probe ignores: the gate probes while the users wait)."""
        return job.cancelled or (self._interrupt and not job.probe)

    def _retry_alone(self, job: _Job) -> None:
        """Run one request on its own (from its tokens so far), after a step that held it failed."""
        job.run_versions = []  # no load runs inside this call: every token is the current version's
        try:
            (result,) = self._backend.generate(
                [continue_request(job.payload, job.ids)],
                (lambda _, ids: job.stream(ids)) if job.stream is not None else None,
                lambda _: self._stops(job),
            )
        except BaseException as e:
            self._failed(job, e)
            return
        self._finish(job, result)

    def _failed(self, job: _Job, error: BaseException) -> None:
        self._stats["errors"] += 1
        logger.error("%s: generation failed", self.name, exc_info=error)
        job.resolve(error=EngineError(f"the engine failed on this request ({type(error).__name__})"))

    def _finish(self, job: _Job, out: GenerateOutput) -> None:
        """Extend the job's response by what this run sampled and resolve it; a job stopped by a
        sync's interrupt (not by its caller) is parked for resume(). Each token's version is the one
        loaded at the step that sampled it (an in-flight load can fall inside a run); a re-scored
        output's tokens all carry the current version, whose weights computed their log-probs."""
        n = len(out.response_ids)
        self._stats["tokens"] += n
        job.ids += out.response_ids
        job.logprobs += out.logprobs
        per_step = [] if out.rescored else job.run_versions[:n]
        job.versions += per_step + [self.version] * (n - len(per_step))
        if out.finish_reason != "abort":
            self._resolve(job, out.finish_reason)
        elif job.cancelled:
            self._cancelled(job, len(job.ids))
        elif len(job.ids) >= job.payload.max_tokens:  # stopped exactly at its last token
            self._resolve(job, "length")
        else:  # interrupted by a weight sync: continued after the load
            self._park(job)

    def _resolve(self, job: _Job, finish_reason: str) -> None:
        self._stats["requests"] += 1
        job.resolve(
            {
                "response_ids": job.ids,
                "logprobs": job.logprobs,
                "finish_reason": finish_reason,
                "policy_version": min(job.versions, default=self.version),
                "token_versions": job.versions,
                "engine": self.name,
                "canary": job.canary,
            }
        )

    async def _enqueue(self, job: _Job, between: bool = False) -> None:
        """Queue ``job`` in FIFO order, or (``between``) to run between the next two steps, the
        running generations staying in the backend (the FIFO gets a wake-up for an idle thread)."""
        if not self._ready.is_set():
            await asyncio.get_running_loop().run_in_executor(None, self._ready.wait)
        if self._init_error is not None:
            raise RuntimeError(f"{self.name}: backend failed to start: {self._init_error!r}")
        if between:
            self._between.put(job)
            job = _Job("wake", None, job.loop)
        self._jobs.put(job)
        if self._stopped:  # the engine thread stopped (maybe after it emptied the queue): fail it here
            self._fail_queued()

    async def _submit(self, kind: str, payload: Any) -> Any:
        job = _Job(kind, payload, asyncio.get_running_loop())
        await self._enqueue(job)
        return await job.future

    async def _admit(self, wait_s: float | None) -> None:
        """Wait while paused: forever (``wait_s`` None) or up to ``wait_s`` seconds.

        A call cancelled while it waits counts in ``stats()["cancelled"]``.

        Raises:
            asyncio.CancelledError: the caller went away while it waited.
            EnginePausedError: still paused after ``wait_s`` seconds.
            EngineRestartedError: restarted and not re-synced yet (at once, no wait).
            EngineError: :meth:`shutdown` was called (at once, or as soon as it is while waiting).
        """
        if self._awaiting_sync:
            raise EngineRestartedError(f"{self.name} was restarted and awaits the current policy's weights")
        if not self._resumed.is_set() and not self._closing:
            try:
                await asyncio.wait_for(self._resumed.wait(), wait_s)
            except asyncio.TimeoutError:
                raise EnginePausedError(f"{self.name} is loading new weights (paused > {wait_s} s)") from None
            except asyncio.CancelledError:  # its caller went away while it waited: a cancelled generation
                self._stats["cancelled"] += 1
                raise
        if self._closing:  # shut down (maybe while this call waited for a resume that never comes)
            raise EngineError(f"{self.name} has shut down")

    def _call(self, fn: Callable[[], Any]) -> Any:
        return self._submit("call", fn)

    def _check_arm(self, request: GenerateRequest) -> None:
        """Raise :class:`EngineArmError` when this engine's arm does not serve ``request`` (checked on
        arrival, and again once admitted: a request that waited through a sync meets the arm it left)."""
        if self.arm == "reserved" or (self.arm == "canary" and not request.canary):
            raise EngineArmError(f"{self.name} serves the {self.arm} arm only")

    # ---------------------------------------------------------------- public API
    async def ready(self) -> dict:
        """Wait until the backend is loaded; returns ``{"name", "version"}``.

        Raises:
            RuntimeError: the backend failed to load (the message has the cause).
        """
        await self._call(lambda: None)
        return {"name": self.name, "version": self.version}

    async def generate(self, request: GenerateRequest, wait_s: float | None = None, probe: bool = False) -> dict:
        """Sample one response; waits while the engine is paused (at most ``wait_s`` seconds if given).

        ``probe=True`` (the promotion gate's probe, :mod:`clawray.gate`) runs at once even while the
        engine is paused, on the weights it holds, and a pause's interrupt does not stop it: the gate
        holds the users' requests (paused) while it probes a candidate version.

        Returns:
            dict with ``response_ids`` (list[int], R), ``logprobs`` (list[float], R),
            ``finish_reason`` (``"stop"``/``"length"``), ``token_versions`` (list[int], R: the policy
            version that sampled each token; more than one only when a sync interrupted the
            generation), ``policy_version`` (int, the oldest of ``token_versions``; the engine's
            version when R = 0), ``engine`` (str) and ``canary`` (bool: the engine served a canary
            arm, :meth:`set_arm`).

        Raises:
            EnginePausedError: paused for longer than ``wait_s``.
            EngineArmError: the engine's arm does not serve this request (:meth:`set_arm`).
            EngineError: the backend failed on this request, or the engine shut down;
                :class:`EngineRefusedError` when the backend refused it (the request's fault).
            asyncio.CancelledError: the call was cancelled (``ray.cancel``); the generation is
                dropped from the queue or stopped at its next token.
        """
        self._in_flight += 1
        try:
            if not probe:
                self._check_arm(request)  # a reserved engine sends it elsewhere at once, not after its probe
                await self._admit(wait_s)
                self._check_arm(request)
            elif self._closing:
                raise EngineError(f"{self.name} has shut down")
            job = _Job("generate", request, asyncio.get_running_loop())
            job.probe, job.canary = probe, self.arm == "canary" and not probe
            await self._enqueue(job)
            try:
                return await job.future
            except asyncio.CancelledError:
                job.cancelled = True
                raise
        finally:
            self._in_flight -= 1

    async def generate_stream(self, request: GenerateRequest, wait_s: float | None = None):
        """Sample one response, streaming its tokens (a Ray streaming generator).

        Yields ``{"admitted": True}`` once the request is queued (after any pause), then
        ``{"token_ids": [...]}`` as tokens are sampled (several per item when the caller lags), and
        last the :meth:`generate` dict with ``"done": True``. The streamed ids join to its
        ``response_ids``.

        Raises:
            EnginePausedError: paused for longer than ``wait_s`` (before anything is yielded).
            EngineArmError: the engine's arm does not serve this request (before anything is yielded).
            EngineError: the backend failed on this request, or the engine shut down;
                :class:`EngineRefusedError` when the backend refused it (the request's fault).
            asyncio.CancelledError: the stream was cancelled (``ray.cancel``) or closed early; the
                generation is dropped from the queue or stopped at its next token.
        """
        self._in_flight += 1
        try:
            self._check_arm(request)
            await self._admit(wait_s)
            self._check_arm(request)
        except BaseException:
            self._in_flight -= 1
            raise
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[list[int]] = asyncio.Queue()
        job = _Job("generate", request, loop, stream=lambda ids: loop.call_soon_threadsafe(tokens.put_nowait, ids))
        job.canary = self.arm == "canary"
        try:
            await self._enqueue(job)
            yield {"admitted": True}
            while not (job.future.done() and tokens.empty()):
                getter = asyncio.ensure_future(tokens.get())
                try:
                    done, _ = await asyncio.wait({getter, job.future}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not getter.done():
                        getter.cancel()
                if getter not in done:
                    continue
                ids = getter.result()
                while not tokens.empty():
                    ids = ids + tokens.get_nowait()
                yield {"token_ids": ids}
            yield {**job.future.result(), "done": True}
        finally:  # cancelled, closed early or failed: stop the generation if it still runs
            if not job.future.done():
                job.cancelled = True
            self._in_flight -= 1

    async def logprobs(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Log-probs (length R) of ``response_ids`` given ``prompt_ids`` (teacher path)."""
        return await self._call(lambda: self._backend.logprobs(prompt_ids, response_ids, temperature))

    async def topk_logprobs(
        self, prompt_ids: list[int], response_ids: list[int], k: int, temperature: float = 1.0
    ) -> tuple[list[list[float]], list[list[int]]]:
        """Top-``k`` log-probs and ids (``[R][k]``) at each response position (top-k teacher path)."""
        return await self._call(lambda: self._backend.topk_logprobs(prompt_ids, response_ids, k, temperature))

    async def weight_specs(self) -> list[WeightSpec]:
        """The weights this engine loads, in sync order."""
        return await self._call(lambda: self._backend.weight_specs())  # read once loaded (the engine thread)

    async def is_paused(self) -> bool:
        """Whether generation is paused (a weight sync is in progress)."""
        return not self._resumed.is_set()

    async def pause(self, interrupt: bool = False) -> None:
        """Stop admitting generation requests; they wait until :meth:`resume`.

        Args:
            interrupt: also stop the running and queued generations at their next token (partial
                rollouts, ``sync.mode: interrupt``); :meth:`resume` continues them. False (``drain``):
                they run to the end, and a weight load queued now waits for them.
        """
        self._resumed.clear()
        self._interrupt = interrupt

    async def resume(self) -> None:
        """Admit generation requests again and continue the generations a pause interrupted."""
        self._interrupt = False
        self._resumed.set()
        self._jobs.put(_Job("wake", None, asyncio.get_running_loop()))

    async def set_arm(self, arm: str | None, canary_fraction: float = 0.0) -> None:
        """Which requests this engine serves (the promotion gate's canary, :mod:`clawray.canary`):
        None every one; ``"canary"`` only canary traffic (``GenerateRequest.canary``: a session in
        the ``canary_fraction`` the routers send here, :func:`clawray.serve.routing.in_canary`);
        ``"reserved"`` none (the gate's probe only). Checked as a request is admitted; a refused one
        gets :class:`EngineArmError`. Generations already admitted are not affected.

        Raises:
            ValueError: an unknown arm, or a canary fraction outside (0, 1).
        """
        if arm not in (None, "canary", "reserved"):
            raise ValueError(f"unknown arm {arm!r}; expected None, 'canary' or 'reserved'")
        if arm == "canary" and not 0.0 < canary_fraction < 1.0:
            raise ValueError(f"a canary arm needs a fraction in (0, 1), got {canary_fraction}")
        self.arm, self.canary_fraction = arm, canary_fraction if arm == "canary" else 0.0

    async def get_version(self) -> int:
        """The current policy version."""
        return self.version

    async def stats(self) -> dict:
        """Counters: ``requests`` (finished generations), ``tokens`` (generated, cancelled ones
        included), ``gen_seconds`` (in backend steps), ``steps`` (backend steps), ``step_requests``
        (running requests summed over steps: ``step_requests / steps`` is the mean batch), ``loads``
        (weight loads), ``cancelled`` (generations stopped or dropped because their caller went away,
        those that went away while waiting for a sync's resume included),
        ``errors`` (requests the backend failed on), ``interrupted`` (generations a sync parked:
        stopped mid-reply, or queued before its load; each continues after it), the version, the last
        sync's error (None after a successful load), ``awaiting_sync`` (restarted, not re-synced yet:
        it refuses generation), ``paused`` (a weight sync is in progress), ``in_flight`` (the queue
        depth: generate calls not finished, those waiting while paused included; a gauge, not a
        counter), ``arm`` and ``canary_fraction`` (:meth:`set_arm`)."""
        return {
            **self._stats,
            "version": self.version,
            "name": self.name,
            "awaiting_sync": self._awaiting_sync,
            "paused": not self._resumed.is_set(),
            "in_flight": self._in_flight,
            "arm": self.arm,
            "canary_fraction": self.canary_fraction,
        }

    async def init_weight_receiver(self, rank: int, spec: TransportSpec) -> None:
        """Join (or re-join, closing the previous one) the weight-sync transport ``spec`` describes as
        receiver ``rank``.

        A ``"collective"`` spec blocks until every member joins the group at ``spec.host:spec.port``;
        ``"object_store"`` and ``"ipc"`` post through ``spec.mailbox`` (ipc: same host as the sender).
        See :func:`clawray.weight_sync.make_transport`.

        Raises:
            RuntimeError: the rendezvous timed out after ``spec.timeout_s`` seconds.
        """
        from clawray.weight_sync import make_transport

        def _join() -> None:
            if self._transport is not None:
                self._transport.close()
                self._transport = None
            self._transport = make_transport(spec, rank, name=self.name)

        await self._call(_join)

    async def receive_weights(self, version: int, inflight: bool = False, load: bool = True) -> dict:
        """Receive one sync and load it; the engine's version becomes ``version``.

        ``load=False`` (a sync meant for other engines, :meth:`WeightSyncController.sync` ``only``):
        the sync is received off the engine thread while it generates, acknowledged and dropped; the
        weights and the version stay (``load_s`` 0, ``loaded`` False).

        By default the load is an engine-thread job, so generation jobs queued before it finish on the
        old weights (after ``pause(interrupt=True)`` they stop at their next token instead and wait,
        parked). ``inflight`` (``sync.mode: inflight``, PipelineRL's in-flight update): the sync is
        received off the engine thread while it generates, and the load runs between two steps, the
        running generations staying in the backend; their KV cache is recomputed on the new weights
        (:meth:`Backend.load_weights`), so each keeps one reply whose tokens after the load are the
        new version's (``token_versions``). The whole sync is received (and its header checked)
        before the backend loads anything; the transport's ``done`` follows the load (the ipc
        transport acks the sender there).

        Returns:
            ``{"engine", "receive_s", "load_s", "version", "interrupted", "inflight"}`` (seconds;
            ``interrupted``: generations parked by the pause, continued on the new weights at resume;
            ``inflight``: generations running across an in-flight load; ``load_s`` is then the time
            they stood still).

        Raises:
            WeightSyncError: ``"<name>: ..."``: no transport, the header's version or metadata does
                not match, the transport failed or timed out, or the backend raised while loading.
                The version is left unchanged; a load that failed part-way leaves a mix of weights
                until the next successful sync (``stats()["last_sync_error"]`` says so).
        """
        if not load:
            return await self._receive_only(version)
        if not inflight:
            return await self._call(lambda: self._load_sync(version, *self._receive_sync(version)))
        # a caller that goes away does not drop a received sync: the load still runs (as a queued FIFO load does)
        return await asyncio.shield(asyncio.ensure_future(self._receive_inflight(version)))

    async def _receive_only(self, version: int) -> dict:
        """:meth:`receive_weights` with ``load=False``: receive (off the engine thread), ack, drop."""
        from clawray.weight_sync import WeightSyncError

        async with self._inflight_sync:
            weights, receive_s = await self._receive_off_thread(version)
            del weights  # ipc: views of the sender's buffers, unmapped by done()
            try:
                self._transport.done(ok=True)
            except WeightSyncError as e:
                raise WeightSyncError(f"{self.name}: {e}") from None
        return {
            "engine": self.name,
            "receive_s": receive_s,
            "load_s": 0.0,
            "version": self.version,
            "interrupted": 0,
            "inflight": 0,
            "loaded": False,
        }

    async def _receive_inflight(self, version: int) -> dict:
        """:meth:`receive_weights` with ``inflight``: receive off the engine thread, load between two
        steps. One sync at a time (versions load in the order they were sent); a sync received and
        never loaded (the engine shut down) is released at the sender (``done(ok=False)``)."""
        loop = asyncio.get_running_loop()
        async with self._inflight_sync:
            weights, receive_s = await self._receive_off_thread(version)
            started = threading.Event()  # set by the engine thread as the load begins

            def _load_received() -> dict:
                started.set()
                return self._load_sync(version, weights, receive_s, inflight=True)

            job = _Job("load", _load_received, loop)
            try:
                await self._enqueue(job, between=True)
                return await job.future
            finally:
                if not started.is_set():
                    try:
                        self._transport.done(ok=False)  # ipc: the sender's buffers are released now
                    except Exception:  # the transport may be gone with the engine
                        pass

    async def _receive_off_thread(self, version: int) -> tuple[list, float]:
        """:meth:`_receive_sync` in an executor thread, once the backend is loaded: the engine thread
        goes on generating meanwhile."""
        loop = asyncio.get_running_loop()
        if not self._ready.is_set():
            await loop.run_in_executor(None, self._ready.wait)
        return await loop.run_in_executor(None, self._receive_sync, version)

    def _receive_sync(self, version: int) -> tuple[list, float]:
        """Receive one whole sync (its header checked): ``(weights, seconds)``. Raises WeightSyncError."""
        from clawray.weight_sync import WeightSyncError

        if self._transport is None:
            raise WeightSyncError(f"{self.name}: no weight-sync transport (init_weight_receiver first)")
        t0 = time.perf_counter()
        try:
            weights = list(self._transport.receive(version))
        except WeightSyncError as e:
            self._stats["last_sync_error"] = str(e)
            raise WeightSyncError(f"{self.name}: {e}") from None
        return weights, time.perf_counter() - t0

    def _load_sync(self, version: int, weights: list, receive_s: float, inflight: bool = False) -> dict:
        """Load received weights into the backend (engine thread), ack the transport and take the
        version; returns :meth:`receive_weights`' dict. Raises WeightSyncError."""
        from clawray.weight_sync import WeightSyncError

        t1 = time.perf_counter()
        try:
            self._backend.load_weights(weights)
        except Exception as e:
            self._stats["last_sync_error"] = f"load of v{version} failed: {e!r}"
            weights = None
            try:
                self._transport.done(ok=False)  # ipc: release the sender's buffers now
            except WeightSyncError:
                pass
            raise WeightSyncError(f"{self.name}: loading v{version} failed: {e!r}") from e
        weights = None  # ipc: views of the sender's buffers, unmapped by done()
        try:
            self._transport.done(ok=True)
        except WeightSyncError as e:
            self._stats["last_sync_error"] = str(e)
            raise WeightSyncError(f"{self.name}: {e}") from None
        self.version = version
        self._awaiting_sync = False
        self._stats["loads"] += 1
        self._stats["last_sync_error"] = None
        return {
            "engine": self.name,
            "receive_s": receive_s,
            "load_s": time.perf_counter() - t1,
            "version": version,
            "interrupted": len(self._parked),
            "inflight": self._running_now if inflight else 0,
        }

    async def shutdown(self) -> None:
        """Stop the engine thread: the running generations and the jobs queued before this call
        finish; parked generations and jobs queued after it fail with :class:`EngineError`, and so do
        the generate calls waiting for a paused engine's resume (at once: none will come)."""
        self._closing = True
        self._jobs.put(None)
        self._resumed.set()  # wakes the calls waiting in _admit, which then fail


# The Ray actor class. The plain class above stays importable, so Ray pickles it by reference.
RolloutEngineActor = ray.remote(RolloutEngine)

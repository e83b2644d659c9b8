"""RolloutEngine: one inference engine (``hf`` or ``vllm``) as an async Ray actor.

The backend is owned by a single engine thread that executes jobs in FIFO order: batches of
generation requests, teacher scoring and weight loads. Because a weight load is a job in the same
FIFO, every response is produced entirely by one set of weights and is stamped with that version.
``pause()`` stops admitting new generation jobs (they wait, they do not fail) until ``resume()``.

Cancellation: when the caller of :meth:`RolloutEngine.generate` / :meth:`generate_stream` goes away
(Ray cancels the actor coroutine: ``ray.cancel`` on its ref, see :func:`await_cancellable`), the job
is marked cancelled: a queued job is dropped before it starts, a running one stops at its next token
(the backend aborts it), frees its batch slot, and is counted in ``stats()["cancelled"]``, never in
``requests`` (finished generations).

Failure isolation: an exception inside the backend fails only the request that caused it. When a
batch fails, each of its requests is retried alone; a request that fails alone gets an
:class:`EngineError` (a short message without internals; the traceback goes to the log) and is
counted in ``stats()["errors"]``. The engine thread keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable

import ray

from clawray.engines.base import GenerateRequest, WeightSpec

if TYPE_CHECKING:
    from clawray.weight_sync import TransportSpec


logger = logging.getLogger("clawray.rollout")


class EnginePausedError(RuntimeError):
    """The engine stayed paused (loading new weights) longer than the caller was willing to wait."""


class EngineError(RuntimeError):
    """The backend raised while generating this request (the engine itself keeps serving). The
    message names the exception type only, never a traceback, path or actor id."""


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


class _Job:
    __slots__ = ("kind", "payload", "future", "loop", "stream", "cancelled", "streamed")

    def __init__(self, kind: str, payload: Any, loop: asyncio.AbstractEventLoop,
                 stream: Callable[[list[int]], None] | None = None):
        self.kind, self.payload, self.loop, self.stream = kind, payload, loop, stream
        self.future: asyncio.Future = loop.create_future()
        self.cancelled = False  # set from the event loop when the caller went away; read by the engine thread
        self.streamed = False  # some tokens already went to the stream (a retry would repeat them)

    def resolve(self, value: Any = None, error: BaseException | None = None) -> None:
        def _set() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)

        self.loop.call_soon_threadsafe(_set)


class RolloutEngine:
    """An inference engine with a policy version.

    Args:
        backend: ``"hf"`` or ``"vllm"``.
        model_path: local HF folder.
        name: engine name used in logs and errors (e.g. ``"rollout-0"``).
        torch_threads: intra-op threads for the engine thread (Ray sets 1 by default).
        max_batch_size: most generation requests run together in one engine step.
        backend_kwargs: passed to the backend constructor (dtype, max_model_len, ...).
    """

    def __init__(self, backend: str, model_path: str, name: str = "rollout-0", torch_threads: int = 2,
                 max_batch_size: int = 16, backend_kwargs: dict | None = None):
        self.name = name
        self.version = 0
        self.max_batch_size = max_batch_size
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._transport = None
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._backend = None
        self._stats = {"requests": 0, "tokens": 0, "gen_seconds": 0.0, "loads": 0, "last_sync_error": None,
                       "cancelled": 0, "errors": 0}
        self._thread = threading.Thread(
            target=self._run, args=(backend, model_path, torch_threads, backend_kwargs or {}), daemon=True,
            name=f"{name}-engine")
        self._thread.start()

    # ---------------------------------------------------------------- engine thread
    def _run(self, backend: str, model_path: str, torch_threads: int, kwargs: dict) -> None:
        import torch

        from clawray.engines import make_backend

        torch.set_num_threads(max(1, torch_threads))
        try:
            self._backend = make_backend(backend, model_path, **kwargs)
        except BaseException as e:  # surfaced by ready()
            self._init_error = e
        finally:
            self._ready.set()
        if self._init_error is not None:
            return
        held: _Job | None = None  # a non-generate job met while batching, run next
        while True:
            job, held = (held, None) if held is not None else (self._jobs.get(), None)
            if job is None:
                return
            if job.kind == "generate":
                batch = [job]
                while len(batch) < self.max_batch_size:
                    try:
                        nxt = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:  # shutdown: finish this batch first
                        self._jobs.put(None)
                        break
                    if nxt.kind != "generate":
                        held = nxt
                        break
                    batch.append(nxt)
                self._run_generate(self._drop_cancelled(batch))
            else:
                try:
                    job.resolve(job.payload())
                except BaseException as e:
                    job.resolve(error=e)

    def _drop_cancelled(self, batch: list[_Job]) -> list[_Job]:
        """Queued jobs whose caller went away never start."""
        for job in batch:
            if job.cancelled:
                self._cancelled(job, 0)
        return [j for j in batch if not j.cancelled]

    def _cancelled(self, job: _Job, tokens: int) -> None:
        self._stats["cancelled"] += 1
        logger.info("%s: generation cancelled by its caller after %d tokens", self.name, tokens)
        job.loop.call_soon_threadsafe(job.future.cancel)  # no-op when the caller's await already cancelled it

    def _run_generate(self, batch: list[_Job]) -> None:
        """Run one batch; if the backend raises, retry each request alone (see the module doc)."""
        if not batch:
            return
        try:
            self._generate(batch)
        except BaseException as e:  # any failure: the engine thread must go on serving
            if len(batch) == 1:
                self._failed(batch[0], e)
                return
            logger.warning("%s: a batch of %d failed (%s: %s); retrying its requests one by one", self.name,
                           len(batch), type(e).__name__, e)
            for job in batch:
                if job.cancelled:
                    self._cancelled(job, 0)
                    continue
                if job.streamed:  # its client already has tokens of the failed attempt
                    self._failed(job, e)
                    continue
                try:
                    self._generate([job])
                except BaseException as e1:
                    self._failed(job, e1)

    def _failed(self, job: _Job, error: BaseException) -> None:
        self._stats["errors"] += 1
        logger.error("%s: generation failed", self.name, exc_info=error)
        job.resolve(error=EngineError(f"the engine failed on this request ({type(error).__name__})"))

    def _generate(self, batch: list[_Job]) -> None:
        t0 = time.perf_counter()
        version = self.version

        def on_tokens(i: int, ids: list[int]) -> None:
            if batch[i].stream is not None:
                batch[i].streamed = True
                batch[i].stream(ids)

        outputs = self._backend.generate([j.payload for j in batch],
                                         on_tokens if any(j.stream for j in batch) else None,
                                         lambda i: batch[i].cancelled)
        self._stats["gen_seconds"] += time.perf_counter() - t0
        for job, out in zip(batch, outputs):
            self._stats["tokens"] += len(out.response_ids)
            if out.finish_reason == "abort":
                self._cancelled(job, len(out.response_ids))
                continue
            self._stats["requests"] += 1
            job.resolve({**asdict(out), "policy_version": version, "engine": self.name})

    async def _enqueue(self, job: _Job) -> None:
        if not self._ready.is_set():
            await asyncio.get_running_loop().run_in_executor(None, self._ready.wait)
        if self._init_error is not None:
            raise RuntimeError(f"{self.name}: backend failed to start: {self._init_error!r}")
        self._jobs.put(job)

    async def _submit(self, kind: str, payload: Any) -> Any:
        job = _Job(kind, payload, asyncio.get_running_loop())
        await self._enqueue(job)
        return await job.future

    async def _admit(self, wait_s: float | None) -> None:
        """Wait while paused: forever (``wait_s`` None) or up to ``wait_s`` seconds.

        Raises:
            EnginePausedError: still paused after ``wait_s`` seconds.
        """
        if self._resumed.is_set():
            return
        try:
            await asyncio.wait_for(self._resumed.wait(), wait_s)
        except asyncio.TimeoutError:
            raise EnginePausedError(f"{self.name} is loading new weights (paused > {wait_s} s)") from None

    def _call(self, fn: Callable[[], Any]) -> Any:
        return self._submit("call", fn)

    # ---------------------------------------------------------------- public API
    async def ready(self) -> dict:
        """Wait until the backend is loaded; returns ``{"name", "version"}``.

        Raises:
            RuntimeError: the backend failed to load (the message has the cause).
        """
        await self._call(lambda: None)
        return {"name": self.name, "version": self.version}

    async def generate(self, request: GenerateRequest, wait_s: float | None = None) -> dict:
        """Sample one response; waits while the engine is paused (at most ``wait_s`` seconds if given).

        Returns:
            dict with ``response_ids`` (list[int], R), ``logprobs`` (list[float], R),
            ``finish_reason`` (``"stop"``/``"length"``), ``policy_version`` (int) and ``engine`` (str).

        Raises:
            EnginePausedError: paused for longer than ``wait_s``.
            EngineError: the backend failed on this request.
            asyncio.CancelledError: the call was cancelled (``ray.cancel``); the generation is
                dropped from the queue or stopped at its next token.
        """
        await self._admit(wait_s)
        job = _Job("generate", request, asyncio.get_running_loop())
        await self._enqueue(job)
        try:
            return await job.future
        except asyncio.CancelledError:
            job.cancelled = True
            raise

    async def generate_stream(self, request: GenerateRequest, wait_s: float | None = None):
        """Sample one response, streaming its tokens (a Ray streaming generator).

        Yields ``{"admitted": True}`` once the request is queued (after any pause), then
        ``{"token_ids": [...]}`` as tokens are sampled (several per item when the caller lags), and
        last the :meth:`generate` dict with ``"done": True``. The streamed ids join to its
        ``response_ids``.

        Raises:
            EnginePausedError: paused for longer than ``wait_s`` (before anything is yielded).
            EngineError: the backend failed on this request.
            asyncio.CancelledError: the stream was cancelled (``ray.cancel``) or closed early; the
                generation is dropped from the queue or stopped at its next token.
        """
        await self._admit(wait_s)
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[list[int]] = asyncio.Queue()
        job = _Job("generate", request, loop, stream=lambda ids: loop.call_soon_threadsafe(tokens.put_nowait, ids))
        await self._enqueue(job)
        try:
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

    async def score(self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Log-probs (length R) of ``response_ids`` given ``prompt_ids`` (teacher path)."""
        return await self._call(lambda: self._backend.score(prompt_ids, response_ids, temperature))

    async def score_topk(self, prompt_ids: list[int], response_ids: list[int], k: int,
                         temperature: float = 1.0) -> tuple[list[list[float]], list[list[int]]]:
        """Top-``k`` log-probs and ids (``[R][k]``) at each response position (top-k teacher path)."""
        return await self._call(lambda: self._backend.score_topk(prompt_ids, response_ids, k, temperature))

    async def weight_specs(self) -> list[WeightSpec]:
        """The weights this engine loads, in sync order."""
        return await self._call(self._backend.weight_specs)

    async def is_paused(self) -> bool:
        """Whether generation is paused (a weight sync is in progress)."""
        return not self._resumed.is_set()

    async def pause(self) -> None:
        """Stop admitting generation requests; they wait until :meth:`resume`."""
        self._resumed.clear()

    async def resume(self) -> None:
        """Admit generation requests again."""
        self._resumed.set()

    async def get_version(self) -> int:
        """The current policy version."""
        return self.version

    async def stats(self) -> dict:
        """Counters: ``requests`` (finished generations), ``tokens`` (generated, cancelled ones
        included), ``gen_seconds``, ``loads`` (weight loads), ``cancelled`` (generations stopped or
        dropped because their caller went away), ``errors`` (requests the backend failed on), the
        version, and the last sync's error (None after a successful load)."""
        return {**self._stats, "version": self.version, "name": self.name}

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

    async def receive_weights(self, version: int) -> dict:
        """Receive one sync and load it; the engine's version becomes ``version``.

        Runs as an engine-thread job, so generation jobs queued before it finish on the old weights.
        The whole sync is received (and its header checked) before the backend loads anything; the
        transport's ``done`` follows the load (the ipc transport acks the sender there).

        Returns:
            ``{"engine", "receive_s", "load_s", "version"}`` (seconds).

        Raises:
            WeightSyncError: ``"<name>: ..."``: no transport, the header's version or metadata does
                not match, the transport failed or timed out, or the backend raised while loading.
                The version is left unchanged; a load that failed part-way leaves a mix of weights
                until the next successful sync (``stats()["last_sync_error"]`` says so).
        """
        from clawray.weight_sync import WeightSyncError

        def _load() -> dict:
            if self._transport is None:
                raise WeightSyncError(f"{self.name}: no weight-sync transport (init_weight_receiver first)")
            t0 = time.perf_counter()
            try:
                weights = list(self._transport.receive(version))
            except WeightSyncError as e:
                self._stats["last_sync_error"] = str(e)
                raise WeightSyncError(f"{self.name}: {e}") from None
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
            self._stats["loads"] += 1
            self._stats["last_sync_error"] = None
            return {"engine": self.name, "receive_s": t1 - t0, "load_s": time.perf_counter() - t1,
                    "version": version}

        return await self._call(_load)

    async def shutdown(self) -> None:
        """Stop the engine thread."""
        self._jobs.put(None)


# The Ray actor class. The plain class above stays importable, so Ray pickles it by reference.
RolloutEngineActor = ray.remote(RolloutEngine)

"""The engine thread batches continuously: requests join the running batch between backend steps and
each returns as soon as it finishes; any other job (a weight load, a scoring call) waits for the
running generations and no request joins meanwhile. A lock-step fake backend (one token for every
running request per step) makes the schedule exact."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from clawray.actors.rollout import EngineError, EngineRefusedError, RolloutEngine, _Job
from clawray.engines.base import GenerateOutput, GenerateRequest, SteppedBackend, StepOutput


class LockstepBackend(SteppedBackend):
    """Every step gives each running request one token (the step's number) after ``step_s`` seconds;
    a request ends at ``max_tokens``. ``log`` records the events: ``("add", first prompt id)`` and
    ``("step", sorted first prompt ids running)``."""

    def __init__(self, step_s: float = 0.002):
        self.step_s, self.n, self.log = step_s, 0, []
        self.runs: dict[int, tuple[GenerateRequest, list[int]]] = {}
        self.aborted: set[int] = set()
        self.faults: list[str] = []  # "step", "step on abort", "can_add": the next such call raises (once)
        self.gate = threading.Event()  # a step waits for it (set: steps run freely)
        self.gate.set()
        self.stepping = threading.Event()  # set when a step waits at the gate

    def _fault(self, where: str) -> None:
        if where in self.faults:
            self.faults.remove(where)
            raise RuntimeError(f"injected fault in {where}")

    def add(self, key, request):
        if request.prompt_ids[0] == 99:
            raise ValueError("prompt too long")
        self.log.append(("add", request.prompt_ids[0]))
        self.runs[key] = (request, [])

    def can_add(self):
        self._fault("can_add")
        return True

    def abort(self, keys):
        self.aborted.update(k for k in keys if k in self.runs)

    def clear(self):
        self.runs.clear()
        self.aborted.clear()

    def step(self):
        if not self.gate.is_set():
            self.stepping.set()
            self.gate.wait()
        self._fault("step")
        if self.aborted:
            self._fault("step on abort")
        out = StepOutput()
        for key in self.aborted:
            ids = self.runs.pop(key)[1]
            out.finished[key] = GenerateOutput(ids, [-1.0] * len(ids), "abort")
        self.aborted.clear()
        if not self.runs:
            return out
        time.sleep(self.step_s)
        self.n += 1
        self.log.append(("step", sorted(r.prompt_ids[0] for r, _ in self.runs.values())))
        for key, (request, ids) in list(self.runs.items()):
            ids.append(self.n)
            out.new_tokens[key] = [self.n]
            if len(ids) >= request.max_tokens:
                del self.runs[key]
                out.finished[key] = GenerateOutput(ids, [-1.0] * len(ids), "length")
        return out


@pytest.fixture
def engine(monkeypatch):
    import clawray.engines

    backend = LockstepBackend()
    monkeypatch.setattr(clawray.engines, "make_backend", lambda *a, **k: backend)
    eng = RolloutEngine("unused", {"max_batch_size": 4}, backend="fake")
    yield eng, backend
    eng._jobs.put(None)


def test_a_request_joins_the_running_batch_and_a_short_one_returns_first(engine):
    eng, backend = engine

    async def scenario():
        await eng.ready()
        long = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=200)))
        while backend.n < 10:
            await asyncio.sleep(0.002)
        short = await eng.generate(GenerateRequest([2], max_tokens=3))
        long_done_with_short = long.done()
        return await long, short, long_done_with_short, await eng.stats()

    long, short, long_done_with_short, stats = asyncio.run(scenario())
    assert not long_done_with_short  # the short reply did not wait for the long one
    joined = short["response_ids"][0]  # the step it joined at
    assert 10 < joined < 200 and short["response_ids"] == [joined, joined + 1, joined + 2]
    assert long["response_ids"] == list(range(1, 201))
    # the short request ran inside the long one's steps: 200 steps, 203 request-steps
    assert stats["steps"] == 200 and stats["step_requests"] == 203 and stats["requests"] == 2


def test_the_batch_admits_at_most_max_batch_size_and_the_rest_join_as_slots_free(engine):
    eng, backend = engine

    async def scenario():
        await eng.ready()
        await eng.pause()  # queue all six, so the engine takes them together
        calls = [asyncio.ensure_future(eng.generate(GenerateRequest([p], max_tokens=p))) for p in range(1, 7)]
        await asyncio.sleep(0.05)
        await eng.resume()
        return await asyncio.gather(*calls)

    outs = asyncio.run(scenario())
    steps = [running for event, running in backend.log if event == "step"]
    # four at once; request 1 ends at step 1 and request 5 joins, request 2 ends at step 2 and 6 joins
    assert steps[:3] == [[1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 6]]
    assert [len(o["response_ids"]) for o in outs] == [1, 2, 3, 4, 5, 6]
    assert outs[4]["response_ids"] == [2, 3, 4, 5, 6]  # request 5 sampled from step 2 on


def test_another_job_waits_for_the_running_generations_and_nothing_joins_meanwhile(engine):
    eng, backend = engine

    async def scenario():
        await eng.ready()
        first = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=30)))
        while backend.n < 3:
            await asyncio.sleep(0.002)
        call = asyncio.ensure_future(eng._call(lambda: backend.log.append(("call", len(backend.runs)))))
        await asyncio.sleep(0.005)  # the call is queued before the next request
        later = asyncio.ensure_future(eng.generate(GenerateRequest([2], max_tokens=2)))
        return await asyncio.gather(first, call, later)

    first, _, later = asyncio.run(scenario())
    events = [e for e in backend.log if e[0] != "step"]
    # the call ran when the first request had ended (nothing running), and the later one joined after it
    assert events == [("add", 1), ("call", 0), ("add", 2)]
    assert first["response_ids"] == list(range(1, 31)) and later["response_ids"] == [31, 32]


def test_a_cancelled_request_leaves_the_batch_and_the_others_go_on(engine):
    eng, backend = engine

    async def scenario():
        await eng.ready()
        a = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=40)))
        b = asyncio.ensure_future(eng.generate(GenerateRequest([2], max_tokens=40)))
        while backend.n < 5:
            await asyncio.sleep(0.002)
        b.cancel()
        return await a, await asyncio.gather(b, return_exceptions=True), await eng.stats()

    a, (b,), stats = asyncio.run(scenario())
    assert isinstance(b, asyncio.CancelledError) and a["response_ids"] == list(range(1, 41))
    running = [r for e, r in backend.log if e == "step"]
    assert running[0] == [1, 2] and running[-1] == [1]
    assert stats["cancelled"] == 1 and stats["requests"] == 1 and 5 <= stats["tokens"] - 40 < 40


# ------------------------------------------------------------------------------ faults, pauses, shutdown
async def _until(pred, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.001)


def _adds(backend: LockstepBackend, since: int = 0) -> list[int]:
    return [p for e, p in backend.log[since:] if e == "add"]


async def _park_two_and_cancel_one(eng, backend: LockstepBackend, max_tokens: int):
    """Start generations a ([1]) and b ([2]), park both with a sync's interrupt, cancel b; returns
    the two futures (b done, cancelled)."""
    await eng.ready()
    a = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=max_tokens)))
    b = asyncio.ensure_future(eng.generate(GenerateRequest([2], max_tokens=max_tokens)))
    await _until(lambda: backend.n >= 2)
    await eng.pause(interrupt=True)
    await _until(lambda: len(eng._parked) == 2)
    b.cancel()
    await asyncio.gather(b, return_exceptions=True)
    return a, b


async def _read(stream, seen: list[int]) -> dict:
    async for item in stream:
        seen += item.get("token_ids", [])
        if item.get("done"):
            return item
    raise AssertionError("the stream ended without its final item")


def test_shutdown_finishes_the_running_request_and_fails_the_ones_queued_after_it(engine):
    eng, backend = engine

    async def scenario():
        await eng.ready()
        running = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=20)))
        await _until(lambda: backend.n >= 2)
        eng._jobs.put(None)  # shutdown()
        after = asyncio.ensure_future(eng.generate(GenerateRequest([2], max_tokens=3)))
        first = await asyncio.wait_for(asyncio.gather(running, after, return_exceptions=True), 2)
        eng._thread.join(2)
        late = await asyncio.wait_for(asyncio.gather(eng.generate(GenerateRequest([3])), return_exceptions=True), 2)
        return first, late

    (running, after), (late,) = asyncio.run(scenario())
    assert running["response_ids"] == list(range(1, 21))
    assert isinstance(after, EngineError) and isinstance(late, EngineError) and not eng._thread.is_alive()
    assert str(late) == "rollout-0 has shut down" and _adds(backend) == [1]


def test_shutdown_while_parked_fails_the_parked_and_counts_the_cancelled_one(engine):
    eng, backend = engine

    async def scenario():
        a, b = await _park_two_and_cancel_one(eng, backend, max_tokens=50)
        eng._jobs.put(None)
        out = await asyncio.wait_for(asyncio.gather(a, b, return_exceptions=True), 2)
        eng._thread.join(2)
        return out, await eng.stats()

    (a, b), stats = asyncio.run(scenario())
    assert isinstance(a, EngineError) and isinstance(b, asyncio.CancelledError) and not eng._thread.is_alive()
    assert (stats["interrupted"], stats["cancelled"], stats["errors"], stats["requests"]) == (2, 1, 0, 0)


def test_a_request_cancelled_while_parked_never_restarts(engine):
    eng, backend = engine

    async def scenario():
        a, b = await _park_two_and_cancel_one(eng, backend, max_tokens=12)
        mark = len(backend.log)
        await eng.resume()
        return await a, mark, await eng.stats()

    a, mark, stats = asyncio.run(scenario())
    assert len(a["response_ids"]) == 12 and _adds(backend, mark) == [1]
    assert (stats["interrupted"], stats["cancelled"], stats["errors"], stats["requests"]) == (2, 1, 0, 1)


def test_a_failed_step_fails_the_streamed_request_and_retries_the_others_alone(engine):
    eng, backend = engine
    streamed: list[int] = []

    async def scenario():
        await eng.ready()
        stream = eng.generate_stream(GenerateRequest([1], max_tokens=30))
        assert await stream.__anext__() == {"admitted": True}
        a = asyncio.ensure_future(_read(stream, streamed))
        b, c, d = (asyncio.ensure_future(eng.generate(GenerateRequest([p], max_tokens=30))) for p in (2, 3, 4))
        await _until(lambda: backend.n >= 3 and backend.log[-1] == ("step", [1, 2, 3, 4]) and streamed)
        backend.faults.append("step on abort")  # the step that aborts c raises
        c.cancel()
        return await asyncio.gather(a, b, c, d, return_exceptions=True), await eng.stats()

    (a, b, c, d), stats = asyncio.run(scenario())
    assert isinstance(a, EngineError) and isinstance(c, asyncio.CancelledError)
    for out in (b, d):  # each sampled again from its first token, alone: 30 consecutive steps
        ids = out["response_ids"]
        assert ids == list(range(ids[0], ids[0] + 30)) and out["finish_reason"] == "length"
    assert (stats["requests"], stats["errors"], stats["cancelled"], stats["tokens"]) == (2, 1, 1, 60)


def test_a_failed_step_of_one_cancelled_request_counts_it_as_cancelled(engine):
    eng, backend = engine

    async def scenario():
        await eng.ready()
        a = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=50)))
        await _until(lambda: backend.n >= 2)
        backend.faults.append("step on abort")
        a.cancel()
        out = await asyncio.gather(a, return_exceptions=True)
        await _until(lambda: not backend.faults)
        return out, await eng.generate(GenerateRequest([2], max_tokens=2)), await eng.stats()

    (a,), later, stats = asyncio.run(scenario())
    assert isinstance(a, asyncio.CancelledError) and len(later["response_ids"]) == 2
    assert (stats["requests"], stats["errors"], stats["cancelled"]) == (1, 0, 1)


def test_a_rejected_request_fails_alone_while_others_run(engine):
    eng, backend = engine

    async def scenario():
        await eng.ready()
        a = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=20)))
        await _until(lambda: backend.n >= 2)
        bad = asyncio.ensure_future(eng.generate(GenerateRequest([99], max_tokens=5)))
        c = asyncio.ensure_future(eng.generate(GenerateRequest([3], max_tokens=5)))
        return await asyncio.gather(a, bad, c, return_exceptions=True), await eng.stats()

    (a, bad, c), stats = asyncio.run(scenario())
    assert a["response_ids"] == list(range(1, 21)) and len(c["response_ids"]) == 5
    # a refusal is the request's own fault (a client error, HTTP 400), reported with its reason
    assert isinstance(bad, EngineRefusedError) and isinstance(bad, EngineError)
    assert str(bad) == "the engine refused this request: prompt too long"
    assert (stats["requests"], stats["errors"], stats["cancelled"]) == (2, 1, 0)


def test_parked_requests_resume_first_in_arrival_order_and_within_max_batch_size(engine):
    eng, backend = engine

    async def scenario():
        await eng.ready()
        await eng.pause()
        calls = [asyncio.ensure_future(eng.generate(GenerateRequest([p], max_tokens=10))) for p in range(1, 7)]
        await asyncio.sleep(0.02)
        await eng.resume()
        await _until(lambda: backend.n >= 2)
        await eng.pause(interrupt=True)
        await _until(lambda: len(eng._parked) == 6)
        mark = len(backend.log)
        await eng.resume()
        calls.append(asyncio.ensure_future(eng.generate(GenerateRequest([7], max_tokens=10))))
        return await asyncio.gather(*calls), mark

    outs, mark = asyncio.run(scenario())
    assert _adds(backend, mark) == [1, 2, 3, 4, 5, 6, 7]
    assert max(len(running) for e, running in backend.log if e == "step") == 4
    assert [len(o["response_ids"]) for o in outs] == [10] * 7


def test_a_request_queued_during_the_step_a_sync_interrupts_resumes_after_the_older_one(engine):
    eng, backend = engine

    async def scenario():
        await eng.ready()
        a = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=20)))
        await _until(lambda: backend.n >= 2)
        backend.gate.clear()
        await _until(backend.stepping.is_set)  # the engine thread waits inside a step
        b = asyncio.ensure_future(eng.generate(GenerateRequest([2], max_tokens=5)))
        await asyncio.sleep(0.01)  # b is queued
        await eng.pause(interrupt=True)
        backend.gate.set()
        await _until(lambda: len(eng._parked) == 2)
        parked = [job.payload.prompt_ids[0] for job in eng._parked]
        mark = len(backend.log)
        await eng.resume()
        return parked, await a, await b, mark

    parked, a, b, mark = asyncio.run(scenario())
    assert parked == [1, 2] and _adds(backend, mark) == [1, 2]
    assert len(a["response_ids"]) == 20 and len(b["response_ids"]) == 5


def test_can_add_raising_retries_the_running_request_and_the_engine_goes_on(engine):
    eng, backend = engine

    async def scenario():
        await eng.ready()
        a = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=20)))
        await _until(lambda: backend.n >= 2)
        backend.faults.append("can_add")
        await _until(lambda: not backend.faults)
        b = await asyncio.wait_for(eng.generate(GenerateRequest([2], max_tokens=3)), 2)
        return await asyncio.wait_for(a, 2), b, await eng.stats()

    a, b, stats = asyncio.run(scenario())
    ids = a["response_ids"]
    assert ids == list(range(ids[0], ids[0] + 20)) and ids[0] > 1 and len(b["response_ids"]) == 3
    assert (stats["requests"], stats["errors"]) == (2, 0) and eng._thread.is_alive()


def test_a_stream_callback_that_raises_fails_its_request_only(engine):
    eng, backend = engine
    calls = []

    def broken(ids):
        calls.append(ids)
        if len(calls) == 3:
            raise RuntimeError("the caller's loop is gone")

    async def scenario():
        await eng.ready()
        other = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=10)))
        await _until(lambda: backend.n >= 1)
        job = _Job("generate", GenerateRequest([5], max_tokens=10), asyncio.get_running_loop(), stream=broken)
        await eng._enqueue(job)
        out = await asyncio.wait_for(asyncio.gather(job.future, other, return_exceptions=True), 2)
        return out, await eng.stats()

    (failed, other), stats = asyncio.run(scenario())
    assert isinstance(failed, EngineError) and other["response_ids"] == list(range(1, 11))
    # its third step's tokens raised in the stream: it was aborted there and never stepped again
    assert len(calls) == 3 and sum(5 in r for e, r in backend.log if e == "step") == 3
    assert (stats["requests"], stats["errors"], stats["cancelled"]) == (1, 1, 0)


def test_a_job_whose_event_loop_closed_does_not_stop_the_engine(engine):
    eng, backend = engine

    async def scenario():
        await eng.ready()
        gone = asyncio.new_event_loop()
        gone.close()
        eng._jobs.put(_Job("call", lambda: None, gone))
        eng._jobs.put(_Job("generate", GenerateRequest([1], max_tokens=3), gone))
        return await asyncio.wait_for(eng.generate(GenerateRequest([2], max_tokens=2)), 2)

    assert len(asyncio.run(scenario())["response_ids"]) == 2 and eng._thread.is_alive()


def test_a_streamed_request_resumed_after_a_sync_is_retried_when_its_first_step_fails(engine):
    eng, backend = engine
    streamed: list[int] = []

    async def scenario():
        await eng.ready()
        stream = eng.generate_stream(GenerateRequest([1], max_tokens=20))
        assert await stream.__anext__() == {"admitted": True}
        a = asyncio.ensure_future(_read(stream, streamed))
        b = asyncio.ensure_future(eng.generate(GenerateRequest([2], max_tokens=20)))
        await _until(lambda: backend.n >= 3 and len(streamed) >= 2)
        await eng.pause(interrupt=True)
        await _until(lambda: len(eng._parked) == 2)
        backend.faults.append("step")  # the first step after the resume fails: nothing of it was streamed
        await eng.resume()
        return await asyncio.gather(a, b, return_exceptions=True), await eng.stats()

    (a, b), stats = asyncio.run(scenario())
    assert a["response_ids"] == streamed and len(streamed) == 20 and len(b["response_ids"]) == 20
    assert (stats["requests"], stats["errors"], stats["interrupted"], stats["tokens"]) == (2, 0, 2, 40)


class RescoreBackend(LockstepBackend):
    """vLLM's contract for top-p replies: one that ended (or was aborted) is held back, re-scored and
    returned by the first step with no other request running; ``can_add`` is False meanwhile."""

    def __init__(self):
        super().__init__()
        self.pending: dict[int, GenerateOutput] = {}  # by key: ended top-p replies awaiting the re-score
        self.top_p: dict[int, bool] = {}  # by key: a top-p request

    def can_add(self):
        return not self.pending

    def step(self):
        out = super().step()
        for key in [k for k in out.finished if self.top_p.pop(k)]:
            self.pending[key] = out.finished.pop(key)
        if self.pending and not self.runs:
            self.log.append(("rescore", sorted(self.pending)))
            out.finished.update(self.pending)
            self.pending = {}
        return out

    def add(self, key, request):
        super().add(key, request)
        self.top_p[key] = request.top_p < 1.0


def test_an_interrupt_waits_for_a_pending_rescore_which_returns_its_reply_before_the_load(monkeypatch):
    import clawray.engines

    backend = RescoreBackend()
    monkeypatch.setattr(clawray.engines, "make_backend", lambda *a, **k: backend)
    eng = RolloutEngine("unused", {"max_batch_size": 4}, backend="fake")

    async def scenario():
        await eng.ready()
        long = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=50)))
        short = asyncio.ensure_future(eng.generate(GenerateRequest([2], max_tokens=3, top_p=0.9)))
        await _until(lambda: backend.pending)  # the top-p reply ended and awaits its re-score
        await eng.pause(interrupt=True)
        await eng._call(lambda: backend.log.append(("load", len(backend.runs), len(backend.pending))))
        parked = [job.payload.prompt_ids[0] for job in eng._parked]
        await eng.resume()
        return await long, await short, parked, await eng.stats()

    try:
        long, short, parked, stats = asyncio.run(scenario())
    finally:
        eng._jobs.put(None)
    events = [e for e in backend.log if e[0] in ("rescore", "load")]
    assert events == [("rescore", [1]), ("load", 0, 0)]  # the re-score ran on the old weights, then the load
    assert short["finish_reason"] == "length" and len(short["response_ids"]) == 3 and parked == [1]
    assert len(long["response_ids"]) == 50 and (stats["interrupted"], stats["requests"]) == (1, 2)


def test_max_batch_size_below_one_is_refused():
    with pytest.raises(ValueError, match="max_batch_size must be >= 1, got 0"):
        RolloutEngine("unused", {"max_batch_size": 0}, backend="fake")  # before: an engine thread spinning forever


def test_shutdown_while_paused_fails_the_calls_waiting_for_the_resume(engine):
    """A generate call (plain or streamed) that waits for a sync's resume when the engine shuts down
    fails with EngineError at once; before, it waited forever (nobody resumes a shut-down engine)."""
    eng, backend = engine

    async def scenario():
        await eng.ready()
        await eng.pause(interrupt=True)
        plain = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=3)))
        streamed = asyncio.ensure_future(_read(eng.generate_stream(GenerateRequest([2], max_tokens=3)), []))
        await _until(lambda: eng._in_flight == 2)
        await eng.shutdown()
        out = await asyncio.wait_for(asyncio.gather(plain, streamed, return_exceptions=True), 2)
        eng._thread.join(2)
        await eng.pause()  # a pause after the shutdown does not make later calls wait either
        late = await asyncio.wait_for(asyncio.gather(eng.generate(GenerateRequest([3])), return_exceptions=True), 2)
        return [*out, *late], await eng.stats()

    (plain, streamed, late), stats = asyncio.run(scenario())
    assert [type(e) for e in (plain, streamed, late)] == [EngineError, EngineError, EngineError]
    assert str(plain) == str(streamed) == str(late) == "rollout-0 has shut down" and _adds(backend) == []
    assert stats["in_flight"] == 0 and not eng._thread.is_alive()


def test_a_call_cancelled_while_waiting_for_a_resume_is_counted_as_cancelled(engine):
    """``requests + cancelled + errors`` counts every generate call that ended: one whose caller went
    away while it waited for a sync's resume is ``cancelled`` (before: counted nowhere)."""
    eng, backend = engine

    async def scenario():
        await eng.ready()
        await eng.pause()
        plain = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=3)))
        streamed = asyncio.ensure_future(_read(eng.generate_stream(GenerateRequest([2], max_tokens=3)), []))
        await _until(lambda: eng._in_flight == 2)
        plain.cancel()
        streamed.cancel()
        await asyncio.gather(plain, streamed, return_exceptions=True)
        await eng.resume()
        after = await eng.generate(GenerateRequest([3], max_tokens=2))
        return after, await eng.stats()

    after, stats = asyncio.run(scenario())
    assert len(after["response_ids"]) == 2 and _adds(backend) == [3]
    assert (stats["requests"], stats["cancelled"], stats["errors"], stats["in_flight"]) == (1, 2, 0, 0)


class _MarkerTransport:
    """A weight-sync transport stand-in: ``receive`` yields one marker tensor name per version."""

    def receive(self, expected_version: int):
        return [(f"v{expected_version}", None)]

    def done(self, ok: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def test_an_inflight_load_runs_between_two_steps_and_the_running_reply_goes_on(engine):
    """``sync.mode: inflight``: the load does not wait for the running generation (a FIFO job would)
    and no pause is involved; the reply stays one request, its tokens up to the step before the load
    are v0 and every later one v1; a re-scored reply (vLLM top-p) carries the version that scored it."""
    eng, backend = engine
    loads = []
    backend.load_weights = lambda weights: loads.append(([name for name, _ in weights], sorted(backend.runs)))

    async def scenario():
        await eng.ready()
        eng._transport = _MarkerTransport()
        reply = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=30)))
        await _until(lambda: backend.n >= 5)
        backend.gate.clear()  # hold the next step at its start
        backend.stepping.clear()
        await _until(backend.stepping.is_set)
        at = backend.n + 1  # the held step samples token `at` on the old weights
        load = asyncio.ensure_future(eng.receive_weights(1, inflight=True))
        await _until(lambda: not eng._between.empty())  # received off the engine thread, load queued
        backend.gate.set()
        loaded = await load
        return await reply, loaded, at, await eng.stats()

    reply, loaded, at, stats = asyncio.run(scenario())
    assert loads == [(["v1"], [0])]  # loaded while request 0 was still in the backend
    assert loaded["version"] == 1 and loaded["inflight"] == 1 and loaded["interrupted"] == 0
    assert reply["response_ids"] == list(range(1, 31)) and reply["finish_reason"] == "length"
    assert reply["token_versions"] == [0] * at + [1] * (30 - at) and reply["policy_version"] == 0
    assert (stats["requests"], stats["interrupted"], stats["loads"], stats["tokens"], stats["steps"]) == (
        1,
        0,
        1,
        30,
        30,
    )
    assert not stats["paused"]

    # an idle engine (its thread blocked on the queue) loads at once; a re-scored output is one version
    async def rescored():
        loaded = await eng.receive_weights(2, inflight=True)
        real_step = backend.step

        def step():
            out = real_step()
            for key, o in out.finished.items():
                out.finished[key] = GenerateOutput(o.response_ids, o.logprobs, o.finish_reason, rescored=True)
            return out

        backend.step = step
        reply = asyncio.ensure_future(eng.generate(GenerateRequest([2], max_tokens=6)))
        await _until(lambda: backend.n >= 33)
        await eng.receive_weights(3, inflight=True)
        return loaded, await reply

    loaded, reply = asyncio.run(rescored())
    assert loaded["inflight"] == 0 and loaded["version"] == 2 and loads[1:] == [(["v2"], []), (["v3"], [1])]
    assert reply["token_versions"] == [3] * 6 and reply["policy_version"] == 3


def test_shutdown_fails_an_inflight_load_still_queued(engine):
    eng, backend = engine

    async def scenario():
        await eng.ready()
        eng._stopped = True  # the engine thread stopped after emptying its queues
        job = _Job("load", lambda: "loaded", asyncio.get_running_loop())
        await eng._enqueue(job, between=True)
        with pytest.raises(EngineError, match="has shut down"):
            await job.future
        return eng._between.empty()

    assert asyncio.run(scenario())


def test_inflight_syncs_load_in_the_order_sent_and_one_never_loaded_is_released(engine):
    """A receive that outlives its sync (a controller timeout) does not race the next one: in-flight
    syncs receive and load one at a time, so the version never goes backwards; a sync received by an
    engine that has shut down is released at the sender (``done(ok=False)``: ipc unmaps its buffers)."""
    eng, backend = engine
    release, inside = threading.Event(), []
    loads = []
    backend.load_weights = lambda weights: loads.append([name for name, _ in weights])

    class SlowFirst(_MarkerTransport):
        dones: list[bool] = []

        def receive(self, expected_version):
            inside.append(expected_version)
            if expected_version == 1:
                release.wait(5)
            return super().receive(expected_version)

        def done(self, ok=True):
            self.dones.append(ok)

    async def scenario():
        await eng.ready()
        eng._transport = SlowFirst()
        first = asyncio.ensure_future(eng.receive_weights(1, inflight=True))
        await _until(lambda: inside == [1])
        second = asyncio.ensure_future(eng.receive_weights(2, inflight=True))
        await asyncio.sleep(0.05)
        waiting = (second.done(), inside[:], eng.version)  # v2 waits behind v1, not received yet
        release.set()
        await asyncio.gather(first, second)
        await eng.shutdown()
        await asyncio.get_running_loop().run_in_executor(None, eng._thread.join, 2)
        with pytest.raises(EngineError, match="has shut down"):
            await eng.receive_weights(3, inflight=True)
        return waiting

    waiting = asyncio.run(scenario())
    assert waiting == (False, [1], 0)
    assert loads == [["v1"], ["v2"]] and eng.version == 2
    assert inside == [1, 2, 3] and SlowFirst.dones == [True, True, False]


def test_a_gate_probe_runs_while_paused_and_the_users_requests_wait_for_the_resume(engine):
    """deploy.gate: with the engine paused (interrupt), a probe generation runs to its end on the
    loaded weights while a parked user request and one that arrives during the pause both wait; they
    run only after the resume."""
    eng, backend = engine

    async def scenario():
        await eng.ready()
        a = asyncio.ensure_future(eng.generate(GenerateRequest([1], max_tokens=6)))
        await _until(lambda: backend.n >= 2)
        await eng.pause(interrupt=True)
        await _until(lambda: len(eng._parked) == 1)
        b = asyncio.ensure_future(eng.generate(GenerateRequest([2], max_tokens=3)))
        mark = len(backend.log)
        probe = await asyncio.wait_for(eng.generate(GenerateRequest([3], max_tokens=4), None, True), 5.0)
        during = backend.log[mark:]
        assert not a.done() and not b.done()
        await eng.resume()
        return probe, during, await a, await b

    probe, during, a, b = asyncio.run(scenario())
    assert len(probe["response_ids"]) == 4 and probe["finish_reason"] == "length"
    assert during[0] == ("add", 3) and {tuple(r) for e, r in during if e == "step"} == {(3,)}
    assert len(a["response_ids"]) == 6 and len(b["response_ids"]) == 3


def test_gate_probes_retried_alone_after_a_failed_step_run_to_their_end_while_paused(engine):
    """A step holding two gate probes failed while the engine was paused for the gate: each probe was
    retried alone under a cancel check that read the pause's interrupt, so it stopped at once, was
    parked for a resume that the gate (waiting for its probes) never sends: a deadlock. A probe's
    retry ignores the interrupt, as its steps do."""
    eng, backend = engine

    async def scenario():
        await eng.ready()
        await eng.pause(interrupt=True)
        backend.gate.clear()  # both probes join the first step, which fails
        backend.faults.append("step")
        probes = [asyncio.ensure_future(eng.generate(GenerateRequest([p], max_tokens=3), None, True)) for p in (3, 4)]
        await _until(lambda: backend.stepping.is_set() and len(backend.runs) == 2)
        backend.gate.set()
        done = await asyncio.wait_for(asyncio.gather(*probes), 5.0)
        parked = len(eng._parked)
        await eng.resume()
        return done, parked

    done, parked = asyncio.run(scenario())
    assert [(len(p["response_ids"]), p["finish_reason"]) for p in done] == [(3, "length"), (3, "length")]
    assert parked == 0


def test_a_canary_engine_serves_canary_traffic_only_and_a_waiting_request_meets_the_arm_the_sync_left(engine):
    """The promotion gate's canary (clawray.canary): a reserved engine refuses every user request at
    once; one that waited through a pause meets the arm set meanwhile (canary: only canary traffic);
    the probe runs whatever the arm; replies say whether a canary engine served them."""
    from clawray.actors.rollout import EngineArmError

    eng, backend = engine

    async def scenario():
        await eng.ready()
        plain = await eng.generate(GenerateRequest([1], max_tokens=2))
        await eng.set_arm("reserved")
        refused = []
        for canary in (False, True):
            try:
                await eng.generate(GenerateRequest([2], max_tokens=2, canary=canary))
            except EngineArmError as e:
                refused.append(str(e))
        probe = await eng.generate(GenerateRequest([3], max_tokens=2), None, True)
        await eng.pause()
        await eng.set_arm(None)
        waiting = [
            asyncio.ensure_future(eng.generate(GenerateRequest([p], max_tokens=2, canary=p == 5))) for p in (4, 5)
        ]
        await asyncio.sleep(0.02)
        await eng.set_arm("canary", 0.3)  # the sync is over: the engine serves the canary
        await eng.resume()
        outs = await asyncio.gather(*waiting, return_exceptions=True)
        return plain, refused, probe, outs, await eng.stats()

    plain, refused, probe, outs, stats = asyncio.run(scenario())
    assert plain["canary"] is False and probe["canary"] is False and len(probe["response_ids"]) == 2
    assert refused == ["rollout-0 serves the reserved arm only"] * 2
    assert isinstance(outs[0], EngineArmError) and str(outs[0]) == "rollout-0 serves the canary arm only"
    assert outs[1]["canary"] is True and len(outs[1]["response_ids"]) == 2
    assert stats["arm"] == "canary" and stats["canary_fraction"] == 0.3 and stats["in_flight"] == 0
    assert [e for e in backend.log if e[0] == "add"] == [("add", 1), ("add", 3), ("add", 5)]

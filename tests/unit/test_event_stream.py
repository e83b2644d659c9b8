"""The SSE answer's clean-up runs however the response ends (:class:`clawray.serve.sse.EventStreamResponse`):
Starlette may end a StreamingResponse before its body starts (a client gone before the first byte), and
an async generator never iterated never runs its ``finally``: the session lock stayed held and the
session's next request waited for ever."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest
from starlette.requests import ClientDisconnect

import clawray.serve.sse as sse
from clawray.serve.sse import EventStreamResponse, StreamContext


class _Stream:
    """An engine stream that admitted its request and then never yields (the client is gone first)."""

    def __anext__(self):
        async def never():
            await asyncio.sleep(3600)

        return never()


def _context(released: list) -> StreamContext:
    async def record(outs, parsed):  # never reached: nothing is recorded for a cancelled stream
        raise AssertionError("recorded")

    return StreamContext(
        model="m",
        timeout_s=30.0,
        untagged=False,
        reply_text=None,
        counts=Counter(),
        record=record,
        release=lambda: released.append("lock"),
    )


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_client_gone_before_the_first_byte_releases_the_lock_and_stops_the_engine_streams(monkeypatch, spec):
    cancelled, released = [], []
    monkeypatch.setattr(sse, "cancel_streams", lambda streams: cancelled.append(len(streams)))
    call = SimpleNamespace(req=SimpleNamespace(model=None, include_usage=False))
    ctx = _context(released)
    response = EventStreamResponse(call, [_Stream(), _Stream()], ctx, headers={})

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):  # 2.4: a send to a gone client fails
        if spec == "2.4":
            raise OSError("the client is gone")
        await asyncio.sleep(0.01)

    async def serve():
        try:
            await response({"type": "http", "asgi": {"spec_version": spec}}, receive, send)
        except ClientDisconnect:  # 2.4: Starlette's answer to the failed send
            pass

    asyncio.run(asyncio.wait_for(serve(), 10))
    assert (released, cancelled) == (["lock"], [2])
    assert (ctx.counts["cancelled"], ctx.counts["streams_not_completed"]) == (1, 1)


def test_a_started_stream_cleans_up_once_in_its_own_finally(monkeypatch):
    """A client gone mid-stream: the generator's own finally releases the lock; the response adds nothing."""
    cancelled, released = [], []
    monkeypatch.setattr(sse, "cancel_streams", lambda streams: cancelled.append(len(streams)))
    call = SimpleNamespace(
        req=SimpleNamespace(model=None, include_usage=False, n=1), session_id="s", in_reasoning=False
    )
    ctx = _context(released)
    response = EventStreamResponse(call, [_Stream()], ctx, headers={})
    sent = []

    async def receive():
        await asyncio.sleep(0.2)  # the body has started (headers and the role delta sent)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message["type"])

    asyncio.run(asyncio.wait_for(response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send), 10))
    assert ctx.started and "http.response.body" in sent
    assert (released, cancelled) == (["lock"], [1])

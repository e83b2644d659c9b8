"""The SSE writer of a streamed chat completion: engine token streams in, OpenAI chunks out.

Per choice a role delta, reasoning/content/tool-call deltas as its tokens arrive (text on UTF-8
character boundaries; choices interleave, each chunk names its ``index``), then every choice's finish
chunk, the usage chunk when asked, ``[DONE]``. The turns are recorded before the finish chunks, so the
client's next request finds them. A failure once the headers are sent is an in-band error event
(:func:`clawray.serve.errors.stream_error_body`), never a broken connection; a client that hangs up
stops the engine streams and records nothing.

Owns: the chunk format and the merging of the choices' streams. Must not: choose an engine or hold
the server: it takes plain values (:class:`StreamContext`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections import Counter
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import ray
from starlette.responses import StreamingResponse

from clawray.serve.errors import stream_error_body
from clawray.serve.reply import IncrementalDetokenizer, ParsedReply, ReplyDecoder, ReplyParser

logger = logging.getLogger("ray.serve")


@dataclasses.dataclass
class StreamContext:
    """What the writer needs from the server.

    Attributes:
        model: the model name of the chunks (the request's, else ``serve.model_name``).
        timeout_s: seconds a stream may wait for its next item (``serve.generate_timeout_s``).
        untagged: ``serve.untagged_tool_calls``.
        reply_text: ids -> client text.
        counts: the replica's counters (``streams``, ``cancelled``, ``streams_not_completed``, errors).
        record: ``record(outs, parsed) -> [(finish_reason, turn index or None)]``: records the
            choices' turns (engine outputs and parsed replies) and says how each ended.
        release: called once when the stream ends, however it ends (the session lock).
        started: the event generator began (its own ``finally`` cleans up; else :class:`EventStreamResponse`).
    """

    model: str
    timeout_s: float
    untagged: bool
    reply_text: ReplyDecoder
    counts: Counter
    record: Callable[[list[dict], list[ParsedReply]], Awaitable[list[tuple[str, int | None]]]]
    release: Callable[[], None]
    started: bool = False


async def next_item(stream: Any) -> dict:
    """The next item of a Ray streaming generator (``StopAsyncIteration`` at its end)."""
    return await (await stream.__anext__())


def cancel_streams(streams: list) -> None:
    """Cancel engine streams (``ray.cancel``; a finished one is left alone): their generation stops."""
    for stream in streams:
        try:
            ray.cancel(stream)
        except Exception:  # noqa: BLE001 - already finished or its actor is gone: nothing left to stop
            pass


async def sse_events(call: Any, streams: list, ctx: StreamContext) -> AsyncIterator[str]:
    """The event stream of ``call`` (the request: ``req``, ``session_id``, ``prompt_ids``,
    ``in_reasoning``, ``end_ids``) over its admitted engine ``streams``, one per choice."""
    ctx.started = True
    req = call.req
    chunk = _Chunker(req.model or ctx.model, req.include_usage)
    merged: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.ensure_future(_pump(i, s, merged, ctx.timeout_s)) for i, s in enumerate(streams)]
    completed = False
    try:
        outs, parsed = [None] * len(streams), []
        async for text in _deltas(call, streams, merged, chunk, ctx, outs, parsed):
            yield text
        for i, (finish, index) in enumerate(await ctx.record(outs, parsed)):  # before [DONE]
            extra = {"session_id": call.session_id, "turn_index": index, "policy_version": outs[i]["policy_version"]}
            yield chunk(i, {}, finish, **extra)
        if req.include_usage:
            n_prompt, n_completion = len(call.prompt_ids), sum(len(o["response_ids"]) for o in outs)
            usage = {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_completion,
                "total_tokens": n_prompt + n_completion,
            }
            yield chunk.usage(usage)
        yield "data: [DONE]\n\n"
        completed = True
        ctx.counts["streams"] += 1
    except (asyncio.CancelledError, GeneratorExit, ray.exceptions.TaskCancelledError) as e:
        # the client hung up: nothing is recorded, the engine streams are stopped (finally)
        ctx.counts["cancelled"] += 1
        logger.info("stream cancelled: the client disconnected")
        if isinstance(e, ray.exceptions.TaskCancelledError):
            raise asyncio.CancelledError() from None
        raise
    except Exception as e:  # headers are sent: report in-band (no internals)
        yield f"data: {json.dumps(stream_error_body(e, ctx.counts))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for p in pumps:
            p.cancel()
        if not completed:
            ctx.counts["streams_not_completed"] += 1
            cancel_streams(streams)
        ctx.release()


class EventStreamResponse(StreamingResponse):
    """The SSE answer of :func:`sse_events` over ``streams``. Its clean-up (stop the engine streams,
    release the session lock) also runs when Starlette ends the response before the body starts (a
    client gone before the first byte, a failed first send): an async generator never iterated never
    runs its ``finally``, and the session's next request waited for the lock for ever."""

    def __init__(self, call: Any, streams: list, ctx: StreamContext, headers: dict[str, str]):
        self._streams, self._ctx = streams, ctx
        super().__init__(sse_events(call, streams, ctx), media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # a suspended generator runs its finally now
            if not self._ctx.started:  # never iterated: no finally ran
                self._ctx.started = True
                self._ctx.counts["cancelled"] += 1
                self._ctx.counts["streams_not_completed"] += 1
                cancel_streams(self._streams)
                self._ctx.release()


async def _deltas(
    call: Any, streams: list, merged: asyncio.Queue, chunk: Any, ctx: StreamContext, outs: list, parsed: list
) -> AsyncIterator[str]:
    """The role deltas, then each choice's deltas as its tokens arrive until every choice is done;
    fills ``outs`` (each choice's final engine item) and ``parsed`` (its :class:`ParsedReply`).

    Raises:
        Exception: what an engine stream raised (or a timeout).
    """
    n, req = len(streams), call.req
    detoks = [IncrementalDetokenizer(ctx.reply_text) for _ in range(n)]
    parsers = [ReplyParser(call.in_reasoning, tools=req.tools, untagged=ctx.untagged) for _ in range(n)]
    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    remaining = n
    while remaining:
        i, item, error = await merged.get()
        if error is not None:
            raise error
        if item.get("done"):
            outs[i], remaining = item, remaining - 1
            events = parsers[i].feed(detoks[i].finish()) + parsers[i].finish()
        else:
            events = parsers[i].feed(detoks[i].add([t for t in item["token_ids"] if t not in call.end_ids]))
        for text in _event_chunks(chunk, i, events):
            yield text
    parsed.extend(p.result for p in parsers)


def _event_chunks(chunk: Any, i: int, events: list) -> Iterator[str]:
    for kind, value in events:
        if kind == "tool_call":
            yield chunk(i, {"tool_calls": [value]})
        else:
            yield chunk(i, {"reasoning_content" if kind == "reasoning" else "content": value})


async def _pump(i: int, stream: Any, merged: asyncio.Queue, timeout_s: float) -> None:
    """Engine stream ``i`` into the merged queue as ``(i, item, None)``; its failure as ``(i, None, error)``."""
    try:
        while True:
            item = await asyncio.wait_for(next_item(stream), timeout=timeout_s)
            merged.put_nowait((i, item, None))
            if item.get("done"):
                return
    except Exception as e:  # noqa: BLE001 - the writer raises it in its own task
        merged.put_nowait((i, None, e))


class _Chunker:
    """``chunk(i, delta, finish=None, **extra)`` -> one ``data:`` line of a ``chat.completion.chunk``
    (with ``"usage": null`` when the client asked for usage); :meth:`usage` the usage chunk."""

    def __init__(self, model: str, include_usage: bool):
        self.base = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        self.usage_field = {"usage": None} if include_usage else {}

    def __call__(self, i: int, delta: dict, finish: str | None = None, **extra: Any) -> str:
        choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}
        body = {**self.base, "choices": [choice], **self.usage_field, **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def usage(self, usage: dict) -> str:
        return f"data: {json.dumps({**self.base, 'choices': [], 'usage': usage})}\n\n"

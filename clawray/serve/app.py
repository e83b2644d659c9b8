"""PolicyServer: the OpenAI-compatible chat endpoint, a Ray Serve deployment with a FastAPI ingress.

Owns: the routes, the order of a request's handling (admission, session, lock, prompt ids, engine,
record, answer), how a request that names no session finds one, the prompt ids (spliced or rendered
afresh) and the replica's counters. Must not: validate a body (:mod:`clawray.serve.protocol`), choose
an engine (:mod:`clawray.serve.engine_pool`) or keep a session's turns (the SessionTracker does).

Routes: ``POST /v1/chat/completions`` (plain or SSE-streamed; ``tools`` in, ``tool_calls`` out,
``<think>`` out as ``reasoning_content``; ``n`` choices), ``GET /v1/models``, ``GET /health``. Each
request becomes prompt token ids -- the tokenizer's own chat template, with the previous turn's exact
tokens spliced in (:mod:`clawray.serve.splice`) -- and goes to a RolloutEngine; every main-line turn is
recorded with the exact prompt and response token ids and the engine's log-probs (the response text
is never re-tokenised).

End of turn: every id of :func:`clawray.chat.end_of_turn_ids` is the engine's stop list; the finish
reason and the ids the client sees are :class:`clawray.serve.call.Call`'s, the next prompt's
continuation :mod:`clawray.serve.splice`'s.

Sessions (as OpenClaw-RL's proxy): the session id, ``X-Turn-Type: side``, ``X-Session-Done`` and
``X-Session-Outcome`` (or their body fields) are read by :func:`clawray.serve.protocol.parse_chat_request`.
A main-line request that names no session gets the client's own id written in the conversation
(:func:`clawray.client_rules.session_hint`), else the open session its history continues
(:meth:`clawray.actors.session.SessionTracker.lookup`), else a new one for a conversation's first
request; any other is served and not recorded. A side turn is served but never trained;
``X-Session-Done`` closes the session, with its ``X-Session-Outcome`` for ``trainer.credit``. A
session's requests run one at a time, in arrival order.

Every client error is an HTTP 4xx with an OpenAI-style body (:mod:`clawray.serve.errors`; in-band on a
stream whose headers were already sent); nothing is recorded for a rejected request.

Hostile clients (README, "Reliability and security"): header bytes and sizes are refused in Serve's proxy
(:mod:`clawray.serve.guard`); origin, Host, API key, content type, body size and deadline and session
binding are checked here before any session lock is taken (:mod:`clawray.serve.admission`). Engine
choice and fail-over: :mod:`clawray.serve.engine_pool`; the SSE writer: :mod:`clawray.serve.sse`;
errors: :mod:`clawray.serve.errors`; ``/health``: :mod:`clawray.serve.health`.

Replicas (``serve.num_replicas``): every request of a session reaches the same replica
(:mod:`clawray.serve.routing`), so the session lock, its binding token and its engine are one replica's
state. Everything else a replica holds is either read from the shared actors (tracker, engines) or set on
every replica by :meth:`PolicyServer.set_actors` through ``DeploymentHandle.broadcast``;
:meth:`PolicyServer.stats` reports one replica's counters (the driver broadcasts it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
import ray
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from clawray.actors.rollout import await_cancellable
from clawray.chat import RequestError, attribution_keys, conversation_keys, end_of_turn_ids, render_key
from clawray.client_rules import session_hint
from clawray.config import ServeConfig, section
from clawray.serve.admission import Admission, SessionLocks
from clawray.serve.call import Call
from clawray.serve.engine_pool import EnginePool
from clawray.serve.errors import answer_error, error_response, unauthorized
from clawray.serve.guard import keep_replica_grpc_on_loopback
from clawray.serve.health import health_body, serving_versions
from clawray.serve.protocol import ChatRequest, decode_body, header_text, parse_chat_request, prompt_chars
from clawray.serve.reply import THINK_OPEN, ParsedReply, ReplyDecoder, parse_reply_text
from clawray.serve.splice import SpliceError, splice_suffix
from clawray.serve.sse import EventStreamResponse, StreamContext, cancel_streams, next_item
from clawray.session_book import quiet_positions, reply_key, user_session_prefix
from clawray.types import Turn

keep_replica_grpc_on_loopback()  # in the replica process, before it starts its gRPC server (see guard.py)
app = FastAPI(title="clawray policy server", docs_url=None, redoc_url=None, openapi_url=None)
logger = logging.getLogger("ray.serve")
MAX_CHARS_PER_TOKEN = 128  # no tokenizer token is longer: a prompt with more characters cannot fit
# prompts of at most this many characters (message contents + tool calls) are rendered and tokenised
# on the event loop (tens of microseconds); longer ones in a worker thread
INLINE_PROMPT_CHARS = 4096


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and wrong methods answer in the OpenAI error shape too."""
    return error_response(
        exc.status_code,
        f"{request.method} {request.url.path}: {exc.detail}",
        None,
        "not_found" if exc.status_code == 404 else "invalid_request",
    )


# a stopping replica looks for requests in flight every 0.25 s (Serve's default waits 2 s before looking)
@serve.deployment(max_ongoing_requests=256, graceful_shutdown_wait_loop_s=0.25)
@serve.ingress(app)
class PolicyServer:
    """The endpoint.

    Args:
        model_path: policy folder (its tokenizer and chat template are used).
        engines: RolloutEngine actor handles; a session sticks to one engine (prefix-cache locality).
        tracker: SessionTracker actor handle (session state, turn records).
        cfg: the ``serve`` config section (:class:`~clawray.config.ServeConfig`; an omegaconf node or a
            mapping of some of its keys is converted by :func:`~clawray.config.section`, defaults from
            the schema): model name, request defaults, timeouts, body limit, API key (empty: no auth),
            origins, session binding, ``engine_slack``.
        max_model_len: tokens, prompt + response, of the rollout engines (``rollout.max_model_len``).
        actors: ``{"judges": [...], "teachers": [...], "learners": [...], "queue": handle}`` whose
            state ``/health`` reports (read from Ray's actor table, never by calling them);
            :meth:`set_actors` replaces an entry (a rebuilt learner group).
        engine_poll_s: seconds between two polls of the engines' states and queue depths (routing).

    Raises:
        ConfigError: ``cfg`` is a mapping with a key :class:`~clawray.config.ServeConfig` lacks or a
            value of the wrong type.
    """

    def __init__(
        self,
        model_path: str,
        engines: list,
        tracker: Any,
        cfg: ServeConfig,
        max_model_len: int,
        actors: dict | None = None,
        engine_poll_s: float = 1.0,
    ):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.reply_text = ReplyDecoder(self.tokenizer)  # ids -> client text (no <|im_start|>, <|endoftext|>)
        self.engines, self.tracker = engines, tracker
        self.cfg = section(ServeConfig, cfg)
        self.max_model_len = max_model_len
        self.stop_text = self.tokenizer.eos_token  # the end tag the chat template renders after a reply
        self.end_ids = end_of_turn_ids(model_path, self.tokenizer)
        self.counts: Counter[str] = Counter()
        self.admission = Admission(self.cfg, self.counts)
        self.locks = SessionLocks()
        self.pool = EnginePool(engines, self.cfg.engine_slack, self.cfg.retry_after_s, self.counts, engine_poll_s)
        self._warned_no_session = False
        self.actors: dict = dict(actors or {})

    def set_actors(self, kind: str, handles: Any) -> None:
        """Replace the handles ``/health`` reports for ``kind`` (``"learners"`` after a rebuild); the
        driver calls it on every replica (``DeploymentHandle.broadcast``)."""
        self.actors[kind] = handles

    async def stats(self, session_ids: bool = False) -> dict:
        """This replica's counters: ``replica`` (Serve's replica id), ``requests`` (chat requests
        received), ``sessions`` (sessions it chose an engine for, at most
        :data:`~clawray.serve.engine_pool.MAX_HOMES` kept), ``engine_choices`` (per engine, sessions
        whose engine it is now), ``counts`` (every counter of ``/health``) and, with ``session_ids``,
        the ids of those sessions (sorted). Async: it runs on the replica's event loop, where the
        session map changes, never in a thread."""
        try:
            replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a Serve replica (unit tests)
            replica = "local"
        body = {
            "replica": replica,
            "requests": self.counts["requests"],
            "sessions": len(self.pool.homes),
            "engine_choices": self.pool.choices(),
            "counts": dict(self.counts),
        }
        if session_ids:
            body["session_ids"] = sorted(self.pool.homes)
        return body

    @app.get("/v1/models")
    async def models(self, request: Request) -> Any:
        """``GET /v1/models``: the one served policy with its ``max_model_len`` (tokens of prompt +
        reply, as vLLM reports it; agents such as OpenClaw budget their prompts on it) and the policy
        version users are served now (``policy_version``: most engines' version, None while none
        serves; ``policy_versions``: every one served; :func:`clawray.serve.health.serving_versions`).
        401 without the API key, as OpenAI; 403 for a foreign browser origin or Host."""
        refused = self._refuse(request)
        if refused is not None:
            return refused
        versions = await serving_versions(self.engines)
        return {
            "object": "list",
            "data": [
                {
                    "id": self.cfg.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "clawray",
                    "max_model_len": self.max_model_len,
                    "policy_version": versions[0] if versions else None,
                    "policy_versions": versions,
                }
            ],
        }

    @app.get("/health")
    async def health(self) -> Any:
        """``GET /health``: each actor kind's state, open sessions, counters. Open without the API key
        (load balancers probe it); it shows no conversation content, actor ids or pids.

        ``engines``: per engine its name, policy version and state (``serving``, ``syncing``: loading
        new weights, ``awaiting_sync``: restarted, waiting for the current policy, ``down``: dead or
        restarting); ``judges``, ``teachers``, ``learners``: per actor ``{"name", "state"}``;
        ``queue``, ``tracker``: a state; ``traffic``: requests received, main-line turns recorded, side
        turns (by kind), unattributable requests, turns paired / judged, samples sent, turns dropped by
        reason (:func:`clawray.serve.health.traffic_funnel`). Actor states: see
        :func:`clawray.serve.health.health_body`. 200 with ``"status": "ok"``; 503 with ``"status":
        "degraded"`` (and ``Retry-After``) while any of them is not serving/ok, or while the disk
        refuses the tracker's writes (``failing``: which files, and why)."""
        body, degraded = await health_body(self.engines, self.tracker, self.actors, self.counts)
        if degraded:
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(self.cfg.retry_after_s)})
        return body

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``, plain or streamed (SSE). 403 for a foreign browser origin, Host
        or session token, 401 without the configured API key, 415 for a body that is not JSON, 408 for a
        body that outlasts ``body_timeout_s``, 400/413 for client errors (400 ``request_refused`` when
        the engine refuses the request), 503 (with ``Retry-After``) while a weight sync outlasts
        ``sync_wait_timeout_s`` or when the engine does not answer within ``generate_timeout_s``,
        500 only for a server-side fault (:func:`clawray.serve.errors.answer_error`). Ray Serve's
        proxy echoes the client's ``X-Request-Id``."""
        self.counts["requests"] += 1
        refused = self._refuse(request, count=True)
        if refused is not None:
            return refused
        call: Call | None = None
        locked = token = None  # the session whose lock this request holds; its new binding token
        streaming = answered = False
        try:
            self.admission.check_content_type(request)
            raw = await self.admission.read_body(request)  # the whole body, under a deadline, before any lock
            cfg = self.cfg
            req = parse_chat_request(
                decode_body(raw), request.headers, cfg.default_max_tokens, cfg.default_temperature, cfg.max_n
            )
            given = header_text(request.headers, "x-session-token", "x-session-token")
            token = self.admission.bind_session(req.session_id, given)
            if req.session_id:  # then a session's requests queue in the order their bodies arrived
                await self.locks.acquire(req.session_id)
                locked = req.session_id
            call = Call(req, locked)
            call.new_token = token
            await self._prepare(call)
            response = await (self._stream(call) if req.stream else self._complete(call))
            streaming, answered = req.stream, True  # a stream releases the lock when it ends
            return response
        except (asyncio.CancelledError, ray.exceptions.TaskCancelledError):
            # the client hung up: Serve cancels this handler and (recursively) its engine calls
            self.counts["cancelled"] += 1
            logger.info("chat completion cancelled: the client disconnected")
            raise asyncio.CancelledError() from None
        except Exception as e:  # an OpenAI-style answer, never internals
            return answer_error(e, self.counts, self.cfg.retry_after_s)
        finally:
            locked = call.locked if call is not None else locked
            if locked and not streaming:
                self.locks.release(locked)
            if token and not answered:  # the client never got the token: the session stays unbound
                self.admission.unbind(req.session_id)

    # ------------------------------------------------------------------ request plumbing
    def _refuse(self, request: Request, count: bool = False) -> Response | None:
        """403 for a foreign browser origin or Host, 401 without the API key (counted as ``forbidden``
        / ``unauthorized`` when ``count``); None when the request may go on
        (:class:`~clawray.serve.admission.Admission`)."""
        try:
            self.admission.check_origin(request)
        except RequestError as e:
            if count:
                self.counts["forbidden"] += 1
            return error_response(403, str(e), None, e.code, "permission_error")
        if not self.admission.authorized(request):
            if count:
                self.counts["unauthorized"] += 1
            return unauthorized()
        return None

    async def _prepare(self, call: Call) -> None:
        """Resolve the session (explicit, inferred or new), take its lock, build the prompt ids.

        Raises:
            RequestError: the prompt does not fit ``max_model_len`` (checked on characters first, so
                a megabyte of text is refused without tokenising it).
        """
        req = call.req
        vocab = len(self.tokenizer)
        bad = [t for t in req.stop_token_ids if t >= vocab]
        if bad:
            raise RequestError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab})", "stop_token_ids")
        call.end_ids = list(dict.fromkeys([*self.end_ids, *req.stop_token_ids]))
        limit = self.max_model_len
        chars = prompt_chars(req.messages)
        tool_chars = len(json.dumps(req.tools)) if req.tools else 0  # the template renders them into the prompt
        if chars + tool_chars > limit * MAX_CHARS_PER_TOKEN:
            raise RequestError(
                f"prompt is {chars + tool_chars} characters ({tool_chars} of them tools), more than max_model_len"
                f" {limit} tokens can hold",
                "tools" if tool_chars > chars else "messages",
                "context_length_exceeded",
            )
        prev = None
        if req.turn_type == "main":
            attribution, exact_keys = attribution_keys(req.messages), conversation_keys(req.messages)
            assistant = [k for k, m in enumerate(req.messages) if m["role"] == "assistant"]
            keys = {k: attribution[k] for k in [*assistant, *quiet_positions(req.messages)]}
            if call.session_id is None:
                last_reply = reply_key(req.messages[assistant[-1]]) if assistant else None
                await self._infer_session(call, keys, last_reply)
            if call.session_id is not None and call.locked is None:
                await self.locks.acquire(call.session_id)
                call.locked = call.session_id
            if call.session_id is not None and keys:
                exact = {k: exact_keys[k] for k in assistant}
                found = await self.tracker.lookup.remote(call.session_id, keys, render_key(req.tools), False, exact)
                prev = found["prev"]
                self.counts["splice_context_changed"] += int(found["context_changed"])
        if chars <= INLINE_PROMPT_CHARS:  # about 0.1 ms of CPU: cheaper than a thread hop
            call.prompt_ids, call.spliced = self._prompt_ids(req, prev)
        else:  # a long render would stall every other request of this replica
            call.prompt_ids, call.spliced = await asyncio.to_thread(self._prompt_ids, req, prev)
        tail = self.tokenizer.decode(call.prompt_ids[-4:], skip_special_tokens=False)
        call.in_reasoning = tail.rstrip().endswith(THINK_OPEN)
        if len(call.prompt_ids) >= limit:
            raise RequestError(
                f"prompt is {len(call.prompt_ids)} tokens; max_model_len is {limit}",
                "messages",
                "context_length_exceeded",
            )

    async def _infer_session(self, call: Call, keys: dict[int, str], last_reply: str | None) -> None:
        """The session of a main-line request that names none: the client's own id written in the
        conversation (:func:`clawray.client_rules.session_hint`, OpenClaw's ``sessionId=``), else the
        open session whose pending turn its history continues (``keys``: attribution keys of its
        assistant messages and :func:`~clawray.session_book.quiet_positions`; ``last_reply``, the
        :func:`~clawray.session_book.reply_key` of its last assistant message, for a rewritten
        history), else a new session for a conversation's first request (no assistant message);
        otherwise the request is served and not recorded (``unattributable``)."""
        hint, user = session_hint(call.req.messages), call.req.user
        if hint is None and user is None:
            self._warn_no_session()
        # never into a session that may be bound to its client: only the server's own (auto-) ones; with
        # the OpenAI `user` field, only that user's
        binding = self.cfg.session_binding != "off"
        found = await self.tracker.lookup.remote(None, keys, None, binding, None, hint, user, last_reply)
        if found["session_id"] is not None:
            call.session_id = found["session_id"]
            self.counts["sessions_from_hint" if found["how"] == "hint" else "sessions_inferred"] += 1
        elif last_reply is None:  # a conversation's first request: a new session
            call.session_id = f"{user_session_prefix(user)}{uuid.uuid4().hex}"
            self.counts["sessions_started_without_id"] += 1
        else:
            self.counts["unattributable"] += 1

    def _warn_no_session(self) -> None:
        if not self._warned_no_session:
            self._warned_no_session = True
            logger.warning(
                "a client sends no X-Session-Id header (nor session_id / user in the body): its "
                "sessions are inferred by matching message prefixes; send X-Session-Id to be exact"
            )

    def _render(self, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as e:  # a template that cannot render this conversation is the client's input
            raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from None

    def _prompt_ids(self, req: ChatRequest, prev: dict | None) -> tuple[list[int], bool]:
        """Prompt token ids: the previous turn's exact prompt and reply ids (without the end-of-turn
        id it stopped on) spliced with the newly rendered suffix, which starts with the template's
        end tag, when the request continues it with the same tools; else a fresh render. CPU-bound:
        :meth:`_prepare` runs it in a worker thread for prompts over :data:`INLINE_PROMPT_CHARS`."""
        if prev is not None:
            try:
                suffix = splice_suffix(
                    lambda m, g: self._render(m, req.tools, g), req.messages, prev["n_messages"], self.stop_text
                )
                body = prev["response_ids"][:-1] if prev["ended"] else prev["response_ids"]
                self.counts["prompts_spliced"] += 1
                return [*prev["prompt_ids"], *body, *self.tokenizer.encode(suffix, add_special_tokens=False)], True
            except SpliceError as e:
                self.counts["splice_fallbacks"] += 1
                logger.debug("splice fell back to a fresh render: %s", e)
        text = self._render(req.messages, req.tools, True)
        return self.tokenizer.encode(text, add_special_tokens=False), False

    async def _record(self, call: Call, turns: list[Turn]) -> list[int | None]:
        """Record main-line turns with the tracker; returns their indexes (None when not recorded)."""
        req = call.req
        if req.turn_type == "side":
            self.counts["side_turns"] += len(turns)
            if req.side_kind:
                self.counts[f"side_turns/{req.side_kind}"] += len(turns)
            if req.done and call.session_id:
                await self.tracker.close_session.remote(call.session_id, req.outcome)
            elif req.outcome is not None and call.session_id:  # on any request: the last one given counts
                await self.tracker.set_outcome.remote(call.session_id, req.outcome)
            return [None] * len(turns)
        if call.session_id is None:
            return [None] * len(turns)
        self.counts["main_turns"] += len(turns)
        return await self.tracker.record_turns.remote(turns, req.done, req.outcome)

    # ------------------------------------------------------------------ plain answers
    async def _generate_all(self, call: Call, engine: Any, canary: bool = False) -> list[dict]:
        wait_s = self.cfg.sync_wait_timeout_s
        # return_exceptions: a choice that fails (or is cancelled at shutdown) is re-raised here, and
        # no gathered exception is left unretrieved; a client that hangs up (or the timeout) cancels
        # the engine calls (await_cancellable), which stops their generation
        outs = await asyncio.wait_for(
            asyncio.gather(
                *(
                    await_cancellable(engine.generate.remote(g, wait_s))
                    for g in call.generate_requests(self.max_model_len, canary)
                ),
                return_exceptions=True,
            ),
            timeout=self.cfg.generate_timeout_s,
        )
        for out in outs:
            if isinstance(out, BaseException):
                raise out
        return outs

    async def _complete(self, call: Call) -> JSONResponse:
        outs = await self.pool.run(call.session_id, call.req.n, lambda e, canary: self._generate_all(call, e, canary))
        texts = [self.reply_text.complete(call.body_ids(o["response_ids"])) for o in outs]
        parsed = [
            parse_reply_text(text, call.in_reasoning, tools=call.req.tools, untagged=self.cfg.untagged_tool_calls)
            for text in texts
        ]
        turns = [call.turn(o, p) for o, p in zip(outs, parsed)]
        indexes = await self._record(call, turns)
        completion = sum(len(o["response_ids"]) for o in outs)
        version = outs[0]["policy_version"]
        payload = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": call.req.model or self.cfg.model_name,
            "choices": [
                {"index": i, "message": p.message(), "finish_reason": t.finish_reason, "logprobs": None}
                for i, (p, t) in enumerate(zip(parsed, turns))
            ],
            "usage": {
                "prompt_tokens": len(call.prompt_ids),
                "completion_tokens": completion,
                "total_tokens": len(call.prompt_ids) + completion,
            },
            "session_id": call.session_id,
            "turn_index": indexes[0],
            "policy_version": version,
        }
        if call.req.n > 1:
            payload["turn_indexes"] = indexes
        return JSONResponse(payload, headers={"X-Policy-Version": str(version), **call.token_header()})

    # ------------------------------------------------------------------ streamed answers
    async def _stream(self, call: Call) -> StreamingResponse:
        """Start the engine streams (one per choice) and answer with SSE once the engine admitted
        them all (so a sync timeout is still a 503, not a broken stream; an engine that is down before
        admitting is replaced by the next live one, :meth:`~clawray.serve.engine_pool.EnginePool.run`)."""
        streams = await self.pool.run(
            call.session_id, call.req.n, lambda e, canary: self._admitted_streams(call, e, canary)
        )

        async def record(outs: list[dict], parsed: list[ParsedReply]) -> list[tuple[str, int | None]]:
            turns = [call.turn(o, p) for o, p in zip(outs, parsed)]
            return list(zip([t.finish_reason for t in turns], await self._record(call, turns)))

        ctx = StreamContext(
            model=self.cfg.model_name,
            timeout_s=self.cfg.generate_timeout_s,
            untagged=self.cfg.untagged_tool_calls,
            reply_text=self.reply_text,
            counts=self.counts,
            record=record,
            release=lambda: self.locks.release(call.locked) if call.locked else None,
        )
        return EventStreamResponse(call, streams, ctx, headers={"Cache-Control": "no-cache", **call.token_header()})

    async def _admitted_streams(self, call: Call, engine: Any, canary: bool = False) -> list:
        wait_s = self.cfg.sync_wait_timeout_s
        requests = call.generate_requests(self.max_model_len, canary)
        streams = [engine.generate_stream.remote(g, wait_s) for g in requests]
        # each stream's first item is {"admitted": True}
        try:
            await asyncio.wait_for(
                asyncio.gather(*(next_item(s) for s in streams)), timeout=self.cfg.generate_timeout_s
            )
        except BaseException:  # refused, timed out or the client hung up: stop every stream in the engine
            cancel_streams(streams)
            raise
        return streams

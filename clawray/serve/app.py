"""PolicyServer: the OpenAI-compatible chat endpoint, a Ray Serve deployment with a FastAPI ingress.

Routes: ``POST /v1/chat/completions`` (plain or SSE-streamed; ``tools`` in, ``tool_calls`` out,
``<think>`` out as ``reasoning_content``; ``n`` choices), ``GET /v1/models``, ``GET /health``. Each
request becomes prompt token ids -- the tokenizer's own chat template, with the previous turn's exact
tokens spliced in (:mod:`clawray.serve.splice`) -- and goes to a RolloutEngine; every main-line turn is
recorded with the exact prompt and response token ids and the engine's log-probs (the response text
is never re-tokenised).

End of turn: every id of :func:`clawray.chat.end_of_turn_ids` (tokenizer eos, the generation
config's eos list, the request's ``stop_token_ids``) is the engine's stop list; a reply whose last id
is one of them has ``finish_reason`` ``"stop"`` (``"tool_calls"`` when it holds a call), that id is
kept in the recorded ``response_ids`` but never shown to the client (plain or streamed), and the next
prompt continues it with the template's end tag (:mod:`clawray.serve.splice`). Any other reply was
cut (``"length"``, ``truncated``).

Session protocol (as OpenClaw-RL's proxy): ``X-Session-Id`` header, body ``session_id``, or the OpenAI
``user`` field; without any, the client's own id written in the conversation (OpenClaw's
``sessionId=``, :mod:`clawray.client_rules`), else the session is inferred from the message prefix (see
:meth:`clawray.actors.session.SessionTracker.lookup`). ``X-Turn-Type: side`` (or body ``turn_type``)
marks a turn that is served but never trained (default ``main``, and ``side`` for a client's own
housekeeping: OpenClaw's memory flush and compaction summaries); ``X-Session-Done: true`` (or body
``session_done``) closes the session; ``X-Session-Outcome: <number>`` (or body ``session_outcome``) gives
its outcome score for long-horizon credit (``trainer.credit``). A session's requests run one at a time, in arrival order.

Every client error is an HTTP 4xx with an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``; nothing is recorded for a rejected request. A request
the engine refuses (:class:`~clawray.actors.rollout.EngineRefusedError`: it does not fit the engine) is a
400 ``request_refused`` with the engine's reason; on a stream whose headers were already sent, that error
comes in-band.

Hostile clients (README, "Reliability and security"): header bytes and sizes are refused in Serve's proxy
(:mod:`clawray.serve.guard`). Here, in this order: a browser ``Origin`` outside ``allowed_origins`` or,
when bound to loopback, a ``Host`` that is not a loopback name or the bound host (DNS rebinding) gets
403; a missing or wrong API key 401; a body that is not ``application/json`` 415; a body not complete
within ``body_timeout_s`` 408, so a slow client holds no session lock: the lock of a session is taken
only after its body has arrived. Session binding (``session_binding``): a session's first request gets a
fresh ``X-Session-Token``; a later request with another token, or (``strict``, or ``echo`` once the token
came back) without one, gets 403.

Engine choice (:func:`clawray.serve.routing.choose_engine`): a session sticks to its engine (prefix-cache
locality) unless that engine is down, paused while others serve, or carries more than ``engine_slack``
requests more than the least loaded engine; a new session takes the least loaded engine. Each replica
polls the engines' states and queue depths every ``engine_poll_s`` seconds.

Engine failures (:mod:`clawray.recovery`): an engine that is dead, restarting or restarted but not yet
re-synced (:class:`~clawray.actors.rollout.EngineRestartedError`) is marked down and the request goes to
the next engine the chooser picks; a watcher clears the mark once the engine serves again. Only when no
engine is up does a request get 503 with ``Retry-After``; error bodies never carry actor ids, pids or Ray
namespaces.

Replicas (``serve.num_replicas``): every request of a session reaches the same replica
(:mod:`clawray.serve.routing`), so the session lock, its binding token and its engine are one replica's
state. Everything else a replica holds is either read from the shared actors (tracker, engines) or set on
every replica by :meth:`PolicyServer.set_actors` through ``DeploymentHandle.broadcast``;
:meth:`PolicyServer.stats` reports one replica's counters (the driver broadcasts it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
import uuid
from collections import Counter, OrderedDict
from typing import Any, AsyncIterator, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
import ray
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from clawray.actors.rollout import (
    EngineError,
    EnginePausedError,
    EngineRefusedError,
    EngineRestartedError,
    await_cancellable,
)
from clawray.chat import RequestError, attribution_keys, conversation_keys, end_of_turn_ids, render_key
from clawray.client_rules import session_hint
from clawray.config import ServeConfig, section
from clawray.engines.base import GenerateRequest
from clawray.ray_env import actor_death_errors
from clawray.serve.guard import keep_replica_grpc_on_loopback
from clawray.serve.protocol import ChatRequest, decode_body, parse_chat_request
from clawray.serve.routing import DOWN, UP, choose_engine, engine_state
from clawray.serve.reply import (
    THINK_OPEN,
    IncrementalDetokenizer,
    ParsedReply,
    ReplyDecoder,
    ReplyParser,
    parse_reply_text,
)
from clawray.serve.splice import SpliceError, splice_suffix
from clawray.sessions import AUTO_SESSION_PREFIX
from clawray.step_metrics import traffic
from clawray.types import Turn

keep_replica_grpc_on_loopback()  # in the replica process, before it starts its gRPC server (see guard.py)
app = FastAPI(title="clawray policy server", docs_url=None, redoc_url=None, openapi_url=None)
logger = logging.getLogger("ray.serve")
MAX_CHARS_PER_TOKEN = 128  # no tokenizer token is longer: a prompt with more characters cannot fit
# the HTTP status of each RequestError code that is not a plain 400
ERROR_STATUS = {
    "body_too_large": 413,
    "body_timeout": 408,
    "unsupported_media_type": 415,
    "forbidden_origin": 403,
    "forbidden_host": 403,
    "session_token": 403,
}
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
# prompts of at most this many characters (message contents + tool calls) are rendered and tokenised
# on the event loop (tens of microseconds); longer ones in a worker thread
INLINE_PROMPT_CHARS = 4096
MAX_BOUND_SESSIONS = 100_000  # session tokens kept; the oldest binding is forgotten beyond this


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str = "invalid_request",
    err_type: str = "invalid_request_error",
    headers: dict | None = None,
) -> JSONResponse:
    """An OpenAI-style error body (:func:`error_body`) with ``status``."""
    return JSONResponse(status_code=status, headers=headers, content=error_body(message, param, code, err_type))


def error_body(
    message: str, param: str | None = None, code: str = "invalid_request", err_type: str = "invalid_request_error"
) -> dict:
    """The OpenAI error object ``{"error": {"message", "type", "param", "code"}}`` (an HTTP error's body,
    or a stream's in-band error event)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and wrong methods answer in the OpenAI error shape too."""
    return error_response(
        exc.status_code,
        f"{request.method} {request.url.path}: {exc.detail}",
        None,
        "not_found" if exc.status_code == 404 else "invalid_request",
    )


async def _next(stream: Any) -> dict:
    """The next item of a Ray streaming generator (``StopAsyncIteration`` at its end)."""
    return await (await stream.__anext__())


def _refusal(error: EngineRefusedError) -> str:
    """The refusal's own message (``"the engine refused this request: <reason>"``), without the remote
    traceback a Ray task error adds to ``str()``."""
    cause = error.cause if isinstance(error, ray.exceptions.RayTaskError) else error
    return str(cause.args[0]) if cause.args else str(cause)


def _mixed_versions(out: dict) -> list[int] | None:
    """An engine reply's per-token policy versions when more than one version sampled it (a partial
    rollout), else None (every token is from ``out["policy_version"]``)."""
    versions = out.get("token_versions") or []
    return list(versions) if len(set(versions)) > 1 else None


def _cancel_streams(streams: list) -> None:
    """Cancel engine streams (``ray.cancel``; a finished one is left alone): their generation stops."""
    for stream in streams:
        try:
            ray.cancel(stream)
        except Exception:  # already finished or its actor is gone: nothing left to stop
            pass


class _SessionLocks:
    """One FIFO lock per session id, so a session's requests run in arrival order; an entry lives
    only while a request of its session holds or awaits it."""

    def __init__(self):
        self._locks: dict[str, list] = {}  # session id -> [asyncio.Lock, holders + waiters]

    async def acquire(self, session_id: str) -> None:
        entry = self._locks.setdefault(session_id, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            await entry[0].acquire()
        except BaseException:  # cancelled while waiting (the client left): not a holder
            entry[1] -= 1
            if entry[1] == 0:
                del self._locks[session_id]
            raise

    def release(self, session_id: str) -> None:
        entry = self._locks[session_id]
        entry[0].release()
        entry[1] -= 1
        if entry[1] == 0:
            del self._locks[session_id]

    def __len__(self) -> int:
        return len(self._locks)


class _Call:
    """One request on its way through the server: the parsed request, its session and prompt."""

    def __init__(self, req: ChatRequest, locked: str | None):
        self.req = req
        self.session_id = req.session_id
        self.locked = locked  # the session whose lock this request holds
        self.prompt_ids: list[int] = []
        self.spliced = False
        self.in_reasoning = False
        self.end_ids: list[int] = []  # the ids that end this request's replies (end_of_turn_ids)
        self.new_token: str | None = None  # the session's token, on its first request only


class _NoEngineUp(RuntimeError):
    """Every rollout engine is down, restarting or awaiting its re-sync."""


# an engine call failing with one of these means the engine (not the request) is unavailable: it died
# (also when Ray's memory monitor killed it: OutOfMemoryError) or was restarted and awaits its re-sync
_ENGINE_DOWN = (*actor_death_errors(), EngineRestartedError)


@serve.deployment(max_ongoing_requests=256)
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
        self.max_model_len, self.engine_poll_s = max_model_len, engine_poll_s
        self.stop_text = self.tokenizer.eos_token  # the end tag the chat template renders after a reply
        self.end_ids = end_of_turn_ids(model_path, self.tokenizer)
        self.locks = _SessionLocks()
        self.bindings: OrderedDict[str, list] = OrderedDict()  # session id -> [token, token came back]
        self.counts: Counter[str] = Counter()
        self._warned_no_session = False
        self.actors: dict = dict(actors or {})
        self._down: dict[int, asyncio.Task] = {}  # engine index -> watcher that clears the mark
        n = len(engines)
        self._states = [UP] * n  # per engine, from the last poll (routing.engine_state)
        self._loads = [0] * n  # per engine, its queue depth at the last poll (all replicas' requests)
        self._sent = [0] * n  # per engine, generations this replica started since the last poll
        self._homes: OrderedDict[str, int] = OrderedDict()  # session id -> its engine (LRU)
        self._poller: asyncio.Task | None = None

    def set_actors(self, kind: str, handles: Any) -> None:
        """Replace the handles ``/health`` reports for ``kind`` (``"learners"`` after a rebuild); the
        driver calls it on every replica (``DeploymentHandle.broadcast``)."""
        self.actors[kind] = handles

    async def stats(self, session_ids: bool = False) -> dict:
        """This replica's counters: ``replica`` (Serve's replica id), ``requests`` (chat requests
        received), ``sessions`` (sessions it chose an engine for, at most :data:`MAX_BOUND_SESSIONS`
        kept), ``engine_choices`` (per engine, sessions whose engine it is now), ``counts`` (every
        counter of ``/health``) and, with ``session_ids``, the ids of those sessions (sorted). Async: it
        runs on the replica's event loop, where the session map changes, never in a thread."""
        try:
            replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a Serve replica (unit tests)
            replica = "local"
        body = {
            "replica": replica,
            "requests": self.counts["requests"],
            "sessions": len(self._homes),
            "engine_choices": [sum(1 for e in self._homes.values() if e == i) for i in range(len(self.engines))],
            "counts": dict(self.counts),
        }
        if session_ids:
            body["session_ids"] = sorted(self._homes)
        return body

    @app.get("/v1/models")
    async def models(self, request: Request) -> Any:
        """``GET /v1/models``: the one served policy with its ``max_model_len`` (tokens of prompt +
        reply, as vLLM reports it; agents such as OpenClaw budget their prompts on it). 401 without
        the API key, as OpenAI; 403 for a foreign browser origin or Host."""
        try:
            self._check_origin(request)
        except RequestError as e:
            return error_response(403, str(e), None, e.code, "permission_error")
        if not self._authorized(request):
            return error_response(
                401,
                "missing or invalid API key (Authorization: Bearer ...)",
                None,
                "invalid_api_key",
                "authentication_error",
            )
        return {
            "object": "list",
            "data": [
                {
                    "id": self.cfg.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "clawray",
                    "max_model_len": self.max_model_len,
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
        reason (:meth:`_traffic`). Actor states (:func:`clawray.recovery.actor_state`): ``ok``,
        ``restarting``, ``starting``, ``dead``; a live judge or teacher whose model lags is ``slow``,
        one whose calls fail is ``failing``, each with a ``reason``
        (:class:`clawray.actors.call_health.CallHealth`). 200 with ``"status": "ok"``; 503 with ``"status":
        "degraded"`` (and ``Retry-After``) while any of them is not serving/ok, or while the disk
        refuses the tracker's writes (``failing``: which files, and why)."""
        from clawray.recovery import actor_state, probe  # [recovery hook] a dead actor is a state, never a 500

        stats = await asyncio.gather(*(probe(e.stats.remote()) for e in self.engines))
        paused = await asyncio.gather(*(probe(e.is_paused.remote()) for e in self.engines))
        engines = []
        for i, (st, p) in enumerate(zip(stats, paused)):
            if st is None or p is None:
                engines.append({"name": f"rollout-{i}", "policy_version": None, "state": "down"})
            else:
                state = "awaiting_sync" if st.get("awaiting_sync") else "syncing" if p else "serving"
                engines.append(
                    {
                        "name": st["name"],
                        "policy_version": st["version"],
                        "state": state,
                        "requests": st["requests"],
                        "cancelled": st.get("cancelled", 0),
                        "errors": st.get("errors", 0),
                    }
                )
        tracker = await probe(self.tracker.stats.remote())
        kinds = {}
        for kind, prefix in (("judges", "judge"), ("teachers", "teacher"), ("learners", "learner rank")):
            kinds[kind] = [
                {"name": f"{prefix}-{i}" if kind != "learners" else f"{prefix} {i}", "state": actor_state(a)}
                for i, a in enumerate(self.actors.get(kind) or [])
            ]
        # a live judge or teacher whose model lags or fails is "slow"/"failing", with the reason
        live = [
            (entry, actor)
            for kind in ("judges", "teachers")
            for entry, actor in zip(kinds[kind], self.actors.get(kind) or [])
            if entry["state"] == "ok"
        ]
        for (entry, _), report in zip(live, await asyncio.gather(*(probe(a.health.remote()) for _, a in live))):
            if report and report.get("state", "ok") != "ok":
                entry.update(state=report["state"], reason=report["reason"])
        queue = actor_state(self.actors["queue"]) if self.actors.get("queue") is not None else None
        failing = list((tracker or {}).get("storage_failing") or [])  # e.g. "turns.jsonl: No space left on device"
        degraded = (
            tracker is None
            or bool(failing)
            or queue not in (None, "ok")
            or any(e["state"] in ("down", "awaiting_sync") for e in engines)
            or any(a["state"] != "ok" for v in kinds.values() for a in v)
        )
        body = {
            "status": "degraded" if degraded else "ok",
            "policy_versions": [e["policy_version"] for e in engines],
            "engines": engines,
            "tracker": "down" if tracker is None else "ok",
            **kinds,
            "open_sessions": (tracker or {}).get("open_sessions", 0),
            "traffic": self._traffic(tracker or {}),
            "counts": dict(self.counts),
        }
        if failing:
            body["failing"] = failing
        if queue is not None:
            body["queue"] = queue
        if degraded:
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(self.cfg.retry_after_s)})
        return body

    def _traffic(self, tracker: dict) -> dict:
        """``/health``'s ``traffic``: where this replica's requests went and what became of the turns
        (:func:`clawray.step_metrics.traffic`, without the prefix) and ``dropped``: turns not trained so
        far, by reason (the tracker's ``dropped/*``; the queue's ``stale`` are in the step line)."""
        funnel = {k.removeprefix("traffic/"): v for k, v in traffic(self.counts, tracker).items()}
        funnel["dropped"] = {
            k.removeprefix("dropped/"): v for k, v in tracker.items() if k.startswith("dropped/") and v
        }
        return funnel

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``, plain or streamed (SSE). 403 for a foreign browser origin, Host
        or session token, 401 without the configured API key, 415 for a body that is not JSON, 408 for a
        body that outlasts ``body_timeout_s``, 400/413 for client errors (400 ``request_refused`` when the engine refuses the request), 503 (with ``Retry-After``) while a weight sync outlasts
        ``sync_wait_timeout_s`` or when the engine does not answer within ``generate_timeout_s``,
        500 only for a server-side fault. Ray Serve's proxy echoes the client's ``X-Request-Id``."""
        self.counts["requests"] += 1
        try:
            self._check_origin(request)
        except RequestError as e:
            self.counts["forbidden"] += 1
            return error_response(403, str(e), None, e.code, "permission_error")
        if not self._authorized(request):
            self.counts["unauthorized"] += 1
            return error_response(
                401,
                "missing or invalid API key (Authorization: Bearer ...)",
                None,
                "invalid_api_key",
                "authentication_error",
            )
        locked: str | None = None  # the session whose lock this request holds
        call: _Call | None = None
        streaming = answered = False
        token: str | None = None
        try:
            self._check_content_type(request)
            raw = await self._read_body(request)  # the whole body, under a deadline, before any lock
            req = parse_chat_request(
                decode_body(raw),
                request.headers,
                self.cfg.default_max_tokens,
                self.cfg.default_temperature,
                self.cfg.max_n,
            )
            token = self._bind_session(req.session_id, request.headers.get("x-session-token"))
            if req.session_id:  # then a session's requests queue in the order their bodies arrived
                await self.locks.acquire(req.session_id)
                locked = req.session_id
            call = _Call(req, locked)
            call.new_token = token
            await self._prepare(call)
            if req.stream:
                response = await self._stream(call)
                streaming = answered = True  # the stream releases the lock when it ends
                return response
            response = await self._complete(call)
            answered = True
            return response
        except RequestError as e:
            self.counts["rejected"] += 1
            status = ERROR_STATUS.get(e.code, 400)
            return error_response(
                status,
                str(e),
                e.param,
                e.code,
                "permission_error" if status == 403 else "invalid_request_error",
                headers={"Connection": "close"} if status == 408 else None,
            )
        except EnginePausedError:
            self.counts["sync_wait_timeouts"] += 1
            return error_response(
                503,
                "the policy is being updated; retry shortly",
                None,
                "engine_syncing",
                "server_error",
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            )
        except asyncio.TimeoutError:
            self.counts["engine_timeouts"] += 1
            return error_response(
                503,
                "the policy engine did not answer in time",
                None,
                "engine_timeout",
                "server_error",
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            )
        except (asyncio.CancelledError, ray.exceptions.TaskCancelledError):
            # the client hung up: Serve cancels this handler and (recursively) its engine calls
            self.counts["cancelled"] += 1
            logger.info("chat completion cancelled: the client disconnected")
            raise asyncio.CancelledError() from None
        except (_NoEngineUp, ray.exceptions.RayActorError):  # [recovery hook] no engine up, or the tracker down
            self.counts["actor_unavailable"] += 1
            logger.warning("chat completion refused: no engine is up, or the session tracker is restarting")
            return error_response(
                503,
                "the service is recovering from a failure; retry shortly",
                None,
                "service_unavailable",
                "server_error",
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            )
        except EngineRefusedError as e:  # the request does not fit the engine: the client's error
            self.counts["rejected"] += 1
            return error_response(400, _refusal(e), None, "request_refused", "invalid_request_error")
        except EngineError as e:  # the engine failed on this request alone; it goes on serving
            self.counts["engine_errors"] += 1
            logger.warning("chat completion failed in the engine: %s", e)
            return error_response(500, "the policy engine failed on this request", None, "engine_error", "server_error")
        except Exception:  # a server-side fault: logged, reported in OpenAI form without internals
            self.counts["internal_errors"] += 1
            logger.exception("chat completion failed")
            return error_response(500, "internal server error", None, "internal_error", "server_error")
        finally:
            locked = call.locked if call is not None else locked
            if locked and not streaming:
                self.locks.release(locked)
            if token and not answered:  # the client never got the token: the session stays unbound
                self.bindings.pop(req.session_id, None)

    # ------------------------------------------------------------------ request plumbing
    def _authorized(self, request: Request) -> bool:
        key = self.cfg.api_key
        if not key:
            return True
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        return hmac.compare_digest(token.encode(), key.encode())  # constant time

    def _check_origin(self, request: Request) -> None:
        """Refuse what a web page in the user's browser could send: an ``Origin`` header not in
        ``allowed_origins`` (browsers send it on every cross-origin and every POST request; other
        clients do not), and, when the server is bound to loopback, a ``Host`` that is neither a
        loopback name nor the bound host (a DNS-rebinding page reaches 127.0.0.1 under its own name).

        Raises:
            RequestError: code ``forbidden_origin`` or ``forbidden_host`` (HTTP 403).
        """
        origin = request.headers.get("origin")
        allowed = self.cfg.allowed_origins
        if origin is not None and "*" not in allowed and origin.rstrip("/") not in [o.rstrip("/") for o in allowed]:
            raise RequestError(
                f"browser origin {origin[:200]!r} is not allowed (serve.allowed_origins)", None, "forbidden_origin"
            )
        bound = self.cfg.host
        if bound in LOOPBACK_HOSTS:
            host = request.headers.get("host", "")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host  # drop the port
            if name.lower() not in LOOPBACK_HOSTS | {bound}:
                raise RequestError(
                    f"Host {host[:200]!r} is not a loopback name (the server is bound to {bound})",
                    None,
                    "forbidden_host",
                )

    @staticmethod
    def _check_content_type(request: Request) -> None:
        """Raises RequestError ``unsupported_media_type`` (HTTP 415) unless the body is declared
        ``application/json`` (parameters such as ``charset=utf-8`` allowed)."""
        declared = request.headers.get("content-type", "")
        if declared.split(";", 1)[0].strip().lower() != "application/json":
            raise RequestError(
                f"Content-Type must be application/json, not {declared[:100]!r}", None, "unsupported_media_type"
            )

    def _bind_session(self, session_id: str | None, given: str | None) -> str | None:
        """Session binding: the first request of an explicit session id gets a fresh token (returned,
        to be sent back as ``X-Session-Token``); a later request must carry it when ``session_binding``
        is ``strict``, or under ``echo`` once the token has come back once. A wrong token is always
        refused. A session this replica has no binding for (new, or bound before a restart or a
        resume) that arrives with a token is bound to that token: a client keeps its token across a
        resume, and the session still belongs to its first client. At most
        :data:`MAX_BOUND_SESSIONS` bindings are kept (oldest forgotten first). Ids
        that start with :data:`~clawray.sessions.AUTO_SESSION_PREFIX` (the server's own sessions, which
        inference may continue) are never bound; inference never continues any other session while
        binding is on.

        Returns: the new token for a session's first request, else None.

        Raises:
            RequestError: code ``session_token`` (HTTP 403).
        """
        mode = self.cfg.session_binding
        if mode == "off" or not session_id or session_id.startswith(AUTO_SESSION_PREFIX):
            return None  # the server's own sessions (inference may continue them) are never bound
        entry = self.bindings.get(session_id)
        if entry is None and given:  # a token from before a restart (a resume): the first one back keeps it
            self.bindings[session_id] = [given, True]
            if len(self.bindings) > MAX_BOUND_SESSIONS:
                self.bindings.popitem(last=False)
            return None
        if entry is None:
            token = secrets.token_urlsafe(24)
            self.bindings[session_id] = [token, False]
            if len(self.bindings) > MAX_BOUND_SESSIONS:
                self.bindings.popitem(last=False)
            return token
        if given is not None:
            if not hmac.compare_digest(given.encode(), entry[0].encode()):
                raise RequestError("X-Session-Token does not match this session's token", None, "session_token")
            entry[1] = True
            return None
        if mode == "strict" or entry[1]:
            raise RequestError(
                "this session is bound to another client: send its X-Session-Token", None, "session_token"
            )
        return None

    async def _read_body(self, request: Request) -> bytes:
        """The whole request body within ``body_timeout_s`` seconds.

        Raises:
            RequestError: ``body_too_large`` (413) over ``max_body_bytes``; ``body_timeout`` (408) late.
        """
        try:
            return await asyncio.wait_for(self._read_body_unbounded(request), timeout=self.cfg.body_timeout_s)
        except asyncio.TimeoutError:
            self.counts["body_timeouts"] += 1
            raise RequestError(
                f"the request body did not arrive within {self.cfg.body_timeout_s} s", None, "body_timeout"
            ) from None

    async def _read_body_unbounded(self, request: Request) -> bytes:
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(f"request body is {declared} bytes; the limit is {limit}", None, "body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(f"request body exceeds the limit of {limit} bytes", None, "body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _prepare(self, call: _Call) -> None:
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
        chars = sum(len(m.get("content") or "") + len(json.dumps(m.get("tool_calls") or "")) for m in req.messages)
        if chars > limit * MAX_CHARS_PER_TOKEN:
            raise RequestError(
                f"prompt is {chars} characters, more than max_model_len {limit} tokens can hold",
                "messages",
                "context_length_exceeded",
            )
        prev = None
        if req.turn_type == "main":
            attribution, exact_keys = attribution_keys(req.messages), conversation_keys(req.messages)
            assistant = [k for k, m in enumerate(req.messages) if m["role"] == "assistant"]
            keys = {k: attribution[k] for k in assistant}
            if call.session_id is None:
                await self._infer_session(call, keys)
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

    async def _infer_session(self, call: _Call, keys: dict[int, str]) -> None:
        """The session of a main-line request that names none: the client's own id written in the
        conversation (:func:`clawray.client_rules.session_hint`, OpenClaw's ``sessionId=``), else the
        open session whose pending turn its history continues (``keys``: attribution keys of its
        assistant messages), else a new session for a conversation's first request; otherwise the
        request is served and not recorded (``unattributable``)."""
        hint = session_hint(call.req.messages)
        if hint is None:
            self._warn_no_session()
        # never into a session that may be bound to its client: only the server's own (auto-) ones
        found = await self.tracker.lookup.remote(None, keys, None, self.cfg.session_binding != "off", None, hint)
        if found["session_id"] is not None:
            call.session_id = found["session_id"]
            self.counts["sessions_from_hint" if found["how"] == "hint" else "sessions_inferred"] += 1
        elif not keys:  # a conversation's first request: a new session
            call.session_id = f"{AUTO_SESSION_PREFIX}{uuid.uuid4().hex}"
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

    @staticmethod
    def _token_header(call: _Call) -> dict:
        return {"X-Session-Token": call.new_token} if call.new_token else {}

    def _engine(self, call: _Call) -> Any:
        """The request's engine (:func:`~clawray.serve.routing.choose_engine`): the polled states with
        the engines marked down here (see :meth:`_mark_down`) as down, the polled queue depths plus
        the generations this replica started since the poll; remembered as the session's engine.

        Raises:
            _NoEngineUp: every engine is down.
        """
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll_engines())
        n, key = len(self.engines), call.session_id
        # [recovery hook] route around an engine that is down (its session moves to another one)
        states = [DOWN if i in self._down else self._states[i] for i in range(n)]
        loads = [self._loads[i] + self._sent[i] for i in range(n)]
        try:
            index = choose_engine(key, states, loads, self._homes.get(key) if key else None, self.cfg.engine_slack)
        except ValueError:
            raise _NoEngineUp("no rollout engine is up") from None
        if key:
            self._homes[key] = index
            self._homes.move_to_end(key)
            if len(self._homes) > MAX_BOUND_SESSIONS:
                self._homes.popitem(last=False)
        self._sent[index] += call.req.n
        call.engine_index = index
        return self.engines[index]

    async def _poll_engines(self) -> None:
        """Every ``engine_poll_s`` seconds: each engine's state and queue depth from its ``stats()``. A
        dead or restarting engine (a Ray actor error) is down; one that does not answer within 5 s (a
        busy host) keeps its previous state and load."""

        async def poll(i: int) -> None:
            try:
                st = await asyncio.wait_for(self.engines[i].stats.remote(), 5.0)
            except asyncio.TimeoutError:
                return
            except ray.exceptions.RayError:
                st = None
            self._states[i], self._loads[i] = engine_state(st), (st or {}).get("in_flight", 0)

        while True:
            before = list(self._sent)  # generations started while the poll runs stay counted
            await asyncio.gather(*(poll(i) for i in range(len(self.engines))))
            self._sent = [now - then for now, then in zip(self._sent, before)]
            await asyncio.sleep(self.engine_poll_s)

    def _mark_down(self, index: int) -> None:
        """[recovery hook] Skip engine ``index`` until it serves again: a watcher polls its stats
        every ``retry_after_s`` / 2 seconds and clears the mark once it answers without
        ``awaiting_sync`` (Ray restarted it and the driver re-synced the current policy)."""
        if index not in self._down:
            logger.warning("rollout-%d is down or awaiting its re-sync: routing its sessions to the next engine", index)
            self._down[index] = asyncio.ensure_future(self._watch(index))

    async def _watch(self, index: int) -> None:
        from clawray.recovery import probe

        try:
            while True:
                await asyncio.sleep(max(0.2, self.cfg.retry_after_s / 2))
                st = await probe(self.engines[index].stats.remote(), 5.0)
                if st is not None and not st.get("awaiting_sync"):
                    return
        finally:
            self._down.pop(index, None)

    async def _on_engine(self, call: _Call, attempt: Any) -> Any:
        """Run ``attempt(engine)`` on the session's engine; when that engine is down (dead,
        restarting or awaiting its re-sync) mark it and try the next live one.

        Raises:
            _NoEngineUp: no engine is up (the caller answers 503 with ``Retry-After``).
        """
        for _ in range(len(self.engines)):
            engine = self._engine(call)
            try:
                return await attempt(engine)
            except _ENGINE_DOWN:
                self.counts["engine_failovers"] += 1
                self._mark_down(call.engine_index)
        raise _NoEngineUp("no rollout engine is up")

    def _generate_requests(self, call: _Call) -> list[GenerateRequest]:
        req = call.req
        max_tokens = min(req.max_tokens, self.max_model_len - len(call.prompt_ids))
        return [
            GenerateRequest(
                prompt_ids=call.prompt_ids,
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                stop_token_ids=call.end_ids,
                seed=None if req.seed is None else req.seed + i,
            )
            for i in range(req.n)
        ]

    @staticmethod
    def _ended(call: _Call, response_ids: list[int]) -> bool:
        """The reply ends with an end-of-turn id (the engine stopped on it), not cut at a length."""
        return bool(response_ids) and response_ids[-1] in call.end_ids

    def _body_ids(self, call: _Call, response_ids: list[int]) -> list[int]:
        """The reply's ids the client sees: without the end-of-turn id that ended it."""
        return response_ids[:-1] if self._ended(call, response_ids) else response_ids

    def _turn(self, call: _Call, out: dict, parsed: ParsedReply) -> Turn:
        req = call.req
        ended = self._ended(call, out["response_ids"])
        finish = "tool_calls" if parsed.tool_calls else "stop" if ended else "length"
        return Turn(
            session_id=call.session_id,
            turn_index=0,
            messages=req.messages,
            response_message=parsed.message(),
            prompt_ids=call.prompt_ids,
            response_ids=out["response_ids"],
            rollout_logprobs=out["logprobs"],
            policy_version=out["policy_version"],
            finish_reason=finish,
            temperature=req.temperature,
            tools=req.tools,
            truncated=not ended,
            tool_parse_error=parsed.tool_parse_error,
            spliced=call.spliced,
            token_versions=_mixed_versions(out),
        )

    async def _record(self, call: _Call, turns: list[Turn]) -> list[int | None]:
        """Record main-line turns with the tracker; returns their indexes (None when not recorded)."""
        req = call.req
        if req.turn_type == "side":
            self.counts["side_turns"] += len(turns)
            if req.side_kind:
                self.counts[f"side_turns/{req.side_kind}"] += len(turns)
            if req.done and call.session_id:
                await self.tracker.close_session.remote(call.session_id, req.outcome)
            return [None] * len(turns)
        if call.session_id is None:
            return [None] * len(turns)
        self.counts["main_turns"] += len(turns)
        return await self.tracker.record_turns.remote(turns, req.done, req.outcome)

    # ------------------------------------------------------------------ plain answers
    async def _generate_all(self, call: _Call, engine: Any) -> list[dict]:
        wait_s = self.cfg.sync_wait_timeout_s
        # return_exceptions: a choice that fails (or is cancelled at shutdown) is re-raised here, and
        # no gathered exception is left unretrieved; a client that hangs up (or the timeout) cancels
        # the engine calls (await_cancellable), which stops their generation
        outs = await asyncio.wait_for(
            asyncio.gather(
                *(await_cancellable(engine.generate.remote(g, wait_s)) for g in self._generate_requests(call)),
                return_exceptions=True,
            ),
            timeout=self.cfg.generate_timeout_s,
        )
        for out in outs:
            if isinstance(out, BaseException):
                raise out
        return outs

    async def _complete(self, call: _Call) -> JSONResponse:
        outs = await self._on_engine(call, lambda engine: self._generate_all(call, engine))
        texts = [self.reply_text.complete(self._body_ids(call, o["response_ids"])) for o in outs]
        parsed = [
            parse_reply_text(text, call.in_reasoning, tools=call.req.tools, untagged=self.cfg.untagged_tool_calls)
            for text in texts
        ]
        turns = [self._turn(call, o, p) for o, p in zip(outs, parsed)]
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
        return JSONResponse(payload, headers={"X-Policy-Version": str(version), **self._token_header(call)})

    # ------------------------------------------------------------------ streamed answers
    async def _stream(self, call: _Call) -> StreamingResponse:
        """Start the engine streams (one per choice) and answer with SSE once the engine admitted
        them all (so a sync timeout is still a 503, not a broken stream; an engine that is down before
        admitting is replaced by the next live one, see :meth:`_on_engine`)."""
        streams = await self._on_engine(call, lambda engine: self._admitted_streams(call, engine))
        return StreamingResponse(
            self._sse(call, streams),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **self._token_header(call)},
        )

    async def _admitted_streams(self, call: _Call, engine: Any) -> list:
        wait_s = self.cfg.sync_wait_timeout_s
        streams = [engine.generate_stream.remote(g, wait_s) for g in self._generate_requests(call)]
        # each stream's first item is {"admitted": True}
        try:
            await asyncio.wait_for(asyncio.gather(*(_next(s) for s in streams)), timeout=self.cfg.generate_timeout_s)
        except BaseException:  # refused, timed out or the client hung up: stop every stream in the engine
            _cancel_streams(streams)
            raise
        return streams

    async def _sse(self, call: _Call, streams: list) -> AsyncIterator[str]:
        """The event stream: per choice a role delta, reasoning/content/tool-call deltas as its tokens
        arrive (text on UTF-8 character boundaries; choices interleave, each chunk names its
        ``index``), then every choice's finish chunk, the usage chunk when asked, ``[DONE]``. The
        turns are recorded before the finish chunks, so the client's next request finds them."""
        req, n = call.req, len(streams)
        base = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req.model or self.cfg.model_name,
        }
        usage_field = {"usage": None} if req.include_usage else {}
        timeout = self.cfg.generate_timeout_s

        def chunk(i: int, delta: dict, finish: str | None = None, **extra: Any) -> str:
            body = {
                **base,
                "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}],
                **usage_field,
                **extra,
            }
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def deltas(i: int, events: list) -> Iterator[str]:
            for kind, value in events:
                if kind == "tool_call":
                    yield chunk(i, {"tool_calls": [value]})
                else:
                    yield chunk(i, {"reasoning_content" if kind == "reasoning" else "content": value})

        detoks = [IncrementalDetokenizer(self.reply_text) for _ in range(n)]
        parsers = [
            ReplyParser(call.in_reasoning, tools=req.tools, untagged=self.cfg.untagged_tool_calls) for _ in range(n)
        ]
        outs: list[dict | None] = [None] * n
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: Any) -> None:  # one engine stream into the merged queue
            try:
                while True:
                    item = await asyncio.wait_for(_next(stream), timeout=timeout)
                    merged.put_nowait((i, item, None))
                    if item.get("done"):
                        return
            except Exception as e:
                merged.put_nowait((i, None, e))

        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        completed = False
        try:
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
                for text in deltas(i, events):
                    yield text
            turns = [self._turn(call, outs[i], parsers[i].result) for i in range(n)]
            indexes = await self._record(call, turns)  # before [DONE]: the client's next request sees them
            for i, (turn, index) in enumerate(zip(turns, indexes)):
                yield chunk(
                    i,
                    {},
                    turn.finish_reason,
                    session_id=call.session_id,
                    turn_index=index,
                    policy_version=outs[i]["policy_version"],
                )
            if req.include_usage:
                n_prompt, n_completion = len(call.prompt_ids), sum(len(o["response_ids"]) for o in outs)
                usage = {
                    "prompt_tokens": n_prompt,
                    "completion_tokens": n_completion,
                    "total_tokens": n_prompt + n_completion,
                }
                yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            completed = True
            self.counts["streams"] += 1
        except (asyncio.CancelledError, GeneratorExit, ray.exceptions.TaskCancelledError) as e:
            # the client hung up: nothing is recorded, the engine streams are stopped (finally)
            self.counts["cancelled"] += 1
            logger.info("stream cancelled: the client disconnected")
            if isinstance(e, ray.exceptions.TaskCancelledError):
                raise asyncio.CancelledError() from None
            raise
        except Exception as e:  # headers are sent: report in-band (no internals), never a broken connection
            if isinstance(e, EngineRefusedError):  # the request does not fit the engine: the client's error
                self.counts["rejected"] += 1
                err = error_body(_refusal(e), None, "request_refused", "invalid_request_error")
            elif isinstance(e, EngineError):
                self.counts["engine_errors"] += 1
                logger.warning("stream failed in the engine: %s", e)
                err = error_body("the policy engine failed on this request", None, "engine_error", "server_error")
            else:
                self.counts["stream_errors"] += 1
                logger.exception("stream failed")
                err = error_body("internal server error", None, "internal_error", "server_error")
            yield f"data: {json.dumps(err)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for p in pumps:
                p.cancel()
            if not completed:
                self.counts["streams_not_completed"] += 1
                _cancel_streams(streams)
            if call.locked:
                self.locks.release(call.locked)


def start_policy_server(
    model_path: str,
    engines: list,
    tracker: Any,
    cfg: ServeConfig,
    max_model_len: int,
    actors: dict | None = None,
) -> str:
    """Start Serve on ``cfg.host:cfg.port`` and deploy the PolicyServer (``cfg``, ``max_model_len``,
    ``actors``: see :class:`PolicyServer`) as ``cfg.num_replicas`` replicas, each with ``cfg.num_cpus``
    CPUs and the custom Ray ``cfg.resources``; more than one replica routes by session
    (:func:`clawray.serve.routing.router_config`). Returns the base URL (``.../v1``).

    Raises:
        RuntimeError: nothing answers on ``host:port`` 30 s after the deployment (e.g. Serve was
            already running in this Ray cluster on another port: Serve keeps its first port).
        ConfigError: ``cfg`` is a mapping that does not fit :class:`~clawray.config.ServeConfig`.
        ValueError: the model's chat template renders tools in a format the reply parser does not
            read (:func:`clawray.serve.reply.tool_call_format`).
    """
    import httpx

    from clawray.serve.routing import router_config

    cfg = section(ServeConfig, cfg)
    host, port = cfg.host, cfg.port
    from transformers import AutoTokenizer

    from clawray.serve.reply import tool_call_format

    tool_call_format(AutoTokenizer.from_pretrained(model_path).chat_template)  # an unknown format: refused now
    # one access-log line per request floods a training console; errors are still logged
    serve.start(http_options={"host": host, "port": port}, logging_config={"enable_access_log": False})
    options: dict[str, Any] = {"num_replicas": cfg.num_replicas}
    if router_config(cfg.num_replicas) is not None:
        options["request_router_config"] = router_config(cfg.num_replicas)
    server = PolicyServer.options(
        ray_actor_options={"num_cpus": cfg.num_cpus, "resources": dict(cfg.resources)},
        logging_config={"enable_access_log": False},
        **options,
    )
    serve.run(
        server.bind(model_path, engines, tracker, cfg, max_model_len, actors),
        name="clawray",
        route_prefix="/",
        blocking=False,
    )
    deadline = time.monotonic() + 30.0
    while True:
        try:
            if httpx.get(f"http://{host}:{port}/health", timeout=10.0).status_code == 200:
                return f"http://{host}:{port}/v1"
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the policy server does not answer on {host}:{port}; is Ray Serve already running "
                "in this cluster on another port? (Serve keeps the port it first started on)"
            )
        time.sleep(0.5)

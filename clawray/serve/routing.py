"""Serve at scale: session-affine routing to PolicyServer replicas, and the choice of a rollout engine.

Owns: the session-affine router's config, the body peek that gives a body-named session its routing
header (:data:`PEEK_MAX_BYTES`, :data:`PEEK_TIMEOUT_S`) and the engine choice rule (:func:`choose_engine`).
Must not: poll or call an engine, or import Ray: the states and loads it chooses from are
:mod:`clawray.serve.engine_pool`'s.

**Replicas.** With ``serve.num_replicas`` > 1 every request of a session must reach the same replica:
a session's lock (its requests run one at a time, in arrival order), its session-binding token and its
engine stickiness live in that replica. clawray uses Ray Serve's own request router API: the PolicyServer
deployment gets ``request_router_config`` with Ray 2.60's ``ConsistentHashRouter``
(``ray.serve.experimental.consistent_hash_router``), a consistent-hash ring over the replicas keyed on
``RequestMetadata.session_id``, with ``num_fallback_replicas=0`` (strict affinity: a full replica makes
the request wait, it never moves the session). Ray's HTTP proxy fills ``session_id`` from the
``X-Session-Id`` header (``RAY_SERVE_SESSION_ID_HEADER_KEY``, default ``x-session-id``) before routing,
so the router sees the header. It cannot see a session id sent in the body (``session_id``, or the
OpenAI ``user`` field): the proxy routes before the body is read. :class:`SessionKeyMiddleware`, a
middleware clawray already runs inside Serve's proxy (:mod:`clawray.serve.guard`), closes that gap: for
a ``POST`` without ``X-Session-Id`` it reads the JSON body (at most :data:`PEEK_MAX_BYTES` within
:data:`PEEK_TIMEOUT_S`), and when the body names a session it adds ``x-session-id: <that id>`` to the
request's headers, then hands the unchanged body on. The server resolves the session with the same
rule (header, else body ``session_id``, else ``user``: :func:`clawray.serve.protocol.parse_chat_request`),
so the routing key is always the session id the replica uses. A thin consistent-hash front deployment
(an extra hop and a second copy of every reply stream) was not needed.

Not affine: a request without any session id (the session is inferred from the message prefix by the
SessionTracker, shared by all replicas; its client sends the next turn only after the reply, so its
order holds), and a body-id request whose body is larger than :data:`PEEK_MAX_BYTES` or slower than
:data:`PEEK_TIMEOUT_S` (it is routed by a fresh request id; send ``X-Session-Id`` to be exact). When the
replica set changes (a replica restarts, num_replicas changes) the ring moves about 1/N of the sessions.

**Engines.** :func:`choose_engine` is a pure function of the engines' states and loads: it skips engines
that are down (dead, restarting, awaiting their re-sync) and prefers engines that are not paused (a
weight sync in progress); among those it keeps a session on its engine (prefix-cache locality) unless
that engine carries more than ``slack`` requests more than the least loaded one; else (and for a new
session) it takes the least loaded, ties broken by ``crc32(session id)`` so that a session's first
choice is stable. Each replica polls every engine itself (:mod:`clawray.serve.engine_pool`), so no
replica depends on another for it.

**Canary** (the promotion gate's, :mod:`clawray.canary`): while an engine serves a candidate version
to a fraction of the traffic (its ``stats()["arm"]`` is ``"canary"``), a session is canary traffic when
:func:`in_canary` puts its id in that fraction: a pure function of the id, so every replica puts a
session in the same arm and its turns stay there (session-affine). :func:`arm_states` then narrows
the engine choice: canary traffic to the canary engines, the rest (and requests without a session id)
to the others; an engine reserved for the gate's probe serves nobody. Canary traffic falls back to
the other engines only when no canary engine is up.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Callable, Sequence

#: engine states, best first: it serves now; it is loading weights (requests wait); it is down
UP, PAUSED, DOWN = "up", "paused", "down"
PEEK_MAX_BYTES = 8 << 20  # body bytes the proxy reads to find a body session id (serve.max_body_mb default)
PEEK_TIMEOUT_S = 5.0  # seconds the proxy waits for that body before routing without a session id
ROUTER_CLASS = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"


def choose_engine(
    key: str | None, states: Sequence[str], loads: Sequence[float], home: int | None, slack: float
) -> int:
    """The rollout engine for one request.

    Args:
        key: the session id (None: a request without a session; ties then go to the first engine).
        states: per engine :data:`UP`, :data:`PAUSED` or :data:`DOWN` (length N).
        loads: per engine its queue depth: requests admitted or waiting, not finished (length N).
        home: the engine the session used last (None: a new session).
        slack: a session leaves its home engine only when that engine's load exceeds the least loaded
            usable engine's load by more than ``slack`` requests.

    Returns:
        An engine index in ``0..N-1``: from the UP engines, else (every engine paused or down) from the
        PAUSED ones; ``home`` when it is in that set and within ``slack``; else the least loaded,
        ties broken in the order ``crc32(key) % N, +1, ...``.

    Raises:
        ValueError: every engine is down, or ``states`` and ``loads`` differ in length.
    """
    n = len(states)
    if len(loads) != n:
        raise ValueError(f"{n} engine states but {len(loads)} loads")
    usable = [i for i in range(n) if states[i] == UP] or [i for i in range(n) if states[i] == PAUSED]
    if not usable:
        raise ValueError("no rollout engine is up")
    least = min(loads[i] for i in usable)
    if home is not None and home in usable and loads[home] <= least + slack:
        return home
    first = zlib.crc32(key.encode()) % n if key else 0
    return min(usable, key=lambda i: (loads[i], (i - first) % n))


def in_canary(key: str | None, fraction: float) -> bool:
    """Whether session ``key`` is canary traffic under ``fraction`` (in [0, 1]): ``crc32("canary:" +
    key) / 2**32 < fraction``, so about that share of sessions is, always the same ones, and a session
    in the fraction stays in every larger one. A request without a session id never is."""
    return bool(key) and fraction > 0 and zlib.crc32(f"canary:{key}".encode()) / 2**32 < fraction


def arm_states(states: Sequence[str], arms: Sequence[str | None], canary: bool) -> tuple[list[str], bool]:
    """The engine states a request may choose from (:func:`choose_engine`), given each engine's arm
    (None: serves everyone; ``"canary"``; ``"reserved"``: the gate's probe, serves nobody) and whether
    the request is ``canary`` traffic. Returns ``(states with the engines it may not use as DOWN,
    fell_back)``: canary traffic goes to the canary engines that are not down, or, when none is,
    falls back to the others (``fell_back`` True); other traffic never goes to a canary engine."""
    allowed = [s if a is None else DOWN for s, a in zip(states, arms)]
    if not canary:
        return allowed, False
    mine = [s if a == "canary" else DOWN for s, a in zip(states, arms)]
    if any(s != DOWN for s in mine):
        return mine, False
    return allowed, any(a == "canary" for a in arms)


def router_config(num_replicas: int) -> dict | None:
    """The PolicyServer's ``request_router_config``: the session-affine consistent-hash router (strict,
    no fallback replica) when ``num_replicas`` > 1, else None (Serve's default router)."""
    if num_replicas <= 1:
        return None
    return {"request_router_class": ROUTER_CLASS, "request_router_kwargs": {"num_fallback_replicas": 0}}


def body_session_id(raw: bytes) -> str | None:
    """The routing key a chat request body names (``session_id``, else ``user``; :func:`body_session`)."""
    return body_session(raw)[0]


def body_session(raw: bytes) -> tuple[str | None, str | None]:
    """``(routing key, the body key it came from)`` of a chat request body: its ``session_id``, else
    its ``user`` as the server reads it (the end user: all of a user's conversations reach one replica);
    ``(None, None)`` when it names neither or is not a JSON object (the server then answers 400)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None, None
    if not isinstance(body, dict):
        return None, None
    from clawray.serve.protocol import user_session

    for key in ("session_id", "user"):
        value = body.get(key)
        if value is not None:
            if not isinstance(value, str) or not value:
                return None, None
            return (value if key == "session_id" else user_session(value)), key  # a long user: its hashed id
    return None, None


class SessionKeyMiddleware:
    """Pure ASGI middleware in Serve's HTTP proxy: gives a ``POST`` whose body names the session (and
    that has no ``X-Session-Id``) the header ``x-session-id``, so Serve's session-affine router sees it.

    The body is read up to :data:`PEEK_MAX_BYTES` bytes and :data:`PEEK_TIMEOUT_S` seconds; what was read
    is handed on first, then the rest of the body, unchanged; past either bound, or when the id cannot be
    a header value (not UTF-8, over 256 characters), no header is added. Other requests pass untouched.
    """

    def __init__(self, app: Callable):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        headers = scope.get("headers") or []
        if scope.get("type") != "http" or scope.get("method") != "POST" or _has_session_header(headers):
            await self.app(scope, receive, send)
            return
        buffered: list[dict] = []
        complete, pending = await _peek(receive, buffered)
        sid, key = body_session(b"".join(m.get("body", b"") for m in buffered)) if complete else (None, None)
        value = _header_value(sid)
        if value is not None:
            added = [(b"x-session-id", value)]
            if key == "user":  # the server reads it as the end user, not as a session id
                from clawray.serve.protocol import USER_ROUTED_HEADER

                added.append((USER_ROUTED_HEADER.encode(), b"1"))
            scope = {**scope, "headers": [*headers, *added]}

        async def replay() -> dict:
            nonlocal pending
            if buffered:
                return buffered.pop(0)
            if pending is not None:  # the read the deadline interrupted: its message comes next
                task, pending = pending, None
                return await task
            return await receive()

        await self.app(scope, replay, send)


def _has_session_header(headers: list[tuple[bytes, bytes]]) -> bool:
    # as Ray's proxy: case-insensitive, "-" and "_" alike
    return any(name.lower().replace(b"_", b"-") == b"x-session-id" for name, _ in headers)


def _header_value(sid: str | None) -> bytes | None:
    from clawray.serve.protocol import MAX_SESSION_ID_CHARS

    if sid is None or len(sid) > MAX_SESSION_ID_CHARS or any(c in sid for c in "\r\n\0"):
        return None
    try:
        return sid.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: the server refuses the body anyway
        return None


async def _peek(receive: Callable, buffered: list[dict]) -> tuple[bool, asyncio.Future | None]:
    """Read body messages into ``buffered`` until the body ends (``(True, None)``) or a bound is hit
    (``(False, the unfinished read or None)``); no message is lost: the unfinished read is awaited later."""
    loop = asyncio.get_running_loop()
    deadline, size = loop.time() + PEEK_TIMEOUT_S, 0
    while True:
        task = asyncio.ensure_future(receive())
        done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - loop.time()))
        if not done:
            return False, task
        message = task.result()
        buffered.append(message)
        if message.get("type") != "http.request":  # a disconnect: hand it on
            return False, None
        size += len(message.get("body", b""))
        if size > PEEK_MAX_BYTES:
            return False, None
        if not message.get("more_body", False):
            return True, None


def engine_state(stats: dict | None) -> str:
    """An engine's routing state from its ``stats()`` (None: it did not answer, so it is down)."""
    if stats is None or stats.get("awaiting_sync"):
        return DOWN
    return PAUSED if stats.get("paused") else UP

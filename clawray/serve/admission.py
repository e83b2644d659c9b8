"""Admission: what a request must pass before it reaches a session or an engine.

Owns, in this order: a browser ``Origin`` outside ``allowed_origins`` or, when bound to loopback, a
``Host`` that is not a loopback name or the bound host (DNS rebinding) -> 403; a missing or wrong API
key -> 401; a body that is not ``application/json`` -> 415; a body over ``max_body_bytes`` -> 413 or
not complete within ``body_timeout_s`` -> 408, so a slow client holds no session lock; session binding
(``session_binding``) -> 403; and the per-session FIFO locks. Must not: read the tracker or an engine.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
from collections import Counter, OrderedDict

from starlette.requests import Request

from clawray.chat import RequestError
from clawray.config import ServeConfig
from clawray.session_book import AUTO_SESSION_PREFIX

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
MAX_BOUND_SESSIONS = 100_000  # session tokens kept; the oldest binding is forgotten beyond this


class Admission:
    """The admission checks of one replica.

    Args:
        cfg: the ``serve`` section (``api_key``, ``allowed_origins``, ``host``, ``max_body_bytes``,
            ``body_timeout_s``, ``session_binding``).
        counts: the replica's counters (``body_timeouts`` is counted here).

    Attributes:
        bindings: ``{session id: [token, the token came back]}``, at most :data:`MAX_BOUND_SESSIONS`.
    """

    def __init__(self, cfg: ServeConfig, counts: Counter):
        self.cfg, self.counts = cfg, counts
        self.bindings: OrderedDict[str, list] = OrderedDict()

    def authorized(self, request: Request) -> bool:
        """Whether the request carries the API key (``Authorization: Bearer``, compared in constant
        time); True when no key is configured."""
        key = self.cfg.api_key
        if not key:
            return True
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        return hmac.compare_digest(token.encode(), key.encode())

    def check_origin(self, request: Request) -> None:
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
    def check_content_type(request: Request) -> None:
        """Raises RequestError ``unsupported_media_type`` (HTTP 415) unless the body is declared
        ``application/json`` (parameters such as ``charset=utf-8`` allowed)."""
        declared = request.headers.get("content-type", "")
        if declared.split(";", 1)[0].strip().lower() != "application/json":
            raise RequestError(
                f"Content-Type must be application/json, not {declared[:100]!r}", None, "unsupported_media_type"
            )

    def bind_session(self, session_id: str | None, given: str | None) -> str | None:
        """Session binding: the first request of an explicit session id gets a fresh token (returned,
        to be sent back as ``X-Session-Token``); a later request must carry it when ``session_binding``
        is ``strict``, or under ``echo`` once the token has come back once. A wrong token is always
        refused. A session this replica has no binding for (new, or bound before a restart or a
        resume) that arrives with a token is bound to that token: a client keeps its token across a
        resume, and the session still belongs to its first client. Ids that start with
        :data:`~clawray.session_book.AUTO_SESSION_PREFIX` (the server's own sessions, which inference may
        continue) are never bound; inference never continues any other session while binding is on.

        Returns: the new token for a session's first request, else None.

        Raises:
            RequestError: code ``session_token`` (HTTP 403).
        """
        mode = self.cfg.session_binding
        if mode == "off" or not session_id or session_id.startswith(AUTO_SESSION_PREFIX):
            return None
        entry = self.bindings.get(session_id)
        if entry is None:  # a token from before a restart (a resume): the first one back keeps it
            token = given or secrets.token_urlsafe(24)
            self.bindings[session_id] = [token, bool(given)]
            if len(self.bindings) > MAX_BOUND_SESSIONS:
                self.bindings.popitem(last=False)
            return None if given else token
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

    def unbind(self, session_id: str | None) -> None:
        """Forget a binding whose token never reached the client (the request failed)."""
        self.bindings.pop(session_id, None)

    async def read_body(self, request: Request) -> bytes:
        """The whole request body within ``body_timeout_s`` seconds.

        Raises:
            RequestError: ``body_too_large`` (413) over ``max_body_bytes``; ``body_timeout`` (408) late.
        """
        try:
            return await asyncio.wait_for(self._read_body(request), timeout=self.cfg.body_timeout_s)
        except asyncio.TimeoutError:
            self.counts["body_timeouts"] += 1
            raise RequestError(
                f"the request body did not arrive within {self.cfg.body_timeout_s} s", None, "body_timeout"
            ) from None

    async def _read_body(self, request: Request) -> bytes:
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise RequestError(f"request body is {declared} bytes; the limit is {limit}", None, "body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(f"request body exceeds the limit of {limit} bytes", None, "body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)


class SessionLocks:
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

"""HeaderGuard: an ASGI layer inside Ray Serve's HTTP proxy that refuses hostile header blocks with a 4xx
before the proxy itself reads them.

Owns: the header limits below, the proxy's middleware list (:func:`proxy_middlewares`), its header-read
deadline (:func:`limit_header_time`) and a local replica's gRPC bind to loopback. Must not: check what
depends on the run's config (origin, Host, API key, content type, body: :mod:`clawray.serve.admission`).

Why in the proxy: Ray Serve's proxy decodes, as UTF-8 and before any deployment code runs, the values of
``X-Session-Id`` (also spelt ``x_session_id``), ``X-Request-Id``, ``serve_multiplexed_model_id`` (also
``serve-multiplexed-model-id``), ``X-Request-Timeout-Seconds`` and ``X-Request-Disconnect-Disabled``
(``ray/serve/_private/proxy.py``, ``http_util.py``; Ray 2.60); one non-UTF-8 byte there is an HTTP 500.
Its uvicorn server (h11) also accepts a 1 MiB header value and thousands of headers. Serve runs the
Starlette middlewares returned by the callable named in ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``
around its proxy app; :data:`clawray.ray_env.PROXY_CALLBACK_ENV` names :func:`proxy_middlewares`, and
:func:`clawray.ray_env.init_ray` (and the test cluster) set it before Ray starts, so the proxy process
inherits it. A cluster started by hand needs it in the environment of ``ray start`` on every node.

Invariants (per HTTP request, checked on the raw header bytes, before anything else reads them):
  * at most :data:`MAX_HEADERS` header lines, else 431;
  * each header line (name + value) at most :data:`MAX_HEADER_BYTES` bytes and all of them together at
    most :data:`MAX_HEADERS_TOTAL_BYTES`, else 431;
  * every header value is valid UTF-8 (RFC 9110 allows only visible ASCII; UTF-8 is the lenient
    superset the proxy can read), else 400.
The answer has the OpenAI error shape ``{"error": {"message", "type", "param", "code"}}`` and closes
the connection.
"""

from __future__ import annotations

import json
from typing import Any, Callable

MAX_HEADERS = 100  # header lines per request
MAX_HEADER_BYTES = 16 * 1024  # bytes of one header line (name + value)
MAX_HEADERS_TOTAL_BYTES = 64 * 1024  # bytes of all header lines together


def header_problem(headers: list[tuple[bytes, bytes]]) -> tuple[int, str, str] | None:
    """``(status, message, code)`` for a header block that breaks the limits above, else None.

    Args:
        headers: the ASGI ``scope["headers"]``: (lower-cased name, value) byte pairs.
    """
    if len(headers) > MAX_HEADERS:
        return 431, f"{len(headers)} header lines; the limit is {MAX_HEADERS}", "headers_too_large"
    total = 0
    for name, value in headers:
        size = len(name) + len(value)
        total += size
        if size > MAX_HEADER_BYTES:
            return (
                431,
                f"header {name[:64].decode('latin-1')!r} is {size} bytes; the limit is {MAX_HEADER_BYTES}",
                "headers_too_large",
            )
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return 400, f"header {name[:64].decode('latin-1')!r} is not valid UTF-8", "invalid_header"
    if total > MAX_HEADERS_TOTAL_BYTES:
        return 431, f"headers are {total} bytes; the limit is {MAX_HEADERS_TOTAL_BYTES}", "headers_too_large"
    return None


class HeaderGuard:
    """Pure ASGI middleware: answers a request whose headers break :func:`header_problem` with its 4xx and
    never calls the wrapped app for it; passes everything else (and non-HTTP scopes) through untouched."""

    def __init__(self, app: Callable):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        problem = header_problem(scope.get("headers") or []) if scope.get("type") == "http" else None
        if problem is None:
            await self.app(scope, receive, send)
            return
        status, message, code = problem
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


#: Seconds a connection may take to complete a request's headers, from its opening or from its first
#: byte of a next request (``CLAWRAY_HEADER_TIMEOUT_S`` in the proxy's environment overrides it).
HEADER_TIMEOUT_S = 30.0
HEADER_TIMEOUT_ENV = "CLAWRAY_HEADER_TIMEOUT_S"


def limit_header_time(timeout_s: float) -> None:
    """Give uvicorn's HTTP protocols (what Serve's proxy speaks: httptools when installed, else h11) a
    header deadline: a connection that has not completed a request's headers ``timeout_s`` seconds
    after it opened, or after the first byte of its next request, is closed. uvicorn has none (its
    keep-alive timer stops at the first byte), so unfinished header blocks held connections open
    forever (9,000 of them, against the proxy's 20,000 files: slowloris). A connection idle between
    requests keeps uvicorn's keep-alive timeout; a request whose headers are complete is never cut
    (its body has the deployment's ``body_timeout_s``). Idempotent (a second call only changes the
    deadline); patches the classes, so it holds for every connection."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    protocols = [(H11Protocol, None)]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        protocols.append((HttpToolsProtocol, "on_headers_complete"))
    except ImportError:  # httptools is optional
        pass
    for cls, headers_hook in protocols:
        _add_header_deadline(cls, headers_hook, timeout_s)


def _add_header_deadline(cls: Any, headers_hook: str | None, timeout_s: float) -> None:
    """:func:`limit_header_time` for one protocol class. ``headers_hook``: the method called when a
    request's headers are complete (httptools); None for h11, read from its connection state."""
    if getattr(cls, "_clawray_header_timeout", None) is not None:
        cls._clawray_header_timeout = timeout_s
        return
    cls._clawray_header_timeout = timeout_s
    made, received, lost = cls.connection_made, cls.data_received, cls.connection_lost

    def disarm(self: Any) -> None:
        handle = getattr(self, "_clawray_header_deadline", None)
        if handle is not None:
            handle.cancel()
            self._clawray_header_deadline = None

    def expire(self: Any) -> None:
        self._clawray_header_deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def between_requests(self: Any) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def headers_done(self: Any) -> bool:
        if headers_hook is not None:
            return False  # the hook disarms
        import h11

        return self.conn.their_state is not h11.IDLE

    def connection_made(self: Any, transport: Any) -> None:
        made(self, transport)
        disarm(self)
        self._clawray_header_deadline = self.loop.call_later(cls._clawray_header_timeout, expire, self)

    def data_received(self: Any, data: bytes) -> None:
        if getattr(self, "_clawray_header_deadline", None) is None and between_requests(self):
            # the first byte of a next request on a kept-alive connection
            self._clawray_header_deadline = self.loop.call_later(cls._clawray_header_timeout, expire, self)
        received(self, data)
        if headers_done(self):
            disarm(self)

    def connection_lost(self: Any, exc: Exception | None) -> None:
        disarm(self)
        lost(self, exc)

    cls.connection_made, cls.data_received, cls.connection_lost = connection_made, data_received, connection_lost
    if headers_hook is not None:
        complete = getattr(cls, headers_hook)

        def on_headers_complete(self: Any) -> None:
            disarm(self)
            complete(self)

        setattr(cls, headers_hook, on_headers_complete)


def proxy_middlewares() -> list[Any]:
    """The callback Serve's proxy calls (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``): ``[HeaderGuard,
    SessionKeyMiddleware]`` (outermost first: headers are checked before a body is read for its session
    id, see :mod:`clawray.serve.routing`); it also gives the proxy's HTTP protocol its header deadline
    (:func:`limit_header_time`)."""
    import os

    from starlette.middleware import Middleware

    from clawray.serve.routing import SessionKeyMiddleware

    limit_header_time(float(os.environ.get(HEADER_TIMEOUT_ENV, HEADER_TIMEOUT_S)))
    return [Middleware(HeaderGuard), Middleware(SessionKeyMiddleware)]


def keep_replica_grpc_on_loopback() -> bool:
    """Bind a Serve replica's inter-deployment gRPC server to 127.0.0.1 when its node is loopback-only.

    Ray Serve 2.60 starts that server on ``[::]:0`` in every replica (``ray/serve/_private/replica.py``,
    ``_on_initialized``; no setting changes the address), so a local run would listen on every
    interface. When this replica's node address is 127.0.0.1 (a local run: nothing off this host can
    reach the node anyway), the name ``add_port_to_grpc_server`` in Serve's replica module is wrapped so
    ``[::]:port`` becomes ``127.0.0.1:port``; on a cluster node nothing changes (other nodes' proxies may
    need the port; use Ray's TLS there). Called when :mod:`clawray.serve.app` is imported, which happens
    in the replica process before the replica initialises.

    Returns:
        True when the wrapper is installed (or already was).
    """
    try:
        import ray
        from ray.serve._private import replica
    except ImportError:  # not inside Ray Serve
        return False
    if not ray.is_initialized() or ray.util.get_node_ip_address() != "127.0.0.1":
        return False
    original = replica.add_port_to_grpc_server
    if getattr(original, "_clawray_loopback", False):
        return True

    def on_loopback(server: Any, address: str) -> int:
        if address.startswith(("[::]:", "0.0.0.0:")):
            address = "127.0.0.1:" + address.rsplit(":", 1)[1]
        return original(server, address)

    on_loopback._clawray_loopback = True
    replica.add_port_to_grpc_server = on_loopback
    return True

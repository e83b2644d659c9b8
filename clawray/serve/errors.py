"""OpenAI-style error answers: the body, the HTTP status of each client error, and what an exception
raised by a chat request becomes (never internals: no actor ids, pids or tracebacks).

Owns: the mapping from an exception to its status, code and counter. Must not: decide retries.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import ray
from fastapi.responses import JSONResponse

from clawray.actors.rollout import EngineError, EnginePausedError, EngineRefusedError
from clawray.chat import RequestError
from clawray.serve.engine_pool import NoEngineUp

logger = logging.getLogger("ray.serve")

# the HTTP status of each RequestError code that is not a plain 400
ERROR_STATUS = {
    "body_too_large": 413,
    "body_timeout": 408,
    "unsupported_media_type": 415,
    "forbidden_origin": 403,
    "forbidden_host": 403,
    "session_token": 403,
}


def error_body(
    message: str, param: str | None = None, code: str = "invalid_request", err_type: str = "invalid_request_error"
) -> dict:
    """The OpenAI error object ``{"error": {"message", "type", "param", "code"}}`` (an HTTP error's body,
    or a stream's in-band error event)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


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


def refusal_message(error: EngineRefusedError) -> str:
    """The refusal's own message (``"the engine refused this request: <reason>"``), without the remote
    traceback a Ray task error adds to ``str()``."""
    cause = error.cause if isinstance(error, ray.exceptions.RayTaskError) else error
    return str(cause.args[0]) if cause.args else str(cause)


def unauthorized() -> JSONResponse:
    """401: no or a wrong API key."""
    return error_response(
        401, "missing or invalid API key (Authorization: Bearer ...)", None, "invalid_api_key", "authentication_error"
    )


def answer_error(e: Exception, counts: Counter, retry_after_s: int) -> JSONResponse:
    """The answer to an exception a chat request raised before its reply started, counted in
    ``counts``: a client error -> 4xx (:data:`ERROR_STATUS`, 400 ``request_refused`` when the engine
    refuses the request); a weight sync that outlasts its wait, an engine that does not answer in
    time, no engine up or the session tracker restarting -> 503 with ``Retry-After``; an engine that
    failed on this request -> 500 ``engine_error``; anything else -> 500 ``internal_error`` (logged)."""
    busy = {"Retry-After": str(retry_after_s)}
    if isinstance(e, RequestError):
        counts["rejected"] += 1
        status = ERROR_STATUS.get(e.code, 400)
        err_type = "permission_error" if status == 403 else "invalid_request_error"
        return error_response(
            status, str(e), e.param, e.code, err_type, headers={"Connection": "close"} if status == 408 else None
        )
    if isinstance(e, EnginePausedError):
        counts["sync_wait_timeouts"] += 1
        msg = "the policy is being updated; retry shortly"
        return error_response(503, msg, None, "engine_syncing", "server_error", headers=busy)
    if isinstance(e, asyncio.TimeoutError):  # the engine did not answer within generate_timeout_s
        counts["engine_timeouts"] += 1
        msg = "the policy engine did not answer in time"
        return error_response(503, msg, None, "engine_timeout", "server_error", headers=busy)
    if isinstance(e, (NoEngineUp, ray.exceptions.RayActorError)):  # no engine up, or the tracker down
        counts["actor_unavailable"] += 1
        logger.warning("chat completion refused: no engine is up, or the session tracker is restarting")
        msg = "the service is recovering from a failure; retry shortly"
        return error_response(503, msg, None, "service_unavailable", "server_error", headers=busy)
    status, body = _engine_failure(e, counts, "chat completion", "internal_errors")
    return JSONResponse(status_code=status, content=body)


def stream_error_body(e: Exception, counts: Counter) -> dict:
    """The in-band error event of a stream whose headers were sent (the mapping of :func:`answer_error`
    for what can fail once the engine admitted the request), counted in ``counts``."""
    return _engine_failure(e, counts, "stream", "stream_errors")[1]


def _engine_failure(e: Exception, counts: Counter, what: str, internal: str) -> tuple[int, dict]:
    """``(status, error body)`` of a failure during generation; ``internal``: the counter of a
    server-side fault."""
    if isinstance(e, EngineRefusedError):  # the request does not fit the engine: the client's error
        counts["rejected"] += 1
        return 400, error_body(refusal_message(e), None, "request_refused", "invalid_request_error")
    if isinstance(e, EngineError):  # the engine failed on this request alone; it goes on serving
        counts["engine_errors"] += 1
        logger.warning("%s failed in the engine: %s", what, e)
        return 500, error_body("the policy engine failed on this request", None, "engine_error", "server_error")
    counts[internal] += 1
    logger.exception("%s failed", what)
    return 500, error_body("internal server error", None, "internal_error", "server_error")

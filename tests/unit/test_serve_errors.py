"""What each exception a chat request raises becomes (clawray.serve.errors.answer_error): the status,
the OpenAI error code, the headers and the counter, as the server answered before its split (#25)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from clawray.actors.rollout import EngineError, EnginePausedError, EngineRefusedError
from clawray.chat import RequestError
from clawray.serve.engine_pool import NoEngineUp
from clawray.serve.errors import answer_error, stream_error_body


@pytest.mark.parametrize(
    "exc, status, code, counter, headers",
    [
        (RequestError("bad", "messages"), 400, "invalid_request", "rejected", {}),
        (RequestError("late", None, "body_timeout"), 408, "body_timeout", "rejected", {"connection": "close"}),
        (RequestError("no", None, "session_token"), 403, "session_token", "rejected", {}),
        (EnginePausedError("paused"), 503, "engine_syncing", "sync_wait_timeouts", {"retry-after": "7"}),
        (asyncio.TimeoutError(), 503, "engine_timeout", "engine_timeouts", {"retry-after": "7"}),
        (NoEngineUp("none"), 503, "service_unavailable", "actor_unavailable", {"retry-after": "7"}),
        (EngineRefusedError("the engine refused this request: too long"), 400, "request_refused", "rejected", {}),
        (EngineError("boom"), 500, "engine_error", "engine_errors", {}),
        (ValueError("bug"), 500, "internal_error", "internal_errors", {}),
    ],
)
def test_each_exception_becomes_its_openai_error(exc, status, code, counter, headers):
    counts: Counter = Counter()
    response = answer_error(exc, counts, retry_after_s=7)
    body = json.loads(response.body)
    assert (response.status_code, body["error"]["code"], dict(counts)) == (status, code, {counter: 1})
    assert {k: response.headers.get(k) for k in headers} == headers
    assert "Traceback" not in body["error"]["message"]


def test_the_refusal_message_is_the_engines_reason_and_a_stream_reports_it_in_band():
    counts: Counter = Counter()
    body = answer_error(EngineRefusedError("the engine refused this request: too long"), counts, 1).body
    assert json.loads(body)["error"]["message"] == "the engine refused this request: too long"
    assert stream_error_body(ValueError("bug"), counts) == {
        "error": {"message": "internal server error", "type": "server_error", "param": None, "code": "internal_error"}
    }
    assert counts == Counter({"rejected": 1, "stream_errors": 1})

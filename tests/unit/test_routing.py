"""Serve at scale (clawray.serve.routing): the engine chooser as a pure function, the body session key the
proxy adds for the session-affine replica router, and the router config."""

import asyncio
import json
import zlib

import pytest

from clawray.serve import routing
from clawray.serve.protocol import parse_chat_request
from clawray.serve.routing import DOWN, PAUSED, UP, SessionKeyMiddleware, choose_engine, engine_state


def _first(key, n):
    return zlib.crc32(key.encode()) % n


# ------------------------------------------------------------------ choose_engine
def test_new_session_takes_the_least_loaded_engine():
    assert choose_engine("s", [UP, UP, UP], [5, 1, 3], None, 4) == 1


def test_new_session_ties_start_at_its_crc32_engine():
    key = next(k for k in (f"k{i}" for i in range(100)) if _first(k, 3) == 2)
    assert choose_engine(key, [UP, UP, UP], [0, 0, 0], None, 4) == 2
    # engine 2 busier: the tie between 0 and 1 goes to the next after 2 in rotation, i.e. 0
    assert choose_engine(key, [UP, UP, UP], [1, 1, 2], None, 4) == 0
    assert choose_engine(None, [UP, UP, UP], [0, 0, 0], None, 4) == 0  # no session: the first engine


def test_a_session_sticks_to_its_engine_within_the_slack():
    assert choose_engine("s", [UP, UP], [5, 1], 0, 4) == 0  # 5 <= 1 + 4: stays
    assert choose_engine("s", [UP, UP], [6, 1], 0, 4) == 1  # 6 > 1 + 4: much more loaded, moves
    assert choose_engine("s", [UP, UP], [1, 1], 0, 0) == 0  # slack 0: stays while not more loaded
    assert choose_engine("s", [UP, UP], [2, 1], 0, 0) == 1


def test_a_dead_engine_is_skipped_even_when_it_is_home_and_idle():
    assert choose_engine("s", [DOWN, UP, UP], [0, 9, 7], 0, 4) == 2
    assert choose_engine("s", [UP, DOWN], [9, 0], None, 0) == 0


def test_a_paused_engine_is_skipped_while_another_serves():
    assert choose_engine("s", [PAUSED, UP], [0, 9], 0, 4) == 1
    # every engine paused (a sync): the request waits in one of them, the session's own first
    assert choose_engine("s", [PAUSED, PAUSED], [3, 3], 1, 4) == 1
    assert choose_engine("s", [PAUSED, DOWN], [3, 0], 1, 4) == 0


def test_no_engine_up_raises():
    with pytest.raises(ValueError, match="no rollout engine is up"):
        choose_engine("s", [DOWN, DOWN], [0, 0], 0, 4)
    with pytest.raises(ValueError, match="2 engine states but 1 loads"):
        choose_engine("s", [UP, UP], [0], None, 4)


def test_engine_state_from_stats():
    assert engine_state(None) == DOWN
    assert engine_state({"awaiting_sync": True, "paused": False}) == DOWN
    assert engine_state({"awaiting_sync": False, "paused": True}) == PAUSED
    assert engine_state({"awaiting_sync": False, "paused": False, "in_flight": 3}) == UP


def test_router_config_only_for_several_replicas():
    assert routing.router_config(1) is None
    cfg = routing.router_config(2)
    assert cfg == {
        "request_router_class": "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
        "request_router_kwargs": {"num_fallback_replicas": 0},
    }


# ------------------------------------------------------------------ the body session key in the proxy
def parse_user_session(user: str) -> str:
    return parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "user": user}, {}, 8, 1.0).user


def test_body_session_id_follows_the_servers_rule():
    assert routing.body_session_id(b'{"session_id": "a", "user": "b"}') == "a"
    assert routing.body_session_id(b'{"user": "b"}') == "b"
    assert routing.body_session_id(b'{"messages": []}') is None
    assert routing.body_session_id(b'{"session_id": 7, "user": "b"}') is None  # the server answers 400
    assert routing.body_session_id(b"[1]") is None and routing.body_session_id(b"{not json") is None
    long_user = "u" * 300  # any user is valid: the server names it user-<sha256>, and so does the router
    assert routing.body_session_id(json.dumps({"user": long_user}).encode()) == parse_user_session(long_user)
    assert parse_user_session(long_user).startswith("user-") and len(parse_user_session(long_user)) == 37


def _run(scope, messages, delay_s=0.0):
    """Run SessionKeyMiddleware on ``messages``; returns (scope the app saw, body bytes the app read)."""
    seen = {}

    async def receive():
        if delay_s:
            await asyncio.sleep(delay_s)
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def app(scope, receive, send):
        seen["scope"], body = scope, b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        seen["body"] = body

    asyncio.run(SessionKeyMiddleware(app)(scope, receive, None))
    return seen["scope"], seen["body"]


def _scope(headers=()):
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": list(headers)}


def test_a_body_session_id_becomes_the_x_session_id_header_and_the_body_is_unchanged():
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "user": "caf\u00e9-7"}).encode()
    parts = [
        {"type": "http.request", "body": body[:10], "more_body": True},
        {"type": "http.request", "body": body[10:], "more_body": False},
    ]
    scope, got = _run(_scope([(b"content-type", b"application/json")]), parts)
    assert scope["headers"] == [
        (b"content-type", b"application/json"),
        (b"x-session-id", "caf\u00e9-7".encode()),
        (b"x-clawray-routed-user", b"1"),  # a user, not a session: the server reads it as the end user
    ]
    assert got == body
    assert parse_chat_request(
        json.loads(body), {k.decode(): v.decode("latin-1") for k, v in scope["headers"]}, 8, 1.0
    ).user
    scope, _ = _run(_scope(), [{"type": "http.request", "body": b'{"session_id": "s", "user": "u"}'}])
    assert scope["headers"] == [(b"x-session-id", b"s")]  # a session id is one


def test_a_request_with_x_session_id_or_without_a_body_id_is_untouched():
    body = b'{"session_id": "b"}'
    for name in (b"x-session-id", b"x_session_id"):
        scope, got = _run(_scope([(name, b"a")]), [{"type": "http.request", "body": body}])
        assert scope["headers"] == [(name, b"a")] and got == body
    scope, got = _run(_scope(), [{"type": "http.request", "body": b'{"messages": []}'}])
    assert scope["headers"] == [] and got == b'{"messages": []}'
    get = {"type": "http", "method": "GET", "path": "/health", "headers": []}
    assert _run(get, [{"type": "http.request", "body": b""}])[0] is get


def test_a_body_past_the_peek_bounds_goes_on_whole_without_a_key(monkeypatch):
    monkeypatch.setattr(routing, "PEEK_MAX_BYTES", 8)
    body = b'{"session_id": "long-enough"}'
    scope, got = _run(_scope(), [{"type": "http.request", "body": body}])
    assert scope["headers"] == [] and got == body
    monkeypatch.setattr(routing, "PEEK_MAX_BYTES", 1 << 20)
    monkeypatch.setattr(routing, "PEEK_TIMEOUT_S", 0.05)
    parts = [
        {"type": "http.request", "body": body[:5], "more_body": True},
        {"type": "http.request", "body": body[5:], "more_body": False},
    ]
    scope, got = _run(_scope(), parts, delay_s=0.03)  # the second part arrives after the deadline
    assert scope["headers"] == [] and got == body
    too_long = json.dumps({"session_id": "x" * 257}).encode()
    scope, got = _run(_scope(), [{"type": "http.request", "body": too_long}])
    assert scope["headers"] == [] and got == too_long  # the server answers 400 for it

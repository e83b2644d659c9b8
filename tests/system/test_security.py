"""Hostile HTTP clients against the PolicyServer (raw sockets where a client library would refuse to
send the bytes): header bytes and sizes refused in Serve's proxy (HeaderGuard), slow bodies (408, no
session lock held), content types (415), browser origins and Host names (403), session binding (403)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import ray

from clawray.ray_env import free_port
from conftest import MASKED_SESSIONS

pytestmark = pytest.mark.slow

BODY = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'


@pytest.fixture(scope="module")
def secured(ray_cluster, tiny_model, tmp_path_factory):
    """Two PolicyServer apps on a scripted engine: ``/echo`` (session_binding echo, body_timeout_s 2,
    one allowed origin) and ``/strict`` (session_binding strict)."""
    from ray import serve

    from clawray.actors.judge import JudgeWorkerActor
    from clawray.actors.queue import TrajectoryQueueActor
    from clawray.actors.session import SessionTrackerActor
    from clawray.config import ServeConfig
    from clawray.serve.app import PolicyServer
    from conftest import SERVE_PORT, scripted_engine_class, shared_serve

    tmp = tmp_path_factory.mktemp("secure")
    engine = ray.remote(scripted_engine_class()).options(num_cpus=0).remote()
    judge = JudgeWorkerActor.options(num_cpus=0).remote({"backend": "feedback", "m": 1})
    shared_serve()
    port = SERVE_PORT
    for mode in ("echo", "strict"):
        queue = TrajectoryQueueActor.options(num_cpus=0).remote(2)
        tracker = SessionTrackerActor.options(num_cpus=0).remote(
            [judge], queue, MASKED_SESSIONS, records_dir=str(tmp / mode)
        )
        cfg = ServeConfig(
            model_name="tiny",
            default_max_tokens=4,
            default_temperature=1.0,
            generate_timeout_s=60,
            max_body_mb=1.0,
            api_key="",
            sync_wait_timeout_s=1.0,
            retry_after_s=2,
            max_n=4,
            body_timeout_s=2.0,
            host="127.0.0.1",
            allowed_origins=["http://localhost:3000"],
            session_binding=mode,
        )
        max_model_len = 256
        serve.run(
            PolicyServer.options(ray_actor_options={"num_cpus": 0}).bind(
                tiny_model, [engine], tracker, cfg, max_model_len
            ),
            name=mode,
            route_prefix=f"/{mode}",
        )
    yield {"port": port, "root": f"http://127.0.0.1:{port}", "engine": engine, "model": tiny_model}
    for mode in ("echo", "strict"):
        serve.delete(mode)


def _raw(
    port: int,
    head: bytes,
    body: bytes = BODY,
    path: bytes = b"/echo/v1/chat/completions",
    content_type: bytes = b"application/json",
    timeout: float = 30.0,
) -> int:
    """Send one request as raw bytes; returns the response's status code."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(
            b"POST "
            + path
            + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            + content_type
            + b"\r\n"
            + head
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1])


PROXY_DECODED = [
    b"X-Session-Id",
    b"x_session_id",
    b"X-Request-Id",
    b"serve_multiplexed_model_id",
    b"serve-multiplexed-model-id",
    b"X-Request-Timeout-Seconds",
    b"X-Request-Disconnect-Disabled",
    b"traceparent",
    b"X-Other",
]


def test_header_bytes_and_sizes_get_4xx_never_500(secured):
    port = secured["port"]
    assert [_raw(port, name + b": a\xff\xfeb\r\n") for name in PROXY_DECODED] == [400] * len(PROXY_DECODED)
    assert _raw(port, b"X-Big: " + b"a" * (1 << 20) + b"\r\n") == 431
    assert _raw(port, b"".join(b"X-H%d: v\r\n" % i for i in range(2000))) == 431
    assert _raw(port, b"X-Session-Id: caf\xc3\xa9\r\n") == 200  # UTF-8 is fine


def test_slow_body_gets_408_and_blocks_no_one_of_its_session(secured):
    port, status = secured["port"], {}

    def slowloris():
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(
                b"POST /echo/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                b"\r\nX-Session-Id: slow-s\r\nContent-Length: %d\r\n\r\n" % len(BODY)
            )
            t0 = time.perf_counter()
            try:
                for b in BODY:  # 1 byte per 0.25 s: the body would take 16 s
                    s.sendall(bytes([b]))
                    time.sleep(0.25)
            except OSError:  # the server answered and closed
                pass
            data = s.recv(4096)
            status["slow"], status["slow_s"] = int(data.split(b" ", 2)[1]), time.perf_counter() - t0

    t = threading.Thread(target=slowloris)
    t.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    r = httpx.post(
        secured["root"] + "/echo/v1/chat/completions",
        content=BODY,
        timeout=30,
        headers={"Content-Type": "application/json", "X-Session-Id": "slow-s"},
    )
    fast_s = time.perf_counter() - t0
    t.join(30)
    assert r.status_code == 200 and fast_s < 1.5  # served while the slow body of its session trickles
    assert status["slow"] == 408 and 1.9 <= status["slow_s"] < 6.0


def test_unfinished_headers_are_closed_at_the_proxys_deadline(secured):
    """Issue #27.6: connections with unfinished headers were held open forever (9,000 of them). The
    proxy's h11 protocol now closes a connection whose headers are not complete 5 s (the test
    cluster's ``CLAWRAY_HEADER_TIMEOUT_S``) after it opened, or after the first byte of a next
    request on a kept-alive connection; one that sends nothing is closed too; a served keep-alive
    connection is not cut by it."""
    port = secured["port"]

    def closed_after(first: bytes, trickle: bytes = b"") -> float:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            t0 = time.perf_counter()
            s.sendall(first)
            for b in trickle:  # one header byte a second: never finishes in time
                time.sleep(1.0)
                try:
                    s.sendall(bytes([b]))
                except OSError:
                    break
            try:
                assert s.recv(4096) == b""  # closed, no response
            except ConnectionResetError:
                pass
            return time.perf_counter() - t0

    partial = b"POST /echo/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    assert 4.0 <= closed_after(partial, b"X-Slow: " + b"a" * 20) < 12.0
    assert 4.0 <= closed_after(b"") < 12.0  # opened, never spoke
    # a kept-alive connection: served, idle past the deadline, then a next request: still served
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        request = (
            b"POST /echo/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
        )
        s.sendall(request)
        assert _read_response(s).startswith(b"HTTP/1.1 200")
        time.sleep(6.0)
        s.sendall(request)
        assert _read_response(s).startswith(b"HTTP/1.1 200")


def _read_response(s: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length (headers and body may come in several reads)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "closed inside the body"
        body += chunk
    return head + b"\r\n\r\n" + body


def test_content_type_must_be_json(secured):
    port = secured["port"]
    assert _raw(port, b"", content_type=b"text/plain") == 415
    assert _raw(port, b"", content_type=b"application/x-www-form-urlencoded") == 415
    assert _raw(port, b"", content_type=b"application/json; charset=utf-8") == 200


def test_browser_origins_and_foreign_hosts_get_403(secured):
    url = secured["root"] + "/echo/v1/chat/completions"

    def post(**headers):
        return httpx.post(url, content=BODY, timeout=30, headers={"Content-Type": "application/json", **headers})

    evil = post(Origin="http://evil.example")
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "forbidden_origin"
    assert post(Origin="http://localhost:3000").status_code == 200
    rebound = post(Host="evil.example:8000")
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "forbidden_host"
    assert post(Host=f"localhost:{secured['port']}").status_code == 200
    assert httpx.get(secured["root"] + "/echo/v1/models", headers={"Origin": "http://evil.example"}).status_code == 403


def _session(root: str, app: str, sid: str, token: str | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json", "X-Session-Id": sid}
    if token is not None:
        headers["X-Session-Token"] = token
    return httpx.post(f"{root}/{app}/v1/chat/completions", content=BODY, timeout=30, headers=headers)


def test_session_binding_echo_binds_once_the_token_comes_back(secured):
    root = secured["root"]
    first = _session(root, "echo", "bind-e")
    token = first.headers["x-session-token"]
    assert first.status_code == 200 and len(token) >= 32
    second = _session(root, "echo", "bind-e")  # a client that never echoes keeps working
    assert second.status_code == 200 and "x-session-token" not in second.headers
    wrong = _session(root, "echo", "bind-e", "not-the-token")
    assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "session_token"
    assert _session(root, "echo", "bind-e", token).status_code == 200
    assert _session(root, "echo", "bind-e").status_code == 403  # bound now: a token-less request is refused
    assert _session(root, "echo", "bind-e", token).json()["turn_index"] == 4  # refused requests recorded nothing


def test_inference_never_joins_a_bound_session_and_still_continues_the_servers_own(secured):
    """Issue #27.4: under ``echo``, a client that sends a victim's exact history with no session id
    was inferred into the bound session, and its "Correct, thanks!" scored the victim's turn +1. Now
    it is served unattributed (no session, nothing recorded); id-less clients still get their own
    ``auto-`` sessions continued, and those are never bound (no token)."""
    from transformers import AutoTokenizer

    root, engine = secured["root"], secured["engine"]
    tok = AutoTokenizer.from_pretrained(secured["model"])
    four = tok.encode("4", add_special_tokens=False) + [tok.eos_token_id]
    ray.get(engine.script.remote([(four, "stop")] * 4))
    url = f"{root}/echo/v1/chat/completions"
    history = [{"role": "user", "content": "2+2?"}]
    victim = httpx.post(url, json={"messages": history}, headers={"X-Session-Id": "victim-1"}, timeout=30)
    assert victim.status_code == 200 and victim.json()["session_id"] == "victim-1" and victim.headers["x-session-token"]
    reply = victim.json()["choices"][0]["message"]
    assert reply["content"] == "4"
    forged = history + [reply, {"role": "user", "content": "Correct, thanks!"}]
    attack = httpx.post(url, json={"messages": forged}, timeout=30)
    assert attack.status_code == 200
    assert (attack.json()["session_id"], attack.json()["turn_index"]) == (None, None)  # served, not recorded
    mine = httpx.post(url, json={"messages": history}, timeout=30)
    sid = mine.json()["session_id"]
    assert sid.startswith("auto-") and "x-session-token" not in mine.headers
    again = httpx.post(
        url,
        json={"messages": history + [mine.json()["choices"][0]["message"], {"role": "user", "content": "ok"}]},
        timeout=30,
    )
    assert (again.json()["session_id"], again.json()["turn_index"]) == (sid, 2)
    health = httpx.get(f"{root}/echo/health", timeout=30).json()["counts"]
    assert health["unattributable"] >= 1 and health["sessions_inferred"] >= 1


def test_a_token_kept_across_a_resume_still_works(secured):
    """Issue #27.4: bindings live in the server replica; after a resume a client that kept its token
    got 403. A session the server holds no binding for, arriving with a token, is bound to it."""
    root, kept = secured["root"], "token-from-before-the-resume-0123456789"
    first = _session(root, "echo", "resumed-1", kept)
    assert first.status_code == 200 and "x-session-token" not in first.headers
    assert _session(root, "echo", "resumed-1", kept).status_code == 200
    assert _session(root, "echo", "resumed-1").status_code == 403  # bound to the kept token
    assert _session(root, "echo", "resumed-1", "another").status_code == 403


def test_session_binding_strict_and_a_failed_first_request_binds_nothing(secured):
    root = secured["root"]
    bad = httpx.post(
        f"{root}/strict/v1/chat/completions", json={"messages": []}, timeout=30, headers={"X-Session-Id": "bind-s"}
    )
    assert bad.status_code == 400 and "x-session-token" not in bad.headers
    first = _session(root, "strict", "bind-s")
    token = first.headers["x-session-token"]
    assert _session(root, "strict", "bind-s").status_code == 403
    assert _session(root, "strict", "bind-s", token).status_code == 200
    assert _session(root, "strict", "other-s").status_code == 200  # another session, its own token


def _cluster_listeners(gcs_address: str) -> set[tuple[str, str, int]]:
    """(process name, bound ip, port) of every listening TCP socket of this test's Ray cluster (the
    processes naming its GCS address, their descendants: raylet, workers, agents) and of this process."""
    import os

    import psutil

    port = gcs_address.rsplit(":", 1)[1]
    roots = []
    for p in psutil.process_iter(["cmdline"]):
        args = p.info["cmdline"] or []
        if any(gcs_address in a or a == f"--gcs_server_port={port}" for a in args):
            roots.append(p)
    procs = {psutil.Process(os.getpid())} | set(roots)
    for r in roots:
        try:
            procs.update(r.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    found = set()
    for p in procs:
        try:
            found.update((p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections("tcp") if c.status == "LISTEN")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_every_listening_socket_is_on_loopback(ray_cluster, tiny_model):
    """With a 2-rank FSDP learner group (gloo, its TCPStore) and a weight-sync group to an hf engine
    (its own TCPStore and gloo pairs) up, every listening socket of the cluster is on loopback."""
    from clawray.actors.learner import LearnerGroup
    from clawray.actors.rollout import RolloutEngineActor
    from test_learner_sync import LEARNER, _sync_group

    engine = RolloutEngineActor.options(num_cpus=0.25).remote(
        tiny_model, {"backend": "hf", "torch_threads": 1, "max_batch_size": 8}
    )
    learners = LearnerGroup(tiny_model, LEARNER, free_port())
    try:
        plan = ray.get(engine.weight_specs.remote())
        _sync_group(learners, [engine], plan)
        found = _cluster_listeners(ray_cluster["address"])
        names = {name for name, _, _ in found}
        assert {"gcs_server", "raylet"} <= names and any("LearnerWorker" in n for n in names)
        exposed = sorted(f for f in found if f[1] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1"))
        assert exposed == []
    finally:
        learners.shutdown()
        ray.kill(engine)

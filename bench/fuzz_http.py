"""HTTP fuzz of the PolicyServer: thousands of hostile requests, sent as raw bytes over loopback sockets,
against a server it starts on the tiny model (hf engine). Target: no response >= 500 and no hang.

Corpus (every case is one request on its own connection): malformed JSON bodies, wrong types and
odd values for every request field and message field, non-UTF-8 bytes in the values of many header
names (those Ray Serve's proxy decodes first), oversized and too many headers, header syntax errors,
wrong content types, bad methods and paths, foreign Origin/Host, session-token games, oversized and
mismatched bodies, and slow clients (bodies trickled past ``serve.body_timeout_s``). A case "hangs"
when no status line arrives within ``--hang-s`` seconds after its last byte was sent.

    python bench/fuzz_http.py                  # prints a histogram by status, then ">=500: N" and "hangs: N"
    python bench/fuzz_http.py --limit 300      # a quick subset

Loopback only; the count and the time are bounded (``--limit``, ``--deadline-s``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

PATH = b"/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
HOSTILE_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**64,
    -(2**63),
    1e308,
    -1e308,
    0.5,
    1e-320,
    "",
    "x",
    "a" * 100_000,
    "\u0000",
    "\ud7ff\ue000",
    "😀" * 1000,
    [],
    [1],
    [None],
    {},
    {"a": 1},
    [[[[]]]],
    {"role": "user"},
    "<|im_end|>",
    "<tool_call>{}</tool_call>",
]
FIELDS = [
    "messages",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "seed",
    "stop",
    "stop_token_ids",
    "session_id",
    "user",
    "turn_type",
    "session_done",
    "response_format",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "parallel_tool_calls",
    "functions",
    "metadata",
    "unknown_field",
]
MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"]
HEADER_NAMES = [
    b"X-Session-Id",
    b"x_session_id",
    b"X-Request-Id",
    b"serve_multiplexed_model_id",
    b"serve-multiplexed-model-id",
    b"X-Request-Timeout-Seconds",
    b"X-Request-Disconnect-Disabled",
    b"traceparent",
    b"X-Turn-Type",
    b"X-Session-Done",
    b"X-Session-Token",
    b"Authorization",
    b"Content-Type",
    b"Origin",
    b"Host",
    b"User-Agent",
    b"Accept",
    b"Accept-Encoding",
    b"Cookie",
    b"X-Forwarded-For",
    b"Content-Length",
    b"Transfer-Encoding",
    b"Connection",
    b"Expect",
]
BAD_BYTES = [b"\xff", b"\x80", b"\xc3\x28", b"\xed\xa0\x80", b"a\xfe\xfeb", b"\xf8\x88\x80\x80\x80"]


def request(
    body: bytes = b"",
    *,
    method: bytes = b"POST",
    path: bytes = PATH,
    headers: list[bytes] = (),
    content_type: bytes | None = b"application/json",
    host: bytes = b"127.0.0.1",
    length: int | None = None,
) -> bytes:
    """One raw HTTP/1.1 request (``Connection: close``); ``length`` overrides Content-Length."""
    lines = [method + b" " + path + b" HTTP/1.1", b"Host: " + host, b"Connection: close"]
    if content_type is not None:
        lines.append(b"Content-Type: " + content_type)
    lines += list(headers)
    lines.append(b"Content-Length: %d" % (len(body) if length is None else length))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def body(**fields) -> bytes:
    return json.dumps({"messages": MSG, "max_tokens": 2, **fields}).encode()


def corpus(rng: random.Random) -> list[tuple[str, bytes, float]]:
    """``(kind, raw request, seconds between the bytes of its body)`` for every case."""
    cases: list[tuple[str, bytes, float]] = []

    def add(kind, raw, trickle=0.0):
        cases.append((kind, raw, trickle))

    for raw in [
        b"",
        b"{",
        b"}",
        b"[]",
        b"null",
        b"1",
        b'"x"',
        b"{'messages': []}",
        b'{"messages": [}',
        b"\xff\xfe{}",
        b"\xef\xbb\xbf" + body(),
        b'{"messages": NaN}',
        b'{"max_tokens": Infinity}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 5000 + b"1" + b"}" * 5000,
        body() + b"garbage",
        b'{"messages": [{"role": "user", "content": "\xff"}]}',
        b'{"messages": "\\ud800"}',
        b'{"messages": [], "messages": 1}',
        b"\x00" * 100,
        b"a" * 10_000,
    ]:
        add("malformed_json", request(raw))
    for field in FIELDS:
        for value in HOSTILE_VALUES:
            add("field_value", request(body(**{field: value})))
            add("field_value_stream", request(body(**{"stream": True, field: value})))
    for field in MESSAGE_FIELDS:
        for value in HOSTILE_VALUES:
            add(
                "message_value",
                request(
                    json.dumps({"messages": [{"role": "user", "content": "a", field: value}], "max_tokens": 2}).encode()
                ),
            )
            add(
                "message_history",
                request(
                    json.dumps(
                        {
                            "messages": [
                                {"role": "user", "content": "a"},
                                {"role": "assistant", "content": "b", field: value},
                                {"role": "user", "content": "c"},
                            ],
                            "max_tokens": 2,
                        }
                    ).encode()
                ),
            )
    for messages in [
        [],
        [{}],
        [{"role": "tool", "content": "x"}],
        [{"role": "assistant", "tool_calls": [{}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "system", "content": "s"}] * 500,
        [{"role": "user", "content": "x " * 200_000}],
        [{"role": "user", "content": "a"}] * 5000,
    ]:
        add("messages", request(body(messages=messages)))
    for name in HEADER_NAMES:
        for bad in BAD_BYTES:
            add("header_bytes", request(body(), headers=[name + b": v" + bad + b"v"]))
        add("header_nul", request(body(), headers=[name + b": a\x00b"]))
        add("header_ctrl", request(body(), headers=[name + b": a\x01\x7fb"]))
    for bad in BAD_BYTES:
        add("header_name_bytes", request(body(), headers=[b"X-" + bad + b": v"]))
    for size in [8_000, 16_000, 17_000, 65_000, 200_000, 1 << 20]:
        add("header_size", request(body(), headers=[b"X-Big: " + b"a" * size]))
        add("session_id_size", request(body(), headers=[b"X-Session-Id: " + b"s" * size]))
    for count in [99, 101, 150, 500, 2000, 5000]:
        add("header_count", request(body(), headers=[b"X-H%d: v" % i for i in range(count)]))
    for line in [
        b"NoColon",
        b" Leading: space",
        b"Space : before",
        b"X-A: a\rb",
        b"X-A:\x0bv",
        b": empty",
        b"Content-Length: -1",
        b"Content-Length: abc",
        b"Content-Length: 1, 2",
        b"Transfer-Encoding: chunked",
        b"Transfer-Encoding: gzip",
        b"Expect: 100-continue",
        b"Content-Length: 99999999999999999999",
    ]:
        add("header_syntax", request(body(), headers=[line]))
    for ctype in [
        None,
        b"text/plain",
        b"text/plain; charset=utf-8",
        b"application/x-www-form-urlencoded",
        b"multipart/form-data; boundary=x",
        b"application/jsonx",
        b"application/json;",
        b"APPLICATION/JSON",
        b"application/json; charset=latin-1",
        b"*/*",
        b"",
        b"application/xml",
        b"json",
    ]:
        add("content_type", request(body(), content_type=ctype))
    for method in [b"GET", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"HEAD", b"TRACE", b"CONNECT", b"FOO", b"post"]:
        for path in [PATH, b"/v1/models", b"/health", b"/", b"/v1/chat/completions/", b"/v1/completions"]:
            add("method_path", request(body(), method=method, path=path))
    for path in [
        b"/../../etc/passwd",
        b"/v1/chat/completions?x=%ff%fe",
        b"/%ff",
        b"/v1/" + b"a" * 100_000,
        b"http://evil/v1/chat/completions",
        b"*",
        b"/v1/chat/completions#frag",
        b"//v1/chat/completions",
        b"/v1/chat/completions;x",
        b"/\xff\xfe",
    ]:
        add("path", request(body(), path=path))
    for origin in [b"http://evil.example", b"null", b"http://127.0.0.1.evil.example", b"file://", b"\xff"]:
        add("origin", request(body(), headers=[b"Origin: " + origin]))
    for host in [b"evil.example", b"127.0.0.1.nip.io:8000", b"localhost.evil", b"", b"[::1", b"a" * 5000]:
        add("host", request(body(), host=host))
    for token in [b"", b"x", b"a" * 10_000, b"\xff"]:
        add("session_token", request(body(), headers=[b"X-Session-Id: fuzz-bound", b"X-Session-Token: " + token]))
    for auth in [b"Bearer", b"Bearer " + b"k" * 10_000, b"Basic Zm9vOmJhcg==", b"\xff"]:
        add("authorization", request(body(), headers=[b"Authorization: " + auth]))
    add("body_too_large", request(body(messages=[{"role": "user", "content": "x" * (2 << 20)}])))
    add("declared_too_large", request(body(), length=1 << 40))
    add("declared_shorter", request(body(), length=5))
    add("declared_longer", request(body(), length=len(body()) + 100))  # waits for bytes that never come: 408
    for _ in range(8):  # slow clients, one session: each must get 408, none may block the others
        add("slow_body", request(body(), headers=[b"X-Session-Id: fuzz-slow"]), trickle=0.4)
    for _ in range(300):  # random byte mutations of a valid request
        raw = bytearray(request(body(), headers=[b"X-Session-Id: fuzz-mut"]))
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        add("mutation", bytes(raw))
    return cases


def send(port: int, raw: bytes, trickle: float, hang_s: float) -> int | str:
    """Send one case; returns its status code, ``"closed"`` (the server closed without a status line,
    e.g. h11 dropping an unparsable request) or ``"hang"``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=hang_s) as s:
            head_end = raw.find(b"\r\n\r\n") + 4
            try:
                if trickle:
                    s.sendall(raw[:head_end])
                    for i in range(head_end, len(raw)):
                        s.sendall(raw[i : i + 1])
                        time.sleep(trickle)
                else:
                    s.sendall(raw)
            except OSError:  # the server answered early and closed (431, 413, 408...)
                pass
            data = b""
            while b"\r\n" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except socket.timeout:
        return "hang"
    except ConnectionResetError:
        return "closed"
    if not data.startswith(b"HTTP/1.1 "):
        return "closed"
    return int(data.split(b" ", 2)[1])


def start_server(body_timeout_s: float) -> int:
    """The tiny model on an hf RolloutEngine behind the PolicyServer; returns its port."""
    import ray

    from clawray.actors.judge import JudgeWorkerActor
    from clawray.actors.queue import TrajectoryQueueActor
    from clawray.actors.rollout import RolloutEngineActor
    from clawray.actors.session import SessionTrackerActor
    from clawray.model_folders import build_tiny_model
    from clawray.ray_env import free_port, init_ray
    from clawray.config import ServeConfig
    from clawray.serve.deploy import start_policy_server

    model = build_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"))
    init_ray("", 2)
    engine = RolloutEngineActor.options(num_cpus=0.5).remote(model, {"backend": "hf", "torch_threads": 1})
    ray.get(engine.ready.remote())
    judge = JudgeWorkerActor.options(num_cpus=0).remote({"backend": "feedback", "m": 1})
    tracker = SessionTrackerActor.options(num_cpus=0).remote(
        [judge], TrajectoryQueueActor.options(num_cpus=0).remote(2), records_dir=tempfile.mkdtemp()
    )
    port = free_port()
    cfg = ServeConfig(
        model_name="m",
        default_max_tokens=4,
        default_temperature=1.0,
        generate_timeout_s=120,
        max_body_mb=1.0,
        api_key="",
        body_timeout_s=body_timeout_s,
        host="127.0.0.1",
        port=port,
        num_cpus=0.1,
        allowed_origins=[],
        session_binding="echo",
    )
    max_model_len = 128
    start_policy_server(model, [engine], tracker, cfg, max_model_len)
    return port


def main() -> int:
    from clawray.ray_env import apply_loopback_env

    apply_loopback_env()  # before Ray is imported by the server set-up
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=0, help="send at most this many cases (0: all)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--hang-s", type=float, default=60.0, help="no status line this long after the last byte")
    ap.add_argument("--body-timeout-s", type=float, default=2.0, help="the server's serve.body_timeout_s")
    ap.add_argument("--deadline-s", type=float, default=1200.0, help="stop sending new cases after this long")
    args = ap.parse_args()
    cases = corpus(random.Random(0))
    random.Random(1).shuffle(cases)
    if args.limit:
        cases = cases[: args.limit]
    port = start_server(args.body_timeout_s)
    t0 = time.monotonic()
    results: list[tuple[str, int | str]] = []

    def one(case):
        kind, raw, trickle = case
        if time.monotonic() - t0 > args.deadline_s:
            return kind, "skipped"
        return kind, send(port, raw, trickle, args.hang_s)

    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(one, cases))
    wall = time.monotonic() - t0
    alive = send(port, request(body()), 0.0, args.hang_s)
    by_status = Counter(str(status) for _, status in results)
    by_kind: dict[str, Counter] = {}
    for kind, status in results:
        by_kind.setdefault(kind, Counter())[str(status)] += 1
    for kind in sorted(by_kind):
        print(f"{kind:>20}: " + ", ".join(f"{s}x{n}" for s, n in sorted(by_kind[kind].items())))
    server_errors = sum(n for s, n in by_status.items() if s.isdigit() and int(s) >= 500)
    print(
        f"cases: {len(results)} in {wall:.0f} s (skipped {by_status.get('skipped', 0)}); by status: "
        + ", ".join(f"{s}x{n}" for s, n in sorted(by_status.items()))
        + f"; a valid request afterwards: {alive}"
    )
    print(f">=500: {server_errors}")
    print(f"hangs: {by_status.get('hang', 0)}")
    return int(server_errors > 0 or by_status.get("hang", 0) > 0 or alive != 200)


if __name__ == "__main__":
    sys.exit(main())

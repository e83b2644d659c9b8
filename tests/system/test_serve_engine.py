"""The endpoint and the engine under clients that hang up and engines that fail: a disconnect (plain
or streamed) stops the generation in the engine and records nothing; a failing request fails alone,
with a clean error, and the engine goes on serving."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray

from clawray.engines.base import GenerateOutput, GenerateRequest, SteppedBackend, StepOutput
from conftest import MASKED_SESSIONS, shared_serve

LONG = 1900  # tokens a hung-up client asked for


@pytest.fixture(scope="module")
def serve_root(ray_cluster):
    """The session's Ray Serve (conftest.shared_serve) for this module's apps; each test deletes its own."""
    return shared_serve()


@pytest.fixture(scope="module")
def server(serve_root, tiny_model, tmp_path_factory):
    """A PolicyServer on the tiny model's hf RolloutEngine (1 thread), with its own tracker."""
    from ray import serve

    from clawray.actors.judge import JudgeWorkerActor
    from clawray.actors.queue import TrajectoryQueueActor
    from clawray.actors.rollout import RolloutEngineActor
    from clawray.actors.session import SessionTrackerActor
    from clawray.config import ServeConfig
    from clawray.serve.app import PolicyServer

    tmp = tmp_path_factory.mktemp("serve_engine")
    engine = RolloutEngineActor.options(num_cpus=0.25).remote(tiny_model, {"backend": "hf", "torch_threads": 1})
    judge = JudgeWorkerActor.options(num_cpus=0).remote({"backend": "feedback", "m": 1})
    queue = TrajectoryQueueActor.options(num_cpus=0).remote(2)
    tracker = SessionTrackerActor.options(num_cpus=0).remote(
        [judge], queue, MASKED_SESSIONS, records_dir=str(tmp / "records")
    )
    ray.get(engine.ready.remote())
    cfg = ServeConfig(
        model_name="tiny",
        default_max_tokens=100,
        default_temperature=1.0,
        generate_timeout_s=120,
        max_body_mb=1.0,
        api_key="",
        sync_wait_timeout_s=5.0,
        retry_after_s=2,
        max_n=4,
    )
    max_model_len = 2048
    serve.run(
        PolicyServer.options(ray_actor_options={"num_cpus": 0}).bind(tiny_model, [engine], tracker, cfg, max_model_len),
        name="engine",
        route_prefix="/e",
    )
    yield {"base": f"{serve_root}/e", "engine": engine, "tracker": tracker}
    serve.delete("engine")
    ray.kill(engine)


def _body(text: str, max_tokens: int, **kw) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, **kw}


async def _hang_up(base: str, engine, stream: bool) -> None:
    """Send 3 long greedy requests and disconnect once the engine is generating all 3 (its own
    ``in_flight`` gauge and step counter, not a timer: on a fast machine the tiny model writes the
    1900 tokens in about a second)."""
    url = f"{base}/v1/chat/completions"
    steps_before = (await engine.stats.remote())["steps"]

    async def one(i: int) -> str:
        headers, body = {"X-Session-Id": f"gone-{i}"}, _body(f"count, {i}", LONG)
        async with httpx.AsyncClient(timeout=60) as client:
            if stream:
                async with client.stream("POST", url, headers=headers, json={**body, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        assert line != "data: [DONE]", "the stream ended before the hang-up"
            else:
                await client.post(url, headers=headers, json=body)
        return "finished before the hang-up"

    async def generating():
        st = await engine.stats.remote()
        return st["in_flight"] >= 3 and st["steps"] - steps_before >= 3

    tasks = [asyncio.create_task(one(i)) for i in range(3)]
    running = await _wait_for(generating, 30.0)
    for t in tasks:
        t.cancel()  # leaving the client's block closes the connection mid-reply
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert running, "the 3 long requests never ran together"
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results


async def _wait_for(pred, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await pred()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_clients_that_hang_up_free_the_engine(server, stream):
    engine, base = server["engine"], server["base"]
    before = ray.get(engine.stats.remote())
    turns_before = ray.get(server["tracker"].stats.remote()).get("turns", 0)

    async def scenario():
        await _hang_up(base, engine, stream)
        engine_stats = lambda: engine.stats.remote()  # noqa: E731

        async def all_cancelled():
            st = await engine_stats()
            return st if st.get("cancelled", 0) - before.get("cancelled", 0) == 3 else None

        stopped = await _wait_for(all_cancelled)
        t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=60) as client:
            r = await client.post(f"{base}/v1/chat/completions", json=_body("hi", 1))
        return stopped, time.perf_counter() - t0, r

    stopped, latency, r = asyncio.run(scenario())
    print(f"1-token request after 3 hang-ups: {latency:.3f} s")
    assert stopped is not None, f"the engine did not stop the 3 abandoned generations: {ray.get(engine.stats.remote())}"
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    assert latency < 2.0  # before the fix: 3 x 1900 tokens queued ahead of it (7.98 s measured)
    after = ray.get(engine.stats.remote())
    assert after["requests"] - before["requests"] == 1  # only the 1-token request finished
    assert after["tokens"] - before["tokens"] < 3 * LONG // 2  # the abandoned ones stopped early
    health = httpx.get(f"{base}/health", timeout=30).json()
    assert health["counts"]["cancelled"] >= 3 and health["engines"][0]["cancelled"] >= 3
    # only the 1-token reply was recorded as a turn; the hung-up sessions have none
    assert ray.get(server["tracker"].stats.remote()).get("turns", 0) - turns_before == 1


# ------------------------------------------------------------------------------ engine failures
class _FlakyBackend(SteppedBackend):
    """Fails any step while a prompt that starts with 666 runs; otherwise each request's one token is
    its prompt's last id."""

    def __init__(self):
        self.runs: dict[int, GenerateRequest] = {}

    def add(self, key, request):
        self.runs[key] = request

    def can_add(self):
        return True

    def abort(self, keys):
        pass  # every request ends in the next step anyway

    def clear(self):
        self.runs.clear()

    def step(self):
        if any(r.prompt_ids[0] == 666 for r in self.runs.values()):
            raise RuntimeError("CPU Generator does not use offset (at /secret/path.py line 1)")
        out = StepOutput()
        for key, r in self.runs.items():
            out.new_tokens[key] = [r.prompt_ids[-1]]
            out.finished[key] = GenerateOutput([r.prompt_ids[-1]], [-0.5], "length")
        self.runs.clear()
        return out


def test_a_failing_request_fails_alone_and_the_engine_goes_on(monkeypatch):
    import clawray.engines as engines
    from clawray.actors.rollout import EngineError, RolloutEngine

    monkeypatch.setattr(engines, "make_backend", lambda *a, **k: _FlakyBackend())

    async def scenario():
        engine = RolloutEngine("nowhere", {"max_batch_size": 8}, backend="fake")
        await engine.ready()
        await engine.pause()  # queue all three so they share one batch
        calls = [
            asyncio.ensure_future(engine.generate(GenerateRequest(p, max_tokens=1)))
            for p in ([1, 11], [666, 12], [2, 13])
        ]
        await asyncio.sleep(0.1)
        await engine.resume()
        results = await asyncio.gather(*calls, return_exceptions=True)
        later = await engine.generate(GenerateRequest([3, 14], max_tokens=1))
        return results, later, await engine.stats()

    (ok1, bad, ok2), later, stats = asyncio.run(scenario())
    assert ok1["response_ids"] == [11] and ok2["response_ids"] == [13] and later["response_ids"] == [14]
    assert isinstance(bad, EngineError) and str(bad) == "the engine failed on this request (RuntimeError)"
    assert stats["errors"] == 1 and stats["requests"] == 3


def test_queued_cancelled_requests_never_start(monkeypatch):
    import threading

    import clawray.engines as engines
    from clawray.actors.rollout import RolloutEngine

    seen = []

    class Recorder(_FlakyBackend):
        def add(self, key, request):
            seen.append(request.prompt_ids[0])
            super().add(key, request)

    monkeypatch.setattr(engines, "make_backend", lambda *a, **k: Recorder())

    async def scenario():
        engine = RolloutEngine("nowhere", backend="fake")
        await engine.ready()
        gate = threading.Event()
        blocker = asyncio.ensure_future(engine._call(gate.wait))  # holds the engine thread
        calls = [asyncio.ensure_future(engine.generate(GenerateRequest([p, 9], max_tokens=1))) for p in (1, 2, 3)]
        await asyncio.sleep(0.05)  # all three queued behind the blocker
        calls[1].cancel()
        await asyncio.sleep(0)
        gate.set()
        results = await asyncio.gather(*calls, return_exceptions=True)
        await blocker
        return results, await engine.stats()

    results, stats = asyncio.run(scenario())
    assert isinstance(results[1], asyncio.CancelledError) and results[0]["response_ids"] == [9]
    assert seen == [1, 3]
    assert stats["cancelled"] == 1 and stats["requests"] == 2


# ------------------------------------------------------------------------------ vLLM through the endpoint
@pytest.fixture(scope="module")
def vllm_servers(serve_root, tmp_path_factory):
    """Two PolicyServers on vLLM-CPU engines of a tiny Qwen2 (float32): ``default`` (clawray's engine
    settings) and ``chunked`` (chunked prefill forced on with a 256-token step budget, so a seeded
    long prompt fails inside vLLM: the failure kind of a real engine error)."""
    pytest.importorskip("vllm")
    from ray import serve
    from test_engine_vllm import _build_tiny_model
    from transformers import AutoTokenizer

    from clawray.actors.judge import JudgeWorkerActor
    from clawray.actors.queue import TrajectoryQueueActor
    from clawray.actors.rollout import RolloutEngineActor
    from clawray.actors.session import SessionTrackerActor
    from clawray.model_folders import CHAT_TEMPLATE
    from clawray.config import ServeConfig
    from clawray.serve.app import PolicyServer

    path = str(tmp_path_factory.mktemp("vllm_tiny"))
    _build_tiny_model(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    rollout = {"backend": "vllm", "torch_threads": 1, "dtype": "float32", "max_model_len": 1024, "kv_cache_gib": 0.25}
    engines = {
        "default": RolloutEngineActor.options(num_cpus=0.25).remote(path, rollout, name="vllm-default"),
        "chunked": RolloutEngineActor.options(num_cpus=0.25).remote(
            path,
            rollout,
            name="vllm-chunked",
            engine_kwargs={"enable_chunked_prefill": True, "max_num_batched_tokens": 256, "max_num_seqs": 16},
        ),
    }
    ray.get([e.ready.remote() for e in engines.values()])
    judge = JudgeWorkerActor.options(num_cpus=0).remote({"backend": "feedback", "m": 1})
    cfg = ServeConfig(
        model_name="tiny",
        default_max_tokens=8,
        default_temperature=1.0,
        generate_timeout_s=120,
        max_body_mb=1.0,
        api_key="",
        sync_wait_timeout_s=5.0,
        retry_after_s=2,
        max_n=4,
    )
    max_model_len = 1024
    for name, engine in engines.items():
        tracker = SessionTrackerActor.options(num_cpus=0).remote(
            [judge],
            TrajectoryQueueActor.options(num_cpus=0).remote(2),
            MASKED_SESSIONS,
            records_dir=str(tmp_path_factory.mktemp(name)),
        )
        serve.run(
            PolicyServer.options(ray_actor_options={"num_cpus": 0}).bind(path, [engine], tracker, cfg, max_model_len),
            name=f"vllm-{name}",
            route_prefix=f"/{name}",
        )
    yield {name: (f"{serve_root}/{name}", engine) for name, engine in engines.items()}
    for name, engine in engines.items():
        serve.delete(f"vllm-{name}")
        ray.kill(engine)


def _long(i: int) -> str:
    return f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 94  # ~860 tokens


async def _post_all(base: str, bodies: list[dict], engine=None) -> list[httpx.Response]:
    """POST all bodies at once; with ``engine``, hold it paused for 2 s so they all land in one batch."""
    async with httpx.AsyncClient(timeout=120) as client:
        if engine is not None:
            await engine.pause.remote()
        posts = asyncio.gather(*(client.post(f"{base}/v1/chat/completions", json=b) for b in bodies))
        if engine is not None:
            await asyncio.sleep(2.0)
            await engine.resume.remote()
        return await posts


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_seeded_long_prompts_at_once_are_served(vllm_servers):
    """Before: HTTP 500 'CPU Generator does not use offset' (traceback in the body), then every
    request timed out. 16 seeded ~860-token prompts at once exceed a step's token budget (4096)."""
    base, engine = vllm_servers["default"]
    bodies = [{"messages": [{"role": "user", "content": _long(i)}], "seed": i, "max_tokens": 4} for i in range(16)]
    replies = asyncio.run(_post_all(base, bodies, engine))
    assert [r.status_code for r in replies] == [200] * 16, [r.text[:300] for r in replies if r.status_code != 200]
    again = asyncio.run(_post_all(base, bodies[:1]))[0]
    assert again.json()["choices"][0]["message"] == replies[0].json()["choices"][0]["message"]  # seeds reproduce


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_error_fails_one_request_cleanly_and_the_engine_goes_on(vllm_servers):
    base, engine = vllm_servers["chunked"]
    seeded = {"messages": [{"role": "user", "content": _long(0)}], "seed": 3, "max_tokens": 4}
    plain = [{"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4} for i in range(3)]
    replies = asyncio.run(_post_all(base, [seeded, *plain], engine))  # the failing one shares a batch
    bad = replies[0]
    assert bad.status_code == 500
    assert bad.json() == {
        "error": {
            "message": "the policy engine failed on this request",
            "type": "server_error",
            "param": None,
            "code": "engine_error",
        }
    }
    assert [r.status_code for r in replies[1:]] == [200] * 3
    after = asyncio.run(_post_all(base, [{**seeded, "seed": None}, *plain[:1]]))  # long unseeded prompt: works
    assert [r.status_code for r in after] == [200, 200]
    health = httpx.get(f"{base}/health", timeout=30).json()
    assert health["engines"][0]["state"] == "serving" and health["engines"][0]["errors"] == 1
    assert health["counts"]["engine_errors"] == 1


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_top_p_replies_that_fill_the_context_are_served(vllm_servers):
    """Top-p replies (T > 0) cut by the context window: before, the re-score of prompt + response
    (``max_model_len`` tokens) was refused by vLLM and each such choice failed (HTTP 500 engine_error).
    Here ``max_model_len`` (1024) is the model's own maximum, so a top-p reply stops one token short."""
    base, _ = vllm_servers["default"]
    body = {
        "messages": [{"role": "user", "content": _long(7)}],
        "max_tokens": 1000,
        "temperature": 1.5,
        "top_p": 0.95,
        "n": 4,
        "seed": 1,
    }
    (reply,) = asyncio.run(_post_all(base, [body]))
    assert reply.status_code == 200, reply.text[:300]
    out = reply.json()
    assert [c["finish_reason"] for c in out["choices"]] == ["length"] * 4
    assert out["usage"]["completion_tokens"] == 4 * (1023 - out["usage"]["prompt_tokens"])  # 4 x 149

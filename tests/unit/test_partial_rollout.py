"""Partial rollouts (``sync.mode: interrupt``): a weight sync stops the running generations at their
current token, loads the new weights and continues the same requests; each token keeps the
log-prob and the policy version of the weights that sampled it, and staleness counts from the
oldest token. The engine runs in this process (hf backend, tiny model); the "transport" hands the
engine a perturbed copy of its own weights."""

from __future__ import annotations

import asyncio

import pytest
import torch

from clawray.actors.rollout import RolloutEngine, continue_request
from clawray.engines.base import GenerateRequest
from clawray.types import Sample, SampleMeta, Turn

PROMPT = [5, 6, 7, 8]


class _LocalTransport:
    """Stands in for a weight-sync transport: ``receive`` yields the given state dict."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def receive(self, expected_version: int):
        return list(self.state.items())

    def done(self, ok: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = RolloutEngine(tiny_model, {"backend": "hf", "torch_threads": 1})
    loop = asyncio.new_event_loop()
    loop.run_until_complete(eng.ready())
    yield eng, loop
    eng._jobs.put(None)
    loop.close()


def _score(engine: RolloutEngine, state: dict, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Log-probs of ``response`` after ``prompt`` under ``state`` (one forward pass, T = 1)."""
    backend = engine._backend
    backend.model.load_state_dict(state)
    return torch.tensor(backend.logprobs(prompt, response, 1.0))


def test_a_sync_interrupts_a_long_generation_which_continues_on_the_new_weights(engine):
    eng, loop = engine
    v0 = {k: v.clone() for k, v in eng._backend.model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    v1 = {
        k: v + 0.1 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone() for k, v in v0.items()
    }
    eng._transport = _LocalTransport(v1)
    # no stop ids and no eos in the tiny model's reach: both requests run to max_tokens
    eng._backend.eos_ids = []
    streamed: list[int] = []

    async def consume(stream) -> dict:
        async for item in stream:
            streamed.extend(item.get("token_ids", []))
            if item.get("done"):
                await stream.aclose()
                return item
        raise AssertionError("the stream ended without its final item")

    async def scenario():
        stream = eng.generate_stream(GenerateRequest(PROMPT, max_tokens=60, temperature=1.0, seed=3))
        assert await stream.__anext__() == {"admitted": True}
        reader = asyncio.ensure_future(consume(stream))
        queued = asyncio.ensure_future(eng.generate(GenerateRequest([9, 10, 11], max_tokens=8, temperature=1.0)))
        while len(streamed) < 5:
            await asyncio.sleep(0.005)
        await eng.pause(interrupt=True)
        loaded = await eng.receive_weights(1)
        await asyncio.sleep(0.3)  # paused and interrupted: the reader gets every v0 token, no new one is sampled
        at_sync = len(streamed)
        await eng.resume()
        return await reader, loaded, at_sync, await queued

    final, loaded, at_sync, queued = loop.run_until_complete(scenario())
    # one uninterrupted reply: the stream's ids are the reply's ids, max_tokens long
    assert final["response_ids"] == streamed and len(streamed) == 60 and final["finish_reason"] == "length"
    versions = final["token_versions"]
    k = versions.index(1)
    # the versions switch exactly once, at the sync: every token streamed before the load is v0
    assert versions == [0] * k + [1] * (60 - k) and k == at_sync and 5 <= k < 60
    assert final["policy_version"] == 0  # the oldest token's version
    assert loaded["interrupted"] == 2 and loaded["version"] == 1  # the stream and the queued request
    # each token's stored log-prob is its own version's scoring of it
    ids, lps = final["response_ids"], torch.tensor(final["logprobs"])
    torch.testing.assert_close(lps[:k], _score(eng, v0, PROMPT, ids[:k]), atol=1e-5, rtol=0)
    v1_scores = _score(eng, v1, PROMPT + ids[:k], ids[k:])
    torch.testing.assert_close(lps[k:], v1_scores, atol=1e-5, rtol=0)
    # and not the other version's (so the check above can tell them apart)
    assert (lps[k:] - _score(eng, v0, PROMPT + ids[:k], ids[k:])).abs().max() > 1e-2
    # the request queued behind it did not start before the load: all of it is v1
    assert queued["token_versions"] == [1] * 8 and queued["policy_version"] == 1
    torch.testing.assert_close(
        torch.tensor(queued["logprobs"]), _score(eng, v1, [9, 10, 11], queued["response_ids"]), atol=1e-5, rtol=0
    )
    stats = loop.run_until_complete(eng.stats())
    assert stats["interrupted"] == 2 and stats["requests"] == 2 and stats["cancelled"] == 0
    # every token sampled once: the interrupt lost none, the continuation repeated none
    assert stats["tokens"] == 60 + 8
    eng._backend.model.load_state_dict(v1)  # the engine serves v1 (the scoring above swapped weights)


def test_an_inflight_load_goes_on_with_the_running_reply_its_kv_recomputed_on_the_new_weights(engine):
    """``sync.mode: inflight`` (no pause): the reply stays one request; each token after the load is
    sampled, and its log-prob computed, from the new weights over prompt + tokens so far (the KV of
    the old weights is not reused: the log-probs equal v1's own scoring, not v0-KV mixtures)."""
    eng, loop = engine
    v1 = {k: v.clone() for k, v in eng._backend.model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    v2 = {
        k: v + 0.1 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone() for k, v in v1.items()
    }
    eng._transport = _LocalTransport(v2)
    eng._backend.eos_ids = []
    streamed: list[int] = []

    async def scenario():
        stream = eng.generate_stream(GenerateRequest(PROMPT, max_tokens=40, temperature=1.0, seed=5))
        assert await stream.__anext__() == {"admitted": True}
        final = None
        async for item in stream:
            streamed.extend(item.get("token_ids", []))
            if len(streamed) >= 5 and not loading:
                loading.append(asyncio.ensure_future(eng.receive_weights(2, inflight=True)))
            if item.get("done"):
                final = item
        return final, await loading[0]

    loading: list[asyncio.Future] = []
    stats0 = loop.run_until_complete(eng.stats())
    final, loaded = loop.run_until_complete(scenario())
    assert final["response_ids"] == streamed and len(streamed) == 40 and final["finish_reason"] == "length"
    versions = final["token_versions"]
    k = versions.index(2)
    assert versions == [1] * k + [2] * (40 - k) and 5 <= k < 40 and final["policy_version"] == 1
    assert loaded["version"] == 2 and loaded["inflight"] == 1 and loaded["interrupted"] == 0
    ids, lps = final["response_ids"], torch.tensor(final["logprobs"])
    torch.testing.assert_close(lps[:k], _score(eng, v1, PROMPT, ids[:k]), atol=1e-5, rtol=0)
    # re-prefill vs one forward pass: float32 noise up to ~1e-5 (a stale v1 KV would be off by > 1e-2)
    torch.testing.assert_close(lps[k:], _score(eng, v2, PROMPT + ids[:k], ids[k:]), atol=1e-4, rtol=0)
    stats = loop.run_until_complete(eng.stats())
    assert stats["requests"] - stats0["requests"] == 1 and stats["interrupted"] == stats0["interrupted"]
    assert stats["tokens"] - stats0["tokens"] == 40
    eng._backend.model.load_state_dict(v2)


def _turn(versions: list[int]) -> Turn:
    return Turn(
        session_id="s",
        turn_index=1,
        messages=[],
        response_message={},
        prompt_ids=PROMPT,
        response_ids=[20 + i for i in range(len(versions))],
        rollout_logprobs=[-1.0] * len(versions),
        policy_version=min(versions),
        finish_reason="stop",
        token_versions=versions,
    )


def test_staleness_of_a_partial_rollout_counts_from_its_oldest_token():
    """Tokens sampled by v0 and v1: trained into v2 its staleness is 2 (not 1), so a cap of 1 drops it."""
    from clawray.actors.queue import TrajectoryQueue
    from clawray.serve.call import mixed_versions as _mixed_versions

    out = {"response_ids": [20, 21, 22, 23], "token_versions": [0, 0, 1, 1], "policy_version": 0}
    assert _mixed_versions(out) == [0, 0, 1, 1]
    assert _mixed_versions({**out, "token_versions": [1, 1, 1, 1], "policy_version": 1}) is None
    sample = Sample.from_turn(_turn([0, 0, 1, 1]), reward=1.0)
    assert sample.policy_version == 0 and sample.token_versions == [0, 0, 1, 1]

    async def scenario(cap: int):
        q = TrajectoryQueue(max_staleness=cap)
        await q.put(["partial"], SampleMeta.of(sample))
        return await q.get_batch(1, next_version=2, timeout_s=0.05), await q.stats()

    batch, _ = asyncio.run(scenario(2))
    assert batch["staleness"] == [2]
    batch, stats = asyncio.run(scenario(1))
    assert batch is None and stats["dropped"] == {"stale": 1}


def test_a_sample_whose_version_is_not_its_oldest_token_is_refused():
    with pytest.raises(ValueError, match="policy_version 1 is not the oldest token version 0"):
        Sample(
            tokens=PROMPT + [20, 21],
            prompt_len=4,
            loss_mask=[1, 1],
            rollout_logprobs=[-1.0, -1.0],
            reward=1.0,
            policy_version=1,
            token_versions=[0, 1],
        )
    with pytest.raises(ValueError, match="token_versions has length 1, expected R=2"):
        Sample(
            tokens=PROMPT + [20, 21],
            prompt_len=4,
            loss_mask=[1, 1],
            rollout_logprobs=[-1.0, -1.0],
            reward=1.0,
            policy_version=0,
            token_versions=[0],
        )


def test_continue_request_resubmits_the_prompt_plus_the_tokens_so_far():
    req = GenerateRequest(PROMPT, max_tokens=10, temperature=0.7, top_p=0.9, stop_token_ids=[2], seed=5)
    assert continue_request(req, []) is req
    nxt = continue_request(req, [20, 21, 22])
    assert (nxt.prompt_ids, nxt.max_tokens, nxt.temperature, nxt.top_p, nxt.stop_token_ids) == (
        PROMPT + [20, 21, 22],
        7,
        0.7,
        0.9,
        [2],
    )
    assert nxt.seed == continue_request(req, [20, 21, 22]).seed != 5  # deterministic, a fresh stream
    assert req.prompt_ids == PROMPT  # the original request is left as it was
    with pytest.raises(ValueError, match="nothing left to continue"):
        continue_request(req, list(range(10)))


def test_an_unknown_sync_mode_is_refused():
    from clawray.config import load_config
    from clawray.weight_sync import WeightSyncController

    with pytest.raises(ValueError, match="unknown sync mode 'pause'"):
        WeightSyncController([], [], [], [], mode="pause")
    assert load_config(["conf/rl.yaml"], []).sync.mode == "interrupt"
    with pytest.raises(ValueError, match="sync.mode"):
        load_config(["conf/rl.yaml"], ["sync.mode=pause"])


def test_weight_specs_asked_before_the_backend_loaded_waits_for_it(monkeypatch):
    # the first call on a fresh engine may come before its thread has built the backend: it must wait
    # for the load, not read the still-None backend (AttributeError in test_security under load)
    import threading
    import time

    import clawray.engines

    loaded = threading.Event()

    class SlowBackend:
        def __init__(self, *a, **k):
            time.sleep(0.3)
            loaded.set()

        def weight_specs(self):
            return ["w0", "w1"]

    monkeypatch.setattr(clawray.engines, "make_backend", lambda *a, **k: SlowBackend())
    eng = RolloutEngine("unused", {"backend": "hf", "torch_threads": 1}, name="rollout-x")
    assert not loaded.is_set()
    assert asyncio.run(eng.weight_specs()) == ["w0", "w1"] and loaded.is_set()


def test_every_engine_samples_with_its_own_seed_and_a_restarted_one_with_a_fresh_one(tiny_model, monkeypatch):
    """Every rollout engine was seeded with the run's ``seed``: two engines answered an unseeded prompt
    with the same tokens (a duplicated sample, a zero-variance group), and an engine Ray restarted
    replayed its first life's stream. The seed is now per engine name, reproducible across runs."""
    from clawray import recovery
    from clawray.engines import engine_seed

    def reply(name: str) -> tuple[int, list[int]]:
        eng = RolloutEngine(tiny_model, {"backend": "hf", "torch_threads": 1}, name=name, seed=0)
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(eng.ready())
            out = loop.run_until_complete(eng.generate(GenerateRequest(PROMPT, max_tokens=12, temperature=1.0)))
            return eng.seed, out["response_ids"]
        finally:
            eng._jobs.put(None)
            loop.close()

    seed0, first = reply("rollout-0")
    seed1, other = reply("rollout-1")
    assert (seed0, seed1) == (engine_seed(0, "rollout-0"), engine_seed(0, "rollout-1")) and seed0 != seed1
    assert first != other  # 12 tokens at T = 1 over the tiny vocabulary: alike only by a fault
    assert reply("rollout-0") == (seed0, first)  # the same run seed and name: the same stream
    monkeypatch.setattr(recovery, "was_restarted", lambda: True)
    restarted, again = reply("rollout-0")
    assert restarted != seed0 and again != first


def test_the_engine_thread_runs_on_rollout_cpu_affinity_and_a_cpu_it_cannot_use_is_named(tiny_model):
    """``rollout.cpu_affinity=[0]``: the engine thread runs on CPU 0 only; the calling thread keeps its CPUs."""
    import os

    before = os.sched_getaffinity(0)
    eng = RolloutEngine(tiny_model, {"backend": "hf", "torch_threads": 1, "cpu_affinity": [0]})
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(eng.ready())
        assert os.sched_getaffinity(eng._thread.native_id) == {0}
        assert os.sched_getaffinity(0) == before
        out = loop.run_until_complete(
            eng.generate(GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=2, temperature=0.0))
        )
        assert len(out["response_ids"]) == 2
    finally:
        eng._jobs.put(None)
    # an id that cannot be used is refused, also beside a good one (the kernel would keep just CPU 0)
    for cpus, bad_ids in (([4096], "[4096]"), ([0, 4096], "[4096]"), ([-1], "[-1]"), ([2**40], f"[{2**40}]")):
        bad = RolloutEngine(tiny_model, {"backend": "hf", "torch_threads": 1, "cpu_affinity": cpus}, name="rollout-9")
        with pytest.raises(RuntimeError, match=rf"rollout-9: backend failed to start.*CPUs \{bad_ids}\ cannot be used"):
            loop.run_until_complete(bad.ready())
    loop.close()


def test_more_engine_threads_than_pinned_cpus_is_warned(tiny_model, caplog):
    eng = RolloutEngine(tiny_model, {"backend": "hf", "torch_threads": 2, "cpu_affinity": [0, 0]}, name="rollout-8")
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level("WARNING", logger="clawray.rollout"):
            loop.run_until_complete(eng.ready())
    finally:
        eng._jobs.put(None)
        loop.close()
    assert "rollout-8: rollout.torch_threads=2 on the 1 CPU(s) of rollout.cpu_affinity=[0]" in caplog.text

"""Weight transport (collective over gloo, object store, ipc), its metadata check, timeouts, and the
driver-side controller's failure reporting and recovery with two real (hf) RolloutEngine actors."""

import threading
import time

import pytest
import torch

from clawray.engines.base import WeightSpec
from clawray.ray_env import free_port
from clawray.weight_sync import (
    CollectiveTransport,
    ObjectStoreTransport,
    TransportSpec,
    WeightSyncError,
    check_plan,
    plan_buckets,
    plan_digest,
)


def specs():
    return [
        WeightSpec("a", (4, 4), "torch.float32"),
        WeightSpec("b", (8,), "torch.float32"),
        WeightSpec("c", (2, 2), "torch.bfloat16"),
        WeightSpec("d", (64,), "torch.float32"),
    ]


def make_state(plan, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=gen).to(getattr(torch, s.dtype[6:])) for s in plan}


def assert_exact(received: dict, state: dict):
    assert set(received) == set(state)
    for name, tensor in state.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def run_receivers(fns: list) -> tuple[list, list[threading.Thread]]:
    """Start one thread per receiver function; returns (per-receiver result dicts, threads)."""
    results = [{} for _ in fns]
    threads = []
    for fn, res in zip(fns, results):

        def target(fn=fn, res=res):
            try:
                res["value"] = fn()
            except Exception as e:  # recorded for the assertions
                res["error"] = e

        th = threading.Thread(target=target, daemon=True)
        th.start()
        threads.append(th)
    return results, threads


def test_plan_buckets_split_by_size_and_dtype():
    buckets = plan_buckets(specs(), bucket_bytes=100)
    # a=64B, b=32B -> 96B together; c changes dtype; d=256B alone (larger than a bucket)
    assert [[s.name for s in b.specs] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert [b.numel for b in buckets] == [24, 4, 64]


def test_check_plan_names_missing_and_shape_mismatch():
    state = {"a": torch.zeros(4, 4), "b": torch.zeros(8), "c": torch.zeros(2, 2)}
    with pytest.raises(WeightSyncError, match="lacks 1 planned weights"):
        check_plan(specs(), state)
    state["d"] = torch.zeros(63)
    with pytest.raises(WeightSyncError, match="d: \\(63,\\) != \\(64,\\)"):
        check_plan(specs(), state)


def test_plan_digest_covers_names_shapes_dtypes_and_order():
    base = plan_digest(specs())
    assert base == plan_digest(specs())  # deterministic
    variants = [
        specs()[::-1],
        [WeightSpec("a2", (4, 4), "torch.float32")] + specs()[1:],
        [WeightSpec("a", (16,), "torch.float32")] + specs()[1:],
        [WeightSpec("a", (4, 4), "torch.bfloat16")] + specs()[1:],
    ]
    digests = {plan_digest(v) for v in variants}
    assert base not in digests and len(digests) == 4


def test_gloo_broadcast_roundtrip_version_check_and_group_stays_in_step():
    plan = specs()
    port = free_port()
    states = {v: make_state(plan, seed=v) for v in (7, 8, 9)}

    def receiver():
        t = CollectiveTransport(1, 2, "127.0.0.1", port, plan, bucket_bytes=100, timeout_s=20)
        got7 = {n: v.clone() for n, v in t.receive(expected_version=7)}  # views of reused buffers
        try:
            t.receive(expected_version=99)  # the sender stamps 8
            err = None
        except WeightSyncError as e:
            err = str(e)
        got9 = dict(t.receive(expected_version=9))  # the rejected sync was drained: still in step
        return got7, err, got9

    (res,), (th,) = run_receivers([receiver])
    sender = CollectiveTransport(0, 2, "127.0.0.1", port, plan, bucket_bytes=100, timeout_s=20)
    stats = [sender.send(states[v], version=v) for v in (7, 8, 9)]
    th.join(timeout=30)
    got7, err, got9 = res["value"]
    assert stats[0]["bytes"] == (16 + 8 + 64) * 4 + 4 * 2
    assert_exact(got7, states[7])
    assert_exact(got9, states[9])
    assert err is not None and "version 8 != expected 99" in err
    assert not sender.broken


def test_a_lone_weight_cast_to_the_engines_dtype_is_packed_whatever_its_size():
    """A bf16 engine's plan and an fp32 learner state: a weight bigger than every multi-tensor bucket
    (its own bucket) is cast, so packed too; the ring of pack buffers held only multi-tensor buckets
    and the send died on a size mismatch (Qwen2.5-0.5B's 272 MB embedding, 64 MiB buckets)."""
    plan = [
        WeightSpec("a", (4,), "torch.bfloat16"),
        WeightSpec("b", (4,), "torch.bfloat16"),  # one 16-byte bucket
        WeightSpec("embed", (64,), "torch.bfloat16"),  # 128 bytes: a bucket of its own
    ]
    state = {"a": torch.ones(4), "b": torch.full((4,), 2.0), "embed": torch.arange(64, dtype=torch.float32)}
    port = free_port()

    def receiver():
        t = CollectiveTransport(1, 2, "127.0.0.1", port, plan, bucket_bytes=32, timeout_s=20)
        return {n: v.clone() for n, v in t.receive(expected_version=1)}

    (res,), (th,) = run_receivers([receiver])
    sender = CollectiveTransport(0, 2, "127.0.0.1", port, plan, bucket_bytes=32, timeout_s=20)
    stats = sender.send(state, version=1)
    th.join(timeout=30)
    got = res["value"]
    assert stats["bytes"] == (4 + 4 + 64) * 2 and not sender.broken
    assert {n: v.dtype for n, v in got.items()} == dict.fromkeys(state, torch.bfloat16)
    assert torch.equal(got["embed"].float(), state["embed"]) and torch.equal(got["b"].float(), state["b"])


@pytest.mark.parametrize("kind", ["dtype", "name", "shape"])
def test_metadata_mismatch_is_rejected_before_any_weight_loads(kind):
    plan = specs()
    wrong = list(plan)
    if kind == "dtype":
        wrong[2] = WeightSpec("c", (2, 2), "torch.float32")  # sender sends bf16
        expected = "dtype (sender != engine): ['c: torch.bfloat16 != torch.float32']"
    elif kind == "name":
        wrong[1] = WeightSpec("b_renamed", (8,), "torch.float32")
        expected = "sender has 1 weight(s) this engine does not load, e.g. ['b']"
    else:
        wrong[3] = WeightSpec("d", (8, 8), "torch.float32")  # same bytes, different shape
        expected = "shape (sender != engine): ['d: (64,) != (8, 8)']"
    port = free_port()
    states = {v: make_state(plan, seed=v) for v in (1, 2)}
    loaded_by_wrong: list[str] = []

    def good():
        t = CollectiveTransport(1, 3, "127.0.0.1", port, plan, bucket_bytes=100, timeout_s=20)
        return [{n: x.clone() for n, x in t.receive(v)} for v in (1, 2)]

    def bad():
        t = CollectiveTransport(2, 3, "127.0.0.1", port, wrong, bucket_bytes=100, timeout_s=20)
        errors = []
        for v in (1, 2):
            try:
                for name, _ in t.receive(v):
                    loaded_by_wrong.append(name)
            except WeightSyncError as e:
                errors.append(str(e))
        return errors

    results, threads = run_receivers([good, bad])
    sender = CollectiveTransport(0, 3, "127.0.0.1", port, plan, bucket_bytes=100, timeout_s=20)
    t0 = time.perf_counter()
    for v in (1, 2):
        sender.send(states[v], v)  # completes: the rejecting receiver drains the buckets
    send_s = time.perf_counter() - t0
    for th in threads:
        th.join(timeout=30)
    assert send_s < 10 and not sender.broken
    got1, got2 = results[0]["value"]
    assert_exact(got1, states[1])
    assert_exact(got2, states[2])
    errors = results[1]["value"]
    assert loaded_by_wrong == []  # nothing was yielded to the loader, in either sync
    assert len(errors) == 2 and all(expected in e and "rejected before loading" in e for e in errors)
    if kind == "name":
        assert "sender lacks 1 weight(s) this engine loads, e.g. ['b_renamed']" in errors[0]


def test_engine_rejects_a_mismatched_sync_without_touching_its_weights(tiny_model):
    """A RolloutEngine (in this process, hf backend) whose plan wants bf16 where the sender sends
    fp32: receive_weights raises naming the engine and the weight, loads nothing, keeps v0."""
    import asyncio

    from clawray.actors.rollout import RolloutEngine

    engine = RolloutEngine(tiny_model, {"backend": "hf", "torch_threads": 1}, name="rollout-7")
    try:
        loop = asyncio.new_event_loop()
        assert loop.run_until_complete(engine.ready()) == {"name": "rollout-7", "version": 0}
        plan = loop.run_until_complete(engine.weight_specs())
        before = {k: v.clone() for k, v in engine._backend.model.state_dict().items()}
        engine_plan = [WeightSpec(s.name, s.shape, "torch.bfloat16") if s.name == "lm_head.weight" else s for s in plan]
        port = free_port()
        sender_box = {}

        def sender():
            sender_box["t"] = t = CollectiveTransport(0, 2, "127.0.0.1", port, plan, 1 << 20, timeout_s=20)
            t.send({k: v + 1.0 for k, v in before.items()}, 1)

        th = threading.Thread(target=sender, daemon=True)
        th.start()
        spec = TransportSpec("collective", 2, engine_plan, bucket_bytes=1 << 20, timeout_s=20, port=port)
        loop.run_until_complete(engine.init_weight_receiver(1, spec))
        with pytest.raises(WeightSyncError) as info:
            loop.run_until_complete(engine.receive_weights(1))
        th.join(timeout=30)
        msg = str(info.value)
        assert msg.startswith("rollout-7: sync header rejected before loading")
        assert "lm_head.weight: torch.float32 != torch.bfloat16" in msg
        assert loop.run_until_complete(engine.get_version()) == 0
        stats = loop.run_until_complete(engine.stats())
        assert stats["loads"] == 0 and "lm_head.weight" in stats["last_sync_error"]
        after = engine._backend.model.state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before)
    finally:
        engine._jobs.put(None)


def test_collective_timeout_does_not_hang_and_a_rebuilt_group_works():
    """One receiver joins the group but never takes part in the sync: the sender raises within the
    timeout (no hang), the group is marked broken, and a group rebuilt on a new port syncs exactly."""
    plan = [WeightSpec(f"w{i}", (1024, 1024), "torch.float32") for i in range(16)]  # 64 MiB
    state = make_state(plan, seed=3)
    port = free_port()
    joined = threading.Event()

    def absent():
        t = CollectiveTransport(2, 3, "127.0.0.1", port, plan, 16 << 20, timeout_s=2)
        joined.set()
        time.sleep(6)  # busy elsewhere: never calls receive
        return t

    def present():
        t = CollectiveTransport(1, 3, "127.0.0.1", port, plan, 16 << 20, timeout_s=2)
        try:
            return dict(t.receive(1))
        except WeightSyncError as e:
            return e

    results, threads = run_receivers([present, absent])
    sender = CollectiveTransport(0, 3, "127.0.0.1", port, plan, 16 << 20, timeout_s=2)
    joined.wait(20)
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError, match="timed out"):
        sender.send(state, 1)
    assert time.perf_counter() - t0 < 10
    assert sender.broken
    with pytest.raises(WeightSyncError, match="broken"):
        sender.send(state, 2)  # an unusable group refuses instead of hanging again
    for th in threads:
        th.join(timeout=30)
    sender.close()

    # recovery: every member builds a new group on a new port; the next sync is exact everywhere
    port2 = free_port()
    state2 = make_state(plan, seed=4)
    fns = [
        lambda r=r: dict(CollectiveTransport(r, 3, "127.0.0.1", port2, plan, 16 << 20, timeout_s=20).receive(2))
        for r in (1, 2)
    ]
    results, threads = run_receivers(fns)
    CollectiveTransport(0, 3, "127.0.0.1", port2, plan, 16 << 20, timeout_s=20).send(state2, 2)
    for th in threads:
        th.join(timeout=60)
    for res in results:
        assert_exact(res["value"], state2)


def test_object_store_transport_roundtrips_bit_exactly_and_checks_metadata(ray_cluster):
    from clawray.weight_sync import WeightMailboxActor, make_transport

    plan = specs() + [WeightSpec("e", (300,), "torch.bfloat16")]  # e: a bucket of its own (no-copy path)
    mailbox = WeightMailboxActor.options(num_cpus=0).remote()
    spec = TransportSpec("object_store", 3, plan, bucket_bytes=100, timeout_s=10, mailbox=mailbox)
    sender, r1 = make_transport(spec, 0), make_transport(spec, 1)
    wrong = [WeightSpec("c", (2, 2), "torch.float16") if s.name == "c" else s for s in plan]
    r2 = ObjectStoreTransport(2, wrong, 100, 10, mailbox)
    assert isinstance(sender, ObjectStoreTransport)
    for version in (3, 4):
        state = make_state(plan, seed=version)
        stats = sender.send(state, version)
        assert stats["bytes"] == (16 + 8 + 64) * 4 + 4 * 2 + 300 * 2
        assert_exact(dict(r1.receive(version)), state)
        with pytest.raises(
            WeightSyncError, match=r"dtype \(sender != engine\): \['c: torch.bfloat16 != torch.float16'\]"
        ):
            r2.receive(version)
    # a sync that never comes: the receiver gives up after its timeout instead of hanging
    r3 = ObjectStoreTransport(1, plan, 100, 1.0, mailbox)
    r3.seq = 10
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError, match="no sync #11 posted within 1s"):
        r3.receive(5)
    assert time.perf_counter() - t0 < 8
    # a sender whose state lacks a planned weight aborts, and receivers fail fast with the reason
    with pytest.raises(WeightSyncError, match="lacks 1 planned weights"):
        sender.send({k: v for k, v in make_state(plan).items() if k != "a"}, 5)
    with pytest.raises(WeightSyncError, match="the sender aborted the sync to v5"):
        r1.receive(5)


def test_ipc_transport_shares_buffers_bit_exactly_rejects_mismatch_and_names_a_missing_receiver(ray_cluster):
    """Sender and two receivers in three Ray actors: receivers see the sender's buffers (shared
    memory, no copy) bit-exactly across two syncs (buffers reused); a receiver whose plan differs is
    rejected before any buffer is opened and the sender still completes; a receiver that never
    takes part makes the sender raise within its timeout naming it, and its late fetch fails.
    The buffers are the sender's own 0600 files in /dev/shm, and when Ray kills the sender (as
    ``ray.shutdown`` does) the next sweep removes them: torch's ``file_system`` files stayed, one
    packed copy of the weights in RAM per run."""
    import os
    import stat

    import ray

    from clawray.weight_sync import shm

    from clawray.weight_sync import WeightMailboxActor

    class Peer:
        def __init__(self, rank, plan, mailbox, timeout_s, name):
            from clawray.weight_sync import IpcTransport

            self.t = IpcTransport(rank, 3, plan, 100, timeout_s, mailbox, name=name)

        def send(self, state, version):
            return self.t.send(state, version)

        def pid(self):
            return os.getpid()

        def receive(self, version):
            from clawray.weight_sync import WeightSyncError

            try:
                items = list(self.t.receive(version))
            except WeightSyncError as e:
                return str(e)
            with open("/proc/self/maps") as f:  # views of the sender's files, mapped: no copy
                shared = sorted({line.split()[-1] for line in f if shm.PREFIX in line})
            got = {n: v.clone() for n, v in items}
            del items
            self.t.done()
            return got, shared

    plan = specs() + [WeightSpec("e", (300,), "torch.bfloat16")]
    wrong = [WeightSpec("c", (2, 2), "torch.float16") if s.name == "c" else s for s in plan]
    mailbox = WeightMailboxActor.options(num_cpus=0).remote()
    peer = ray.remote(Peer)
    sender = peer.options(num_cpus=0.1).remote(0, plan, mailbox, 3.0, "")
    r1 = peer.options(num_cpus=0.1).remote(1, plan, mailbox, 3.0, "rollout-0")
    r2 = peer.options(num_cpus=0.1).remote(2, wrong, mailbox, 3.0, "rollout-1")
    try:
        sender_pid = ray.get(sender.pid.remote())
        for version in (3, 4):
            state = make_state(plan, seed=version)
            sent, got1, err2 = ray.get(
                [sender.send.remote(state, version), r1.receive.remote(version), r2.receive.remote(version)], timeout=60
            )
            assert sent["bytes"] == (16 + 8 + 64) * 4 + 4 * 2 + 300 * 2
            got, shared = got1
            files = sorted(
                os.path.join(shm.shm_dir(), n)
                for n in os.listdir(shm.shm_dir())
                if n.startswith(f"{shm.PREFIX}{os.stat('/proc/self/ns/pid').st_ino}-{sender_pid}-")
            )
            assert shared == files and len(files) == 4  # one buffer per 100-byte bucket
            assert sum(os.path.getsize(f) for f in files) == sent["bytes"]
            assert {stat.S_IMODE(os.stat(f).st_mode) for f in files} == {0o600}
            assert_exact(got, state)
            assert "rejected before loading" in err2
            assert "dtype (sender != engine): ['c: torch.bfloat16 != torch.float16']" in err2
        # rollout-1 never receives sync 5: the sender gives up after 3 s and names it
        state = make_state(plan, seed=5)
        send_ref, recv_ref = sender.send.remote(state, 5), r1.receive.remote(5)
        t0 = time.perf_counter()
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(send_ref, timeout=60)
        assert time.perf_counter() - t0 < 20
        assert isinstance(info.value.cause, WeightSyncError)
        assert "sync #3 to v5: no ack from rollout-1 (rank 2) within 3s; the sync is withdrawn" in str(info.value.cause)
        assert_exact(ray.get(recv_ref, timeout=30)[0], state)
        late = ray.get(r2.receive.remote(5), timeout=30)
        assert isinstance(late, str) and "the sender withdrew sync #3 to v5" in late
        ray.kill(sender)  # no atexit runs: the files stay until a sweep sees their creator gone
        deadline = time.time() + 30
        while any(os.path.exists(f) for f in files) and time.time() < deadline:
            assert set(shm.sweep()) <= set(files)
            time.sleep(0.2)
        assert not any(os.path.exists(f) for f in files)
    finally:
        for a in (sender, r1, r2, mailbox):
            ray.kill(a)


def test_sync_config_transport_choice():
    from clawray.config import ConfigError, load_config

    assert load_config().sync.transport == "auto"
    assert load_config(overrides=["sync.transport=collective"]).sync.transport == "collective"
    assert load_config(overrides=["sync.transport=object_store"]).sync.transport == "object_store"
    assert load_config(overrides=["sync.transport=ipc"]).sync.transport == "ipc"
    with pytest.raises(ConfigError, match="sync.transport='nccl' is not one of"):
        load_config(overrides=["sync.transport=nccl"])


def test_vllm_backend_resets_the_prefix_cache_after_every_load():
    """VLLMBackend.load_weights reloads through vLLM and then drops the prefix cache (a stale KV
    prefix would mix old-weight activations into new-version tokens), preempting the running requests
    when there are any (an in-flight load: they re-prefill on the new weights); a refused reset raises."""
    from types import SimpleNamespace

    from clawray.engines.vllm import VLLMBackend

    class FakeLLM:
        def __init__(self, reset_ok):
            self.calls, self.reset_ok = [], reset_ok

        def collective_rpc(self, method, kwargs):
            self.calls.append((method, [n for n, _ in kwargs["weights_iterator"]]))

        def reset_prefix_cache(self, reset_running_requests=False):
            self.calls.append(("reset_prefix_cache", reset_running_requests))
            return self.reset_ok

        def apply_model(self, fn):
            self.calls.append(("apply_model", fn.__name__))

    backend = VLLMBackend.__new__(VLLMBackend)
    backend._tied = False
    backend.llm, backend._runs = FakeLLM(True), {"clawray-0": SimpleNamespace(finish_reason="abort")}
    backend.load_weights(iter([("a", torch.zeros(2)), ("b", torch.ones(1))]))
    assert backend.llm.calls == [("reload_weights", ["a", "b"]), ("reset_prefix_cache", False)]
    backend._runs["clawray-1"] = SimpleNamespace(finish_reason=None)  # still running
    backend.llm = FakeLLM(True)
    backend.load_weights([("a", torch.zeros(2))])
    assert backend.llm.calls == [("reload_weights", ["a"]), ("reset_prefix_cache", True)]
    backend.llm = FakeLLM(False)
    with pytest.raises(RuntimeError, match="refused to reset the prefix cache"):
        backend.load_weights([("a", torch.zeros(2))])
    # a tied lm_head is re-processed after the reload, before the cache is dropped
    backend._tied, backend.llm = True, FakeLLM(True)
    backend.load_weights([("a", torch.zeros(2))])
    assert backend.llm.calls == [
        ("reload_weights", ["a"]),
        ("apply_model", "_refresh_tied_lm_head"),
        ("reset_prefix_cache", True),
    ]


@pytest.mark.parametrize("transport", ["collective", "object_store", "ipc"])
def test_failure_in_one_of_two_engines_is_named_and_the_next_sync_recovers(ray_cluster, tiny_model, transport):
    import ray

    from clawray.actors.rollout import RolloutEngine
    from clawray.engines.base import GenerateRequest
    from clawray.weight_sync import WeightSyncController

    class FakeLearner:
        """Rank 0 of a learner group: the tiny model's weights, shifted by 0.01 per version."""

        def __init__(self, model_path):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            self.base = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.transport = None

        def ready(self):
            return 0

        def sync_rendezvous(self, host=""):
            from clawray.ray_env import reserve_rendezvous

            return reserve_rendezvous(host, 0)

        def state(self, version):
            return {k: v + 0.01 * version for k, v in self.base.items()}

        def init_weight_sender(self, spec, check):
            from clawray.weight_sync import make_transport

            if self.transport is not None:
                self.transport.close()
            self.transport = make_transport(spec, 0)

        def watch(self, engines):
            self.engines, self.seen = engines, []

        def _paused(self):
            return [ray.get(e.stats.remote(), timeout=30)["paused"] for e in self.engines]

        def stage_weights(self, version):
            self.seen.append(("stage", version, self._paused()))
            return {"gather_s": 0.0}

        def seen_pauses(self):
            return self.seen

        def sync_weights(self, version):
            self.seen.append(("sync", version, self._paused()))
            stats = self.transport.send(self.state(version), version)
            return {"bytes": stats["bytes"], "gather_s": 0.0, "send_s": stats["seconds"]}

    class FaultyEngine(RolloutEngine):
        """A RolloutEngine whose next load can be made to raise, or whose engine thread can be kept busy."""

        async def fail_next_load(self):
            def arm():
                def boom(weights):
                    del self._backend.load_weights  # back to the real method afterwards
                    raise RuntimeError("injected load failure")

                self._backend.load_weights = boom

            await self._call(arm)

        async def block(self, seconds):
            import asyncio

            asyncio.ensure_future(self._call(lambda: time.sleep(seconds)))  # occupies the engine thread

        async def weights(self):
            return await self._call(lambda: {k: v.clone() for k, v in self._backend.model.state_dict().items()})

        async def slow_steps(self, seconds):
            """Each step sleeps ``seconds`` first, and no eos ends a reply (a long generation to sync under)."""
            backend = self._backend
            backend.eos_ids, step = [], backend.step
            backend.step = lambda: (time.sleep(seconds), step())[1]

    learner = ray.remote(FakeLearner).options(num_cpus=0.2).remote(tiny_model)
    engine_cls = ray.remote(FaultyEngine)
    names = ["rollout-0", "rollout-1"]
    engines = [
        engine_cls.options(num_cpus=0.2).remote(
            tiny_model, {"backend": "hf", "torch_threads": 1, "max_batch_size": 8}, name=n
        )
        for n in names
    ]
    ctl = None
    try:
        ray.get([e.ready.remote() for e in engines] + [learner.ready.remote()])
        plan = ray.get(engines[0].weight_specs.remote())
        ray.get(learner.watch.remote(engines))
        ctl = WeightSyncController(
            [learner], engines, names, plan, transport=transport, bucket_bytes=1 << 20, timeout_s=4.0
        )
        ctl.connect()

        def serving_versions():
            outs = ray.get(
                [e.generate.remote(GenerateRequest([5, 6, 7], max_tokens=2, seed=0)) for e in engines], timeout=30
            )  # would time out if an engine had been left paused
            return [o["policy_version"] for o in outs]

        # 1) rollout-1 raises while loading v1: named, engines resumed, rollout-0 on v1, rollout-1 on v0
        ray.get(engines[1].fail_next_load.remote())
        r1 = ctl.sync(1)
        assert r1["ok"] is False and r1["failed"] == ["rollout-1"]
        assert r1["error"].startswith("weight sync to v1 failed on rollout-1 (")
        assert "injected load failure" in r1["error"]
        assert r1["versions"] == {"rollout-0": 1, "rollout-1": 0}
        assert ctl.engine_versions() == {"rollout-0": 1, "rollout-1": 0} and ctl.behind
        assert serving_versions() == [1, 0]
        stats1 = ray.get(engines[1].stats.remote())
        assert stats1["loads"] == 0 and "injected load failure" in stats1["last_sync_error"]

        # 2) the next sync rebuilds the group and brings both engines to v2 with exactly v2's weights
        r2 = ctl.sync(2)
        assert r2["ok"] is True and r2["failed"] == [] and r2["error"] is None and r2["rebuild_s"] > 0
        assert r2["versions"] == {"rollout-0": 2, "rollout-1": 2} and not ctl.behind
        assert serving_versions() == [2, 2]
        expected = ray.get(learner.state.remote(2))
        for got in ray.get([e.weights.remote() for e in engines]):
            assert all(torch.equal(got[k], expected[k]) for k in expected)
        m = WeightSyncController.metrics(r2, ctl.failures)
        assert m["sync/bytes"] == sum(4 * torch.Size(s.shape).numel() for s in plan) == r2["bytes"]
        assert m["sync/ok"] == 1.0 and m["sync/failures"] == 1.0 and m["sync/gbytes_per_s"] > 0
        assert set(k for k in m if k.startswith("sync/load_s/")) == {"sync/load_s/rollout-0", "sync/load_s/rollout-1"}
        assert m["engine_version/rollout-0"] == 2 and m["engine_version/rollout-1"] == 2
        assert m["timing/weight_sync_s"] == r2["seconds"] > 0
        assert 0 < m["sync/pause_s"] <= r2["seconds"] and m["sync/interrupted_requests"] == 0.0  # nothing ran
        # the learner stages (gathers) the weights while the engines serve; they pause only to receive
        assert [e for e in ray.get(learner.seen_pauses.remote()) if e[1] == 2] == [
            ("stage", 2, [False, False]),
            ("sync", 2, [True, True]),
        ]

        # 3) rollout-1's engine thread is busy past the deadline: the sync returns in bounded time,
        #    names rollout-1 as timed out, and leaves no engine paused
        ray.get(engines[1].block.remote(6.0))
        t0 = time.perf_counter()
        r3 = ctl.sync(3)
        assert time.perf_counter() - t0 < 4.0 + 35
        assert r3["ok"] is False and "rollout-1" in r3["failed"]
        assert "rollout-1 (timed out after 4s)" in r3["error"]
        assert r3["versions"]["rollout-0"] in (2, 3)
        assert (
            ray.get(engines[0].generate.remote(GenerateRequest([5], max_tokens=1)), timeout=30)["policy_version"]
            == r3["versions"]["rollout-0"]
        )

        # 4) the next sync recovers: both engines on v4 with exactly v4's weights
        r4 = ctl.sync(4)
        assert r4["ok"] is True, r4["error"]
        assert r4["versions"] == {"rollout-0": 4, "rollout-1": 4}
        assert serving_versions() == [4, 4]
        expected = ray.get(learner.state.remote(4))
        for got in ray.get([e.weights.remote() for e in engines]):
            assert all(torch.equal(got[k], expected[k]) for k in expected)
        assert ctl.failures == 2 and ctl.rebuilds == 2

        # 4b) a held sync (the gate's candidate) that fails on rollout-1 leaves both engines paused:
        #     rollout-0 loaded weights the caller withdraws and must not serve them before its rollback
        ray.get(engines[1].fail_next_load.remote())
        held = ctl.sync(40, hold=True)
        assert (held["ok"], held["held"], held["paused"]) == (False, False, True)
        assert held["versions"] == {"rollout-0": 40, "rollout-1": 4}
        assert [ray.get(e.stats.remote(), timeout=30)["paused"] for e in engines] == [True, True]
        back = ctl.sync(4)  # the rollback: every engine on v4 again, and resumed
        assert back["ok"] is True and back["paused"] is False and serving_versions() == [4, 4]

        # 5) sync.mode inflight: no pause; rollout-0 loads v5 between two steps of a running reply,
        #    which goes on as one request: its tokens are v4 up to the load and v5 after it
        ctl.mode = "inflight"
        ray.get(engines[0].slow_steps.remote(0.01))
        reply = engines[0].generate.remote(GenerateRequest([5, 6, 7], max_tokens=200, seed=0))
        time.sleep(0.5)
        r5 = ctl.sync(5)
        assert r5["ok"] is True, r5["error"]
        assert ray.wait([reply], timeout=0)[1] == [reply]  # the load did not wait for the reply
        assert r5["inflight"] == 1 and r5["interrupted"] == 0 and r5["pause_s"] == max(r5["load_s"].values())
        assert [e for e in ray.get(learner.seen_pauses.remote()) if e[1] == 5][-1] == ("sync", 5, [False, False])
        out = ray.get(reply, timeout=60)
        k = out["token_versions"].index(5)
        assert out["token_versions"] == [4] * k + [5] * (200 - k) and k > 0 and out["policy_version"] == 4
        assert WeightSyncController.metrics(r5)["sync/inflight_requests"] == 1.0
    finally:
        if ctl is not None:
            ctl.close()
        for a in engines + [learner]:
            ray.kill(a)

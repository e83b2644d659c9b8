"""Addresses and placement without a cluster: transport choice, rendezvous binding, gloo interface."""

import socket
from datetime import timedelta

import pytest

from clawray import ray_env
from clawray.placement import resolve_transport


CPU = ()  # no GPU ids


def test_auto_is_ipc_on_one_host_and_collective_across_hosts():
    a, b = ("10.0.0.5", CPU), ("10.0.0.6", CPU)
    assert resolve_transport("auto", a, {"rollout-0": a, "rollout-1": a}) == "ipc"
    assert resolve_transport("auto", a, {"rollout-0": a, "rollout-1": b}) == "collective"
    assert resolve_transport("auto", a, {}) == "ipc"
    for forced in ("collective", "object_store"):
        assert resolve_transport(forced, a, {"rollout-0": b}) == forced
    assert resolve_transport("ipc", a, {"rollout-0": a}) == "ipc"


def test_auto_on_cpu_is_ipc_only_with_room_in_dev_shm():
    """On CPU ipc keeps one packed copy of the weights in /dev/shm (Docker's default is 64 MiB):
    auto takes it only with 1.5 x the weights free there; a GPU sender's buffers are on the GPU."""
    a, smol = ("10.0.0.5", CPU), 538_060_032  # SmolLM2-135M in float32
    assert resolve_transport("auto", a, {"rollout-0": a}, shm_free=64 << 20, payload=smol) == "collective"
    assert resolve_transport("auto", a, {"rollout-0": a}, shm_free=int(1.5 * smol) - 1, payload=smol) == "collective"
    assert resolve_transport("auto", a, {"rollout-0": a}, shm_free=int(1.5 * smol), payload=smol) == "ipc"
    assert resolve_transport("auto", a, {"rollout-0": a}, shm_free=None, payload=smol) == "ipc"  # unknown: as before
    gpu = ("10.0.0.5", ("0",))
    assert resolve_transport("auto", gpu, {"rollout-0": gpu}, shm_free=64 << 20, payload=smol) == "ipc"
    assert resolve_transport("ipc", a, {"rollout-0": a}, shm_free=0, payload=smol) == "ipc"  # forced: as asked


def test_auto_on_gpu_is_ipc_only_for_engines_on_the_senders_gpu():
    """CUDA IPC handles open only on a device the receiver sees (Ray shows each actor its own GPUs)."""
    sender = ("10.0.0.5", ("0",))
    assert resolve_transport("auto", sender, {"rollout-0": ("10.0.0.5", ("0",))}) == "ipc"  # conf/gpu.yaml: 0.5 + 0.5
    assert (
        resolve_transport("auto", sender, {"rollout-0": ("10.0.0.5", ("0",)), "rollout-1": ("10.0.0.5", ("1",))})
        == "collective"
    )


def test_forced_ipc_across_hosts_names_the_engines_away():
    a = ("10.0.0.5", CPU)
    with pytest.raises(ValueError) as err:
        resolve_transport("ipc", a, {"rollout-0": a, "rollout-1": ("10.0.0.6", CPU), "rollout-2": ("10.0.0.7", CPU)})
    msg = str(err.value)
    assert "learner rank 0 runs on 10.0.0.5 and rollout-1 on 10.0.0.6, rollout-2 on 10.0.0.7" in msg
    assert "rollout-0" not in msg and "sync.transport=auto" in msg


def test_loopback_and_interfaces():
    assert ray_env.is_loopback("127.0.0.1") and ray_env.is_loopback("127.0.0.3") and ray_env.is_loopback("::1")
    assert ray_env.is_loopback("localhost") and not ray_env.is_loopback("10.1.2.3")
    assert not ray_env.is_loopback("node-7.cluster")  # a host name is not assumed local
    lo = ray_env.loopback_interface()
    assert ray_env.interface_of("127.0.0.1") == lo
    assert ray_env.interface_of("127.0.0.3") == lo  # in lo's 127.0.0.0/8 subnet
    assert ray_env.interface_of("203.0.113.9") is None  # TEST-NET-3: on no interface here


def test_rank0_reserves_its_rendezvous_on_the_given_address_and_serves_it():
    """reserve_rendezvous binds the socket at once (the port is taken: no race), on that address only,
    and the next tcp_store(host, port, is_master) serves the store on that very socket."""
    host, port = ray_env.reserve_rendezvous("127.0.0.2", 0)
    assert host == "127.0.0.2" and port > 0
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.2", port))  # held since the reservation
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens on another loopback address
    master = ray_env.tcp_store(host, port, 1, True, timedelta(seconds=10))
    client = ray_env.tcp_store(host, port, 1, False, timedelta(seconds=10))
    master.set("k", b"v")
    assert client.get("k") == b"v"
    assert (host, port) not in ray_env._RESERVED  # used once


def test_a_new_reservation_closes_the_unused_one():
    _, p1 = ray_env.reserve_rendezvous("127.0.0.1", 0)
    _, p2 = ray_env.reserve_rendezvous("127.0.0.1", 0)
    assert list(ray_env._RESERVED) == [("127.0.0.1", p2)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", p1))  # released
    ray_env.reserve_rendezvous("127.0.0.1", p1)  # and can be reserved again
    for sock in ray_env._RESERVED.values():
        sock.close()
    ray_env._RESERVED.clear()


def test_resources_keys_take_custom_ray_resources_only():
    from clawray.config import ConfigError, load_config

    cfg = load_config(["conf/rl.yaml", "conf/cpu.yaml", "conf/cluster.yaml"])
    assert dict(cfg.learner.resources) == {"learner_node": 1.0} and dict(cfg.rollout.resources) == {"rollout_node": 1.0}
    assert cfg.sync.transport == "auto" and dict(load_config().learner.resources) == {}
    assert dict(load_config([], ["rollout.resources={rollout_node: 0.25}"]).rollout.resources) == {"rollout_node": 0.25}
    serve = load_config([], ["serve.resources={serve_node: 1}", "serve.num_replicas=2"]).serve
    assert dict(serve.resources) == {"serve_node": 1.0} and serve.num_replicas == 2 and serve.engine_slack == 4
    bad = {
        "learner.resources={GPU: 1}": "learner.resources.GPU: GPU is one of Ray's built-in resources",
        "rollout.resources={CPU: 1}": "rollout.resources.CPU: CPU is one of Ray's built-in resources",
        "rollout.resources={rollout_node: 0}": "rollout.resources.rollout_node=0.0 is out of range",
        "learner.resources={learner_node: -1}": "learner.resources.learner_node=-1.0 is out of range",
        "learner.resources={learner_node: 0.00001}": "learner.resources.learner_node=1e-05 is out of range",
        "serve.resources={CPU: 1}": "serve.resources.CPU: CPU is one of Ray's built-in resources",
        "serve.resources={serve_node: 0}": "serve.resources.serve_node=0.0 is out of range",
        "serve.num_replicas=0": "serve.num_replicas=0 is out of range",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError) as err:
            load_config([], [override])
        assert message in str(err.value), (override, str(err.value))


def test_a_local_ray_is_always_a_new_one(monkeypatch):
    # "" must start our own Ray even when the machine already runs one (`ray start --head`): joining it
    # made ray.init refuse num_cpus ("When connecting to an existing cluster, num_cpus ... must not
    # be provided"); "auto" and an address join
    import ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    ray_env.init_ray("", 3)
    ray_env.init_ray("auto")
    assert calls[0]["address"] == "local" and calls[0]["num_cpus"] == 3
    assert calls[1] == {"address": "auto", "log_to_driver": True}


def test_an_actor_computes_on_the_gpu_only_when_ray_gave_it_one(monkeypatch):
    """The learners (and the hf engine, the ipc transport) took ``cuda`` whenever CUDA was available:
    Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for an actor with ``num_gpus=0``, so `conf/cpu.yaml` on
    a GPU host put every learner rank on GPU 0 (NCCL refuses two ranks on one GPU)."""
    from types import SimpleNamespace

    import ray
    import torch

    from clawray.engines import backend_kwargs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ray_env.compute_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert ray_env.compute_device() == "cuda"  # a driver or a test outside Ray
    gpus: list = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_actor_id=lambda: "a1"))
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: gpus)
    assert ray_env.compute_device() == "cpu"  # an actor with num_gpus=0
    assert backend_kwargs(None, "hf", 3) == {"dtype": "float32", "seed": 3, "device": "cpu"}
    gpus.append(0)  # num_gpus=0.5: Ray assigned GPU 0
    assert ray_env.compute_device() == "cuda"
    assert backend_kwargs(None, "hf", 3)["device"] == "cuda"

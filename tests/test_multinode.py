"""Three Ray nodes on one machine: learners on node 2, the policy engine on node 3, the rest on the head.

Linux routes all of 127.0.0.0/8 to loopback, so nodes started with ``--node-ip-address=127.0.0.2`` and
``127.0.0.3`` join the session's head (127.0.0.1) as separate nodes with their own addresses, the way
``ray start --address`` adds machines to a real cluster. Custom resources (``learner_node``,
``rollout_node``) that only those nodes offer place the actors (``learner.resources``,
``rollout.resources``). The nodes are stopped at the end (only the processes this module started).
"""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
import ray

from clawray.driver import Driver
from clawray.ray_env import free_port
from conftest import tiny_run_config

pytestmark = pytest.mark.slow


def _start_node(head: str, ip: str, resources: dict, log) -> subprocess.Popen:
    """``ray start --address=head --node-ip-address=ip --block`` (1 CPU, ``resources``), own agent
    ports, output to the file ``log``."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}  # a worker node: Ray refuses it at 0
    return subprocess.Popen(
        [ray_bin, "start", f"--address={head}", f"--node-ip-address={ip}", "--num-cpus=1",
         f"--resources={json.dumps(resources)}", f"--dashboard-agent-listen-port={free_port()}",
         f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
         f"--metrics-export-port={free_port()}", "--disable-usage-stats", "--block"],
        env=env, stdout=log, stderr=subprocess.STDOUT)


def _stop_node(proc: subprocess.Popen) -> None:
    """Stop one node started by :func:`_start_node`: the ``ray start`` process and its descendants."""
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _alive_node_ips() -> set[str]:
    return {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


@pytest.fixture(scope="module")
def three_nodes(ray_cluster, tmp_path_factory):
    """The session head plus 127.0.0.2 (``learner_node: 2``) and 127.0.0.3 (``rollout_node: 1``)."""
    log_path = tmp_path_factory.mktemp("nodes") / "ray_start.log"
    with open(log_path, "w") as log:
        nodes = [_start_node(ray_cluster["address"], "127.0.0.2", {"learner_node": 2}, log),
                 _start_node(ray_cluster["address"], "127.0.0.3", {"rollout_node": 1}, log)]
    try:
        deadline = time.monotonic() + 300  # a raylet start takes a minute on a loaded 2-core machine
        while not {"127.0.0.2", "127.0.0.3"} <= _alive_node_ips():
            assert time.monotonic() < deadline, f"nodes did not join: alive {_alive_node_ips()}\n{log_path.read_text()[-3000:]}"
            assert all(p.poll() is None for p in nodes), f"a `ray start --address` exited:\n{log_path.read_text()[-3000:]}"
            time.sleep(1)
        yield
    finally:
        for p in nodes:
            _stop_node(p)


def _actor_ip(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.util.get_node_ip_address()), timeout=60)


def test_learners_and_engine_on_their_own_nodes_train_two_updates(three_nodes, tiny_model, tmp_path, capsys):
    """The whole loop with the learner group on node 2 and the engine on node 3: 2 updates. The
    learners' rendezvous and the weight-sync group's rendezvous are rank 0's own node address
    (127.0.0.2), not 127.0.0.1; ``sync.transport=auto`` chose the collective (engine on another host);
    the engine serves v2."""
    cfg = tiny_run_config(tiny_model, tmp_path / "run", overrides=[
        "learner.resources={learner_node: 1}", "rollout.resources={rollout_node: 1}", "sync.transport=auto",
        "trainer.num_steps=2", "trainer.batch_timeout_s=240", "env.concurrency=2", "env.max_tokens=16",
        "env.max_turns=2", "wandb.mode=disabled"])
    d = Driver(cfg)
    try:
        d.setup()
        assert [_actor_ip(w) for w in d.learners.workers] == ["127.0.0.2", "127.0.0.2"]
        assert _actor_ip(d.engines[0]) == "127.0.0.3"
        host, port = d.learners.rendezvous
        assert host == "127.0.0.2" and port > 0
        assert ray.get(d.learners.workers[1].__ray_call__.remote(lambda w: w.master_address)) == (host, port)
        assert d.weight_sync.transport == "collective" and d.weight_sync.rendezvous[0] == "127.0.0.2"
        out = capsys.readouterr().out
        assert (f"[clawray] placement: learners on 127.0.0.2 x2 (rendezvous 127.0.0.2:{port}), engines on 127.0.0.3 x1; "
                f"weight sync collective at 127.0.0.2:{d.weight_sync.rendezvous[1]}") in out
        summary = d.run()
        assert summary["policy_version"] == 2 and summary["engine_versions"] == [2]
        lines = [json.loads(line) for line in open(f"{d.run_dir}/metrics.jsonl")]
        assert [m["policy_version"] for m in lines] == [1, 2] and all(m["sync/ok"] == 1.0 for m in lines)
        assert d.weight_sync.rendezvous[0] == "127.0.0.2"
    finally:
        d.shutdown()


def test_forced_ipc_across_hosts_is_refused_naming_the_engine(three_nodes, tiny_model, tmp_path):
    """sync.transport=ipc with the engine on another node than learner rank 0: setup fails with an
    error naming the engine, both hosts and the way out, instead of a hang or a silent copy."""
    from clawray.weight_sync import WeightSyncError

    cfg = tiny_run_config(tiny_model, tmp_path / "run", overrides=[
        "learner.resources={learner_node: 1}", "rollout.resources={rollout_node: 1}", "sync.transport=ipc",
        "learner.num_workers=1", "env.enabled=false", "wandb.mode=disabled"])
    d = Driver(cfg)
    try:
        with pytest.raises(WeightSyncError) as err:
            d.setup()
        msg = str(err.value)
        assert "sync.transport=ipc needs every engine on the sender's host" in msg
        assert "learner rank 0 runs on 127.0.0.2 and rollout-0 on 127.0.0.3" in msg and "sync.transport=auto" in msg
    finally:
        d.shutdown()

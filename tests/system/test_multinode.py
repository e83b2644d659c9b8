"""Three Ray nodes on one machine: learners on node 2, the policy engine on node 3, the rest on the head
(two PolicyServer replicas among them, session-affine).

Linux routes all of 127.0.0.0/8 to loopback, so a ``ray.cluster_utils.Cluster`` whose nodes have the
node addresses 127.0.0.1 (head), 127.0.0.2 and 127.0.0.3 behaves as three hosts with their own
addresses. Custom resources (``learner_node``, ``rollout_node``) that only nodes 2 and 3 offer place
the actors (``learner.resources``, ``rollout.resources``); ``serve_node`` keeps the Serve replicas on the
head (Serve runs an HTTP proxy on every node that holds a replica, each bound to ``serve.host:serve.port``:
on one machine a second proxy would find the port taken). The module disconnects from the session's
head for its own cluster and reconnects afterwards.
"""

import json

import httpx
import pytest
import ray

from clawray.driver import Driver
from clawray.ray_env import free_port
from clawray.run_stats import serve_stats
from conftest import tiny_run_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def three_nodes():
    """A head on 127.0.0.1 (2 CPUs, ``serve_node: 2``) plus 127.0.0.2 (1 CPU, ``learner_node: 2``) and 127.0.0.3 (1 CPU,
    ``rollout_node: 1``), connected; yields the cluster."""
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    session = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    ray.shutdown()
    # as ray_env.init_ray does: Ray read the variable at import, perhaps before conftest set it; with
    # it on, Ray would replace the head's 127.0.0.1 by the machine's address
    cluster_mode, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    cluster = Cluster()
    try:
        cluster.add_node(node_ip_address="127.0.0.1", num_cpus=2, resources={"serve_node": 2}, include_dashboard=False)
        cluster.add_node(node_ip_address="127.0.0.2", num_cpus=1, resources={"learner_node": 2})
        cluster.add_node(node_ip_address="127.0.0.3", num_cpus=1, resources={"rollout_node": 1})
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
        if session is not None:
            ray.init(address=session, log_to_driver=False)


def _actor_ip(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.util.get_node_ip_address()), timeout=60)


def _body_sessions_on_both_replicas(d) -> dict[str, str]:
    """Sessions named in the body (``session_id``, or ``user`` for every third: that user's conversation
    gets a session of its own, ``auto-user:LEN:USER/...``), one request each until both replicas served
    one, then a second request each (its id in the body again: the same session). Returns ``{session
    id: body field}``."""
    url = d.base_url + "/chat/completions"

    def chat(name, field, messages):
        body = {"model": d.cfg.serve.model_name, "max_tokens": 4, "messages": messages, field: name}
        r = httpx.post(url, json=body, timeout=120)
        sid = r.json().get("session_id") if r.status_code == 200 else None
        named = sid == name if field == "session_id" else str(sid).startswith(f"auto-user:{len(name)}:{name}/")
        assert r.status_code == 200 and named, r.text
        return r.json()["choices"][0]["message"], sid

    sent: dict[str, tuple[str, list, str]] = {}
    for i in range(24):  # each lands on either replica (a hash): both are reached after a few
        name, field = f"body-{i}", "user" if i % 3 == 2 else "session_id"
        messages = [{"role": "user", "content": f"What is {i} + 1?"}]
        reply, sid = chat(name, field, messages)
        sent[name] = (field, messages + [reply], sid)
        stats = serve_stats(session_ids=True)
        if i >= 2 and all(any(s.startswith("body-") for s in st["session_ids"]) for st in stats):
            break
    for name, (field, messages, sid) in sent.items():
        assert chat(name, field, messages + [{"role": "user", "content": "Correct, thanks!"}])[1] == sid
    return {sid: field for field, _, sid in sent.values()}


def test_learners_and_engine_on_their_own_nodes_train_two_updates(three_nodes, tiny_model, tmp_path, capsys):
    """The whole loop with the learner group on node 2 and the engine on node 3: 2 updates. The
    learners' rendezvous and the weight-sync group's rendezvous are rank 0's own node address
    (127.0.0.2), not 127.0.0.1; ``sync.transport=auto`` chose the collective (engine on another host);
    the engine serves v2. Two PolicyServer replicas (``serve.num_replicas=2``): both served traffic,
    every session (X-Session-Id from the simulated users; body ``session_id`` / ``user`` from direct
    requests) stayed on one replica, and ``serve/replica_requests/<i>`` counts each replica's requests."""
    cfg = tiny_run_config(
        tiny_model,
        tmp_path / "run",
        overrides=[
            "learner.resources={learner_node: 1}",
            "rollout.resources={rollout_node: 1}",
            "sync.transport=auto",
            "trainer.num_steps=2",
            "trainer.batch_timeout_s=240",
            "env.concurrency=2",
            "env.max_tokens=16",
            "env.max_turns=2",
            "wandb.mode=disabled",
            f"serve.port={free_port()}",  # a cluster of its own: the session's Serve holds SERVE_PORT
            "serve.num_replicas=2",
            "serve.resources={serve_node: 1}",
        ],
    )
    d = Driver(cfg)
    try:
        d.setup()
        body_sessions = _body_sessions_on_both_replicas(d)
        assert [_actor_ip(w) for w in d.actors.learners.workers] == ["127.0.0.2", "127.0.0.2"]
        assert _actor_ip(d.actors.engines[0]) == "127.0.0.3"
        host, port = d.actors.learners.rendezvous
        assert host == "127.0.0.2" and port > 0
        assert ray.get(d.actors.learners.workers[1].__ray_call__.remote(lambda w: w.master_address)) == (host, port)
        assert d.actors.weight_sync.transport == "collective" and d.actors.weight_sync.rendezvous[0] == "127.0.0.2"
        out = capsys.readouterr().out
        assert (
            f"[clawray] placement: learners on 127.0.0.2 x2 (rendezvous 127.0.0.2:{port}), engines on 127.0.0.3 x1; "
            f"weight sync collective at 127.0.0.2:{d.actors.weight_sync.rendezvous[1]}"
        ) in out
        summary = d.run()
        assert summary["policy_version"] == 2 and summary["engine_versions"] == [2]
        lines = [json.loads(line) for line in open(f"{d.run_dir}/metrics.jsonl")]
        assert [m["policy_version"] for m in lines] == [1, 2] and all(m["sync/ok"] == 1.0 for m in lines)
        assert d.actors.weight_sync.rendezvous[0] == "127.0.0.2"
        replicas = serve_stats(session_ids=True)
        assert len(replicas) == 2 and all(st["requests"] > 0 and st["sessions"] > 0 for st in replicas), replicas
        on = [set(st["session_ids"]) for st in replicas]
        assert not on[0] & on[1], on  # no session reached both replicas
        served = {json.loads(line)["session_id"] for line in open(f"{d.run_dir}/records/turns.jsonl")}
        assert set(body_sessions) <= served and served <= on[0] | on[1]
        assert {"session_id", "user"} <= set(body_sessions.values())
        assert any(s.startswith("body-") for s in on[0]) and any(s.startswith("body-") for s in on[1])
        last = lines[-1]
        counts = [last[f"serve/replica_requests/{i}"] for i in range(2)]
        assert "serve/replica_requests/2" not in last and all(c > 0 for c in counts), last
    finally:
        d.shutdown()


def test_forced_ipc_across_hosts_is_refused_naming_the_engine(three_nodes, tiny_model, tmp_path):
    """sync.transport=ipc with the engine on another node than learner rank 0: setup fails with an
    error naming the engine, both hosts and the way out, instead of a hang or a silent copy."""
    from clawray.weight_sync import WeightSyncError

    cfg = tiny_run_config(
        tiny_model,
        tmp_path / "run",
        overrides=[
            "learner.resources={learner_node: 1}",
            "rollout.resources={rollout_node: 1}",
            "sync.transport=ipc",
            "learner.num_workers=1",
            "env.enabled=false",
            "wandb.mode=disabled",
            f"serve.port={free_port()}",  # a cluster of its own: the session's Serve holds SERVE_PORT
        ],
    )
    d = Driver(cfg)
    try:
        with pytest.raises(WeightSyncError) as err:
            d.setup()
        msg = str(err.value)
        assert "sync.transport=ipc needs every engine on the sender's host" in msg
        assert "learner rank 0 runs on 127.0.0.2 and rollout-0 on 127.0.0.3" in msg and "sync.transport=auto" in msg
    finally:
        d.shutdown()

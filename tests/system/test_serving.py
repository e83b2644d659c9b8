"""``clawray serve`` (issue #24.2): a checkpoint served as it is, at its own policy version, with no
learner, judge or checkpoint; sessions and exact prompt splicing as in training; turns recorded."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import httpx
import openai
import pytest
import ray

from ray import serve

from clawray.checkpoint import write_policy_card
from clawray.serve.instance import APP_NAME
from clawray.serve.instance import serve_running
from conftest import SERVE_PORT, shared_serve

pytestmark = pytest.mark.slow


def test_serve_a_checkpoint_at_its_version_without_training(ray_cluster, tiny_model, tmp_path):
    from clawray.config import load_config
    from clawray.run_lock import RunFolderInUse, RunFolderLock
    from clawray.serving import PolicyService, serve_policy, serving_overrides

    model = str(tmp_path / "ckpt-000007" / "model")
    shutil.copytree(tiny_model, model)
    write_policy_card(model, {"policy_version": 7, "engine": {"backend": "hf", "dtype": "float32"}})
    assert serving_overrides(model) == [f"model.path={model}", "rollout.backend=hf", "rollout.dtype=float32"]
    run_dir = tmp_path / "serve"
    port = SERVE_PORT  # the session's Serve: the server deploys into it and deletes only its app
    cfg = load_config(
        ["conf/rl.yaml", "conf/cpu.yaml"],
        [
            f"run_dir={run_dir}",
            *serving_overrides(model),
            "rollout.num_cpus=0.25",
            "rollout.torch_threads=1",
            f"serve.port={port}",
        ],
    )
    stop = threading.Event()
    result = []
    server = threading.Thread(target=lambda: result.append(serve_policy(cfg, stop)))
    server.start()
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(base.removesuffix("/v1") + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        with pytest.raises(RunFolderInUse):  # the folder is this server's
            RunFolderLock(str(run_dir)).acquire()
        client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "1+1?"}]
        first = client.chat.completions.create(
            model="m", messages=messages, max_tokens=4, seed=1, extra_headers={"X-Session-Id": "ab-1"}
        )
        assert (first.model_extra["policy_version"], first.model_extra["turn_index"]) == (7, 1)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and 2+2?"}]
        second = client.chat.completions.create(
            model="m", messages=messages, max_tokens=4, seed=2, extra_headers={"X-Session-Id": "ab-1"}
        )
        assert (second.model_extra["policy_version"], second.model_extra["turn_index"]) == (7, 2)
        health = httpx.get(base.removesuffix("/v1") + "/health", timeout=10).json()
        assert health["policy_versions"] == [7] and health["learners"] == [] and health["judges"] == []
    finally:
        stop.set()
        server.join(120)
    assert result == [0] and not server.is_alive()
    turns = [json.loads(line) for line in open(run_dir / "records" / "turns.jsonl")]
    assert [(t["session_id"], t["turn_index"], t["policy_version"]) for t in turns] == [("ab-1", 1, 7), ("ab-1", 2, 7)]
    assert not os.path.exists(run_dir / "checkpoints") and not os.path.exists(run_dir / "journal")
    lock = RunFolderLock(str(run_dir))
    lock.acquire()  # released at the stop
    lock.release()
    assert ray.is_initialized()  # the test's cluster: not this server's to stop
    # it deployed into the cluster's running Serve: it deleted its app and left Serve running
    assert serve_running() and APP_NAME not in serve.status().applications
    assert PolicyService(cfg).version == 7


def test_a_deploy_where_serve_runs_on_another_port_is_refused_at_once(ray_cluster, tiny_model):
    """Serve keeps the address it first started on: a run asking for another port is refused before
    anything is deployed, naming the running address and the settings that reach it (before, the
    run waited 30 s for an answer that could not come)."""
    from clawray.config import ServeConfig
    from clawray.ray_env import free_port
    from clawray.serve.deploy import deploy_policy_server

    shared_serve()
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        deploy_policy_server(tiny_model, [], None, ServeConfig(port=port), 256)
    assert time.monotonic() - t0 < 10
    assert str(err.value) == (
        f"Ray Serve already runs in this Ray cluster with its HTTP proxy on 127.0.0.1:{SERVE_PORT} (it keeps "
        f"the address it first started on), not on serve.host=127.0.0.1 serve.port={port}: set "
        f"serve.host=127.0.0.1 serve.port={SERVE_PORT}, or use a cluster without Serve"
    )
    assert APP_NAME not in serve.status().applications

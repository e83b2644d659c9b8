"""Shared fixtures: the tiny model (built once) and one local Ray head node for the whole session.

The head node is started with ``ray start --head`` (not ``ray.init``) so that the job-submission test
can submit to the same cluster through its dashboard; every Ray test connects to it. Ray Serve runs
in it for the whole session on :data:`SERVE_PORT` (Serve keeps the address it first started on):
each run deploys its app into it and deletes only that app at its end, as on a shared cluster
(a Serve start and stop per run cost ~8 s on 2 cores); a run on a cluster of its own uses another port.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from clawray.ray_env import LOOPBACK_ENV, free_port

for _k, _v in LOOPBACK_ENV.items():
    os.environ.setdefault(_k, _v)
# the test cluster lives on loopback only and is torn down at the end of the session
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# the proxy's header deadline (clawray/serve/guard.py), short so a test can watch it close a connection
os.environ.setdefault("CLAWRAY_HEADER_TIMEOUT_S", "5")


#: The port of the session cluster's Ray Serve HTTP proxy (:func:`shared_serve`).
SERVE_PORT = free_port()


def shared_serve() -> str:
    """The session cluster's Ray Serve on 127.0.0.1::data:`SERVE_PORT` (started again if a test
    stopped it); returns its root URL. A test's apps are deleted by name at its end, never Serve."""
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT}, logging_config={"enable_access_log": False})
    return f"http://127.0.0.1:{SERVE_PORT}"


def openclaw_root_or_skip() -> str:
    """The folder the OpenClaw tests install OpenClaw into (``$CLAWRAY_OPENCLAW_ROOT``, else
    clawray.openclaw's default); skips the test, saying why, where it is not installed yet and the
    npm registry cannot be reached."""
    import httpx

    from clawray import openclaw

    root = os.environ.get("CLAWRAY_OPENCLAW_ROOT", str(openclaw.DEFAULT_ROOT))
    if (openclaw.Path(root) / "node_modules" / "openclaw" / "openclaw.mjs").exists():
        return root
    try:
        reachable = httpx.get("https://registry.npmjs.org/openclaw", timeout=15).status_code < 500
    except httpx.HTTPError:
        reachable = False
    if not reachable:
        pytest.skip("the npm registry (registry.npmjs.org) cannot be reached: OpenClaw cannot be installed")
    return root


#: The server tests' SessionTracker config: sessions stay open 10 minutes, truncated replies are not trained.
MASKED_SESSIONS = {"session": {"idle_timeout_s": 600.0, "truncated": "mask"}}


def make_turn(session: str, history: list, reply: str, version: int = 0, tools: list | None = None):
    """A served main-line turn for session tests: prompt ids [1, 2, 3], response ids [7, 8] with
    log-probs [-0.5, -0.25], policy ``version``, the reply as the assistant message (index assigned
    by the tracker)."""
    from clawray.types import Turn

    return Turn(
        session_id=session,
        turn_index=0,
        messages=list(history),
        response_message={"role": "assistant", "content": reply},
        prompt_ids=[1, 2, 3],
        response_ids=[7, 8],
        rollout_logprobs=[-0.5, -0.25],
        policy_version=version,
        finish_reason="stop",
        tools=tools,
    )


def tiny_run_config(tiny_model: str, run_dir, presets=(), overrides=()):
    """A run config for the whole loop on the tiny model on 2 CPU cores: hf engine, feedback judge,
    batches of 2, no evaluation (tests that want it turn it on), the session's Serve port, conf/rl.yaml's
    staleness cap (2; cpu.yaml raises it for SmolLM2's slower learners); ``overrides`` (``key=value``)
    come last."""
    from clawray.config import load_config

    return load_config(
        ["conf/rl.yaml", "conf/cpu.yaml", *presets],
        [
            f"model.path={tiny_model}",
            "rollout.backend=hf",
            "rollout.num_cpus=0.25",
            "rollout.torch_threads=1",
            "judge.backend=feedback",
            "trainer.batch_size=2",
            f"run_dir={run_dir}",
            f"serve.port={SERVE_PORT}",
            "eval.enabled=false",
            "queue.max_staleness=2",
            *overrides,
        ],
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of the tiny Qwen-style model + BPE tokenizer (clawray.model_folders.build_tiny_model)."""
    from clawray.model_folders import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A 2-CPU Ray head node on 127.0.0.1 with Ray Serve on :data:`SERVE_PORT`; yields
    ``{"address", "dashboard"}``."""
    import ray

    port, dash = free_port(), free_port()
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    temp = str(tmp_path_factory.mktemp("ray"))
    subprocess.run(
        [
            ray_bin,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=2",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            "--include-dashboard=true",
            # own agent ports: another Ray on this machine must not take the job agent's default
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    try:
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
        shared_serve()
        yield {"address": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dash}"}
    finally:
        ray.shutdown()
        _stop_cluster(temp, f"--address=127.0.0.1:{port}")


def _stop_cluster(temp_dir: str, gcs_address: str = "") -> None:
    """Stop only this session's cluster: every process whose command line names its temp dir, and
    their descendants (agents rename themselves, e.g. ``ray::DashboardAgent``, and the client server
    does not name the dir); ``ray stop`` would stop every Ray cluster on the machine."""
    import psutil

    procs: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in arg or (gcs_address and gcs_address in arg) for arg in p.info["cmdline"] or []):
                procs[p.pid] = p
                procs.update({c.pid: c for c in p.children(recursive=True)})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    procs = list(procs.values())
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def scripted_engine_class():
    """Stands in for a RolloutEngine: replies with queued token ids (one token per stream item) and
    remembers every request, so outputs and recorded tokens can be checked exactly. ``rules``
    (``[(needle_ids, (ids, finish))]``) answer any request whose prompt holds ``needle_ids`` as a
    contiguous run, ahead of the queue and without using it (a client's housekeeping requests)."""

    def holds(prompt, needle):
        return any(prompt[i : i + len(needle)] == needle for i in range(len(prompt) - len(needle) + 1))

    class ScriptedEngine:
        def __init__(self):
            self.replies, self.requests, self.delay_s, self.rules = [], [], 0.0, []

        async def script(self, replies, delay_s=0.0, rules=()):
            self.replies, self.delay_s, self.rules = list(replies), delay_s, list(rules)

        async def _next(self, request):
            self.requests.append(request)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            ruled = [reply for needle, reply in self.rules if holds(request.prompt_ids, needle)]
            ids, finish = ruled[0] if ruled else self.replies.pop(0) if self.replies else ([1], "length")
            if finish == "refuse":  # as RolloutEngine when Backend.add refuses the request
                from clawray.actors.rollout import EngineRefusedError

                raise EngineRefusedError(
                    "the engine refused this request: the prompt is 255 tokens; max_model_len is 256"
                )
            if len(ids) > request.max_tokens:  # cut like a real engine
                ids, finish = ids[: request.max_tokens], "length"
            return {
                "response_ids": ids,
                "logprobs": [-0.01 * (i + 1) for i in range(len(ids))],
                "finish_reason": finish,
                "policy_version": 3,
                "engine": "scripted",
            }

        async def generate(self, request, wait_s=None):
            return await self._next(request)

        async def generate_stream(self, request, wait_s=None):
            if self.replies and self.replies[0][1] == "refuse-late":  # refused after the admission
                self.replies.pop(0)
                yield {"admitted": True}
                self.replies.insert(0, ([], "refuse"))
            out = await self._next(request)
            yield {"admitted": True}
            for t in out["response_ids"]:
                yield {"token_ids": [t]}
            yield {**out, "done": True}

        async def seen(self):
            return self.requests

        async def stats(self):
            return {"name": "scripted", "version": 3, "requests": len(self.requests)}

        async def is_paused(self):
            return False

        async def get_version(self):
            return 3

    return ScriptedEngine

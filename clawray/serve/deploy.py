"""Starting the PolicyServer as a Ray Serve application and waiting until it answers.

Owns: the deployment's options (replicas, CPUs, resources, session-affine routing), the checks made
before it starts (the chat template's tool-call format, Serve's address, an endpoint exposed without an
API key) and the wait for it to run. Must not: serve a request (:mod:`clawray.serve.app`).
"""

from __future__ import annotations

import time
from typing import Any

from ray import serve

from clawray.config import ServeConfig, section
from clawray.serve.app import PolicyServer
from clawray.serve.instance import APP_NAME, ServerStartError, check_serve_address

# seconds a deployment may take to run (its replicas start while a driver builds its learners)
DEPLOY_TIMEOUT_S = 300.0


def deploy_policy_server(
    model_path: str,
    engines: list,
    tracker: Any,
    cfg: ServeConfig,
    max_model_len: int,
    actors: dict | None = None,
) -> str:
    """Start Serve on ``cfg.host:cfg.port`` and submit the PolicyServer (``cfg``, ``max_model_len``,
    ``actors``: see :class:`PolicyServer`) as ``cfg.num_replicas`` replicas, each with ``cfg.num_cpus``
    CPUs and the custom Ray ``cfg.resources``; more than one replica routes by session
    (:func:`clawray.serve.routing.router_config`). Returns the base URL (``.../v1``) at once, while
    the replicas start (a driver builds its learners meanwhile); :func:`wait_policy_server` waits
    until it answers.

    Raises:
        ConfigError: ``cfg`` is a mapping that does not fit :class:`~clawray.config.ServeConfig`.
        ValueError: the model's chat template renders tools in a format the reply parser does not
            read (:func:`clawray.serve.reply.tool_call_format`).
        ServerStartError: Ray Serve already runs in the cluster on another host or port.
    """
    from transformers import AutoTokenizer

    from clawray.serve.reply import tool_call_format
    from clawray.serve.routing import router_config

    cfg = section(ServeConfig, cfg)
    tool_call_format(AutoTokenizer.from_pretrained(model_path).chat_template)  # an unknown format: refused now
    check_serve_address(cfg.host, cfg.port)  # Serve keeps its first address: another one is refused now
    if warning := exposure_warning(cfg.host, cfg.api_key):
        print(f"[clawray] WARNING: {warning}", flush=True)
    # one access-log line per request floods a training console; errors are still logged
    serve.start(http_options={"host": cfg.host, "port": cfg.port}, logging_config={"enable_access_log": False})
    options: dict[str, Any] = {"num_replicas": cfg.num_replicas}
    if router_config(cfg.num_replicas) is not None:
        options["request_router_config"] = router_config(cfg.num_replicas)
    server = PolicyServer.options(
        ray_actor_options={"num_cpus": cfg.num_cpus, "resources": dict(cfg.resources)},
        logging_config={"enable_access_log": False},
        **options,
    )
    application = server.bind(model_path, engines, tracker, cfg, max_model_len, actors)
    serve.run_many(
        [serve.RunTarget(application, name=APP_NAME, route_prefix="/")],
        wait_for_ingress_deployment_creation=False,
        wait_for_applications_running=False,
    )
    return f"http://{cfg.host}:{cfg.port}/v1"


def exposure_warning(host: str, api_key: str) -> str | None:
    """What a user must hear when the endpoint listens beyond loopback without ``serve.api_key``:
    anyone who reaches the address is served and their turns train the policy. None otherwise."""
    from clawray.ray_env import is_loopback

    if api_key or is_loopback(host):
        return None
    return (
        f"serve.host={host} listens beyond loopback without serve.api_key: anyone who reaches it is served "
        "and their conversations train the policy; set serve.api_key (clients send Authorization: Bearer KEY)"
    )


def wait_policy_server(base_url: str, timeout_s: float = DEPLOY_TIMEOUT_S) -> None:
    """Wait until the deployed PolicyServer runs (every replica up: session-affine routing needs the
    whole replica set before the first request) and answers ``GET /health`` with 200 at ``base_url``.

    Raises:
        ServerStartError: the deployment failed (Serve's message: e.g. a replica's constructor raised);
            or it is running and nothing answers 30 s later (e.g. Serve was already running in
            this Ray cluster on another port: Serve keeps its first port); or ``timeout_s`` passed.
    """
    import httpx

    health, start = base_url.removesuffix("/v1") + "/health", time.monotonic()
    running_since = None
    while True:
        state = serve.status().applications.get(APP_NAME)
        status = str(getattr(state, "status", ""))
        if status.endswith("DEPLOY_FAILED"):
            raise ServerStartError(f"the policy server failed to deploy: {state.message}")
        if status.endswith("RUNNING"):
            running_since = time.monotonic() if running_since is None else running_since
            try:
                if httpx.get(health, timeout=10.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - running_since > 30.0:
                raise ServerStartError(
                    f"the policy server does not answer at {health}; is Ray Serve already running "
                    "in this cluster on another port? (Serve keeps the port it first started on)"
                )
        if time.monotonic() - start > timeout_s:
            raise ServerStartError(f"the policy server is not running {timeout_s:g} s after its deployment ({status})")
        time.sleep(0.5)


def start_policy_server(
    model_path: str,
    engines: list,
    tracker: Any,
    cfg: ServeConfig,
    max_model_len: int,
    actors: dict | None = None,
) -> str:
    """:func:`deploy_policy_server`, then :func:`wait_policy_server`; returns the base URL (``.../v1``).

    Raises:
        the errors of both.
    """
    base_url = deploy_policy_server(model_path, engines, tracker, cfg, max_model_len, actors)
    wait_policy_server(base_url)
    return base_url

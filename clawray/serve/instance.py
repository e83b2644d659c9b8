"""The Ray Serve instance a run deploys into: whether it already runs and where it listens, and
stopping what the run started (all of Serve when the run started it, else only its app).

Owns: :class:`ServeLease` (a run's deploy and release), :func:`serve_running`,
:func:`serve_http_address`, :func:`check_serve_address`, :func:`release_serve`, :func:`shutdown_serve`. Must not: stop Ray or any actor other than Serve's,
stop a Serve instance (and the other applications in it) that the run found running, or raise when
no Serve instance runs.

``serve.shutdown()`` calls ``ServeController.graceful_shutdown(wait=True)``: a task that waits until
the controller kills itself (``ray.kill``). The controller is created with infinite task retries,
so its raylet then logs "Task ServeController.graceful_shutdown failed. There are infinite retries
remaining ... killed by `ray.kill`" on every clean shutdown (relayed to the driver's terminal).
:func:`shutdown_serve` asks for the same graceful shutdown without waiting in a task
(``wait=False``), waits for the controller to be gone by polling its name, then lets
``serve.shutdown()`` clear the driver's Serve client (it finds the controller dead and returns).
Serve's deployments, proxies and controller end exactly as with ``serve.shutdown()``.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

APP_NAME = "clawray"  # the policy server's Serve application (clawray.resume reaches the replicas by it)


class ServerStartError(RuntimeError):
    """The policy server cannot come up: Serve runs elsewhere in the cluster, the deployment failed, or
    it does not answer; the message is one line with the settings to change."""


def _controller():
    """The Serve controller of the connected Ray cluster, or None when Serve does not run there."""
    import ray

    try:
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except Exception:  # noqa: BLE001 - no Serve instance (or another Ray layout)
        return None


def serve_running() -> bool:
    """Whether a Serve instance already runs in the connected Ray cluster (a shared cluster's, or a
    test session's): a run that deploys into it must leave it, and its other applications, running."""
    return _controller() is not None


def serve_http_address() -> tuple[str, int] | None:
    """``(host, port)`` of the running Serve instance's HTTP proxy, or None when Serve does not run.
    Serve keeps the address it first started on: a deploy on another one is never reachable there."""
    import ray

    controller = _controller()
    if controller is None:
        return None
    try:
        http = ray.get(controller.get_http_config.remote(), timeout=30)
    except Exception:  # noqa: BLE001 - another Serve version: the deploy's own wait reports it
        return None
    return str(http.host), int(http.port)


def port_free(host: str, port: int) -> bool:
    """Whether a listening socket can bind ``host:port`` now (``SO_REUSEADDR``, as Serve's proxy binds:
    a port left in TIME_WAIT by a run that just ended is free). An address this host does not have
    counts as free: Serve reports that itself."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            return e.errno != errno.EADDRINUSE
    return True


def check_serve_address(host: str, port: int) -> None:
    """Refuse a deploy on ``host:port`` when Serve already runs in the cluster on another address
    (it keeps the one it first started on: the deploy would never be reachable there), or, Serve not
    running, when another program holds the port on this host (Serve's proxy would fail to bind it).

    Raises:
        ServerStartError: naming the running address and the settings that reach it, or the port in use.
    """
    running = serve_http_address()
    if running is None and not port_free(host, port):
        raise ServerStartError(
            f"serve.port={port} is in use on {host} by another program: set serve.port to a free port"
        )
    if running is not None and running != (host, port):
        raise ServerStartError(
            f"Ray Serve already runs in this Ray cluster with its HTTP proxy on {running[0]}:{running[1]} "
            f"(it keeps the address it first started on), not on serve.host={host} serve.port={port}: "
            f"set serve.host={running[0]} serve.port={running[1]}, or use a cluster without Serve"
        )


def release_serve(app_name: str, owned: bool) -> None:
    """Stop what a run put into Serve: all of Serve when the run started it (``owned``,
    :func:`shutdown_serve`), else only its application ``app_name`` (``serve.delete``: the instance,
    its HTTP proxy and every other application keep running). Never raises for an absent app."""
    from ray import serve

    if owned:
        shutdown_serve()
        return
    try:
        serve.delete(app_name)
    except Exception:  # noqa: BLE001 - already gone, or Serve stopped meanwhile
        pass


class ServeLease:
    """A run's hold on Ray Serve: :meth:`deploy` notes whether Serve already ran (before deploying),
    :meth:`release` stops what the run started (:func:`release_serve`), once; a run that never
    deployed releases nothing (a run refused at start-up leaves another's Serve alone)."""

    def __init__(self, app_name: str):
        self.app_name = app_name
        self.owned: bool | None = None  # None: nothing deployed (or already released)

    def deploy(self, deploy: Callable[[], T]) -> T:
        """Call ``deploy`` (which starts Serve if needed and submits the app); returns its result. The
        lease holds from before the call, so a deploy that fails part-way is still released."""
        self.owned = not serve_running()
        return deploy()

    def release(self) -> None:
        """Stop what :meth:`deploy` put into Serve; a no-op before a deploy and after a release."""
        owned, self.owned = self.owned, None
        if owned is not None:
            release_serve(self.app_name, owned)


def shutdown_serve(timeout_s: float = 30.0) -> None:
    """Shut down the Serve instance of the connected Ray cluster, if any (see the module docstring).

    Falls back to ``serve.shutdown()`` when the controller cannot be reached by name or does not
    exit within ``timeout_s`` seconds. Never raises for an absent Serve instance.
    """
    import ray
    from ray import serve

    controller = _controller()  # None: no Serve instance (or another Ray layout): Serve's own path
    if controller is not None:
        try:
            ray.get(controller.graceful_shutdown.remote(False), timeout=timeout_s)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and _controller() is not None:  # the name goes with the actor
                time.sleep(0.2)
        except Exception:  # noqa: BLE001 - serve.shutdown() below still shuts it down
            pass
    serve.shutdown()

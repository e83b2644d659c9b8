"""The Ray Serve instance a run deploys into: whether it already runs and where it listens, and
stopping what the run started (all of Serve when the run started it, else only its app).

Owns: :func:`serve_running`, :func:`serve_http_address`, :func:`release_serve`, :func:`shutdown_serve`.
Must not: stop Ray or any actor other than Serve's, stop a
Serve instance (and the other applications in it) that the run found running, or raise when no
Serve instance runs.

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

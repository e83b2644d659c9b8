"""Shut Ray Serve down without an error-looking line.

Owns: how clawray stops Ray Serve (:func:`shutdown_serve`). Must not: stop Ray or any actor other
than Serve's, or raise when no Serve instance runs.

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


def shutdown_serve(timeout_s: float = 30.0) -> None:
    """Shut down the Serve instance of the connected Ray cluster, if any (see the module docstring).

    Falls back to ``serve.shutdown()`` when the controller cannot be reached by name or does not
    exit within ``timeout_s`` seconds. Never raises for an absent Serve instance.
    """
    import ray
    from ray import serve

    try:
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except Exception:  # noqa: BLE001 - no Serve instance (or another Ray layout): Serve's own path
        controller = None
    if controller is not None:
        try:
            ray.get(controller.graceful_shutdown.remote(False), timeout=timeout_s)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
                except ValueError:  # gone: the name is released when the actor dies
                    break
                time.sleep(0.2)
        except Exception:  # noqa: BLE001 - serve.shutdown() below still shuts it down
            pass
    serve.shutdown()

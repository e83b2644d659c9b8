"""Start or join Ray the way clawray needs it: loopback only, no token-auth surprises."""

from __future__ import annotations

import os
import socket

from clawray.serve.guard import PROXY_CALLBACK_ENV

# Ray otherwise binds to the machine's first non-loopback address even when asked for 127.0.0.1
# (notes/env-feasibility.md, "Pitfalls"); clawray serves and trains on loopback by default.
# The Serve proxy runs clawray's HeaderGuard (clawray/serve/guard.py) before it decodes any header.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", **PROXY_CALLBACK_ENV}


def apply_loopback_env() -> None:
    """Set the environment variables that keep Ray on 127.0.0.1 (unless the user set them)."""
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)


def init_ray(address: str = "", num_cpus: int = 0) -> None:
    """Start a local Ray (``address=""``) or join a cluster (``"auto"`` or ``host:port``).

    Idempotent: does nothing when Ray is already initialised in this process (e.g. inside a Ray job).
    A Python SIGTERM handler installed before the call stays installed.
    """
    import ray

    import signal
    import threading

    if ray.is_initialized():
        return
    apply_loopback_env()
    on_term = signal.getsignal(signal.SIGTERM)
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=True,
                 _node_ip_address="127.0.0.1")
    # ray.init installs its own C++ SIGTERM handler (it kills the process at once); put back a
    # Python handler set before (the CLI's: unwind like Ctrl-C, so shutdown and checkpoint run)
    if callable(on_term) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

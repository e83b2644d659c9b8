"""Start or join Ray the way clawray needs it: loopback only, no token-auth surprises.

Also the loopback binding of torch.distributed's own sockets (rendezvous TCPStore servers and gloo
pairs), which torch otherwise opens on every interface (a TCPStore server listens on ``::``) or on the
address the host name resolves to: :func:`tcp_store` and :func:`use_loopback_gloo`. Every group
clawray builds (the learners' FSDP group, the weight-sync group) lives on one host, on 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
from typing import Any

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
    if not address and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        # Ray read the variable when it was first imported, perhaps before it was set here: without
        # this, ray.init turns 127.0.0.1 into the machine's external address and every Ray process
        # listens on all interfaces
        import ray._private.ray_constants as ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
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


def loopback_interface() -> str:
    """Name of the network interface that holds 127.0.0.1 (``lo`` on Linux).

    Raises:
        RuntimeError: no interface has 127.0.0.1.
    """
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    raise RuntimeError("no network interface has the address 127.0.0.1")


def use_loopback_gloo() -> None:
    """Make gloo process groups created afterwards in this process open their pair sockets on the
    loopback interface (``GLOO_SOCKET_IFNAME``; a value the user set is kept)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: Any) -> Any:
    """A ``torch.distributed.TCPStore`` whose server (``is_master``) listens on ``host`` only: the
    socket is bound here and handed to torch (``master_listen_fd``), since torch's own server binds
    every interface and its store unpickles nothing but trusts every client.

    Args:
        host, port: the rendezvous address (``127.0.0.1`` in single-node runs).
        world_size: number of members; timeout: a ``datetime.timedelta``.

    Raises:
        OSError: the port is taken. ``torch.distributed.DistStoreError``: rendezvous timed out.
    """
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(max(128, world_size))
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.detach())

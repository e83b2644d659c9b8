"""Start or join Ray the way clawray needs it: loopback only, no token-auth surprises.

Owns: how clawray starts or joins Ray (loopback environment, a new local instance, the signal handlers
kept), the actors' control concurrency group, where torch.distributed's sockets bind and what counts as
an actor's death. Must not: import Ray, torch or a clawray module at module level: the CLI sets the
loopback environment before anything imports Ray, and the Serve proxy's guard is named by import path.

Also where torch.distributed's own sockets bind (rendezvous TCPStore servers and gloo pairs), which
torch otherwise opens on every interface (a TCPStore server listens on ``::``) or on the address the
host name resolves to: :func:`tcp_store`, :func:`reserve_rendezvous` and :func:`use_node_gloo`.

Addresses come from where the actors run, never from the driver's host: rank 0 of each group clawray
builds (the learners' FSDP group, the weight-sync group) binds its rendezvous on *its own node's* Ray
address (:func:`node_ip`) and publishes ``(node_ip, port)`` to the other members. In a local run
(:func:`init_ray` with no address, or a cluster started with ``--node-ip-address=127.0.0.1``) the node
address is 127.0.0.1, so everything stays on loopback; on a cluster node it is the node's cluster
address (the one Ray itself binds to), never every interface. The only 127.0.0.1 written here is that
local default.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any

#: Ray Serve runs the Starlette middlewares this callable returns around its HTTP proxy: clawray's
#: HeaderGuard (:func:`clawray.serve.guard.proxy_middlewares`, named by its import path so this
#: bottom-layer module imports nothing from the serving layer).
PROXY_CALLBACK_ENV = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "clawray.serve.guard.proxy_middlewares"}

# Ray otherwise binds to the machine's first non-loopback address even when asked for 127.0.0.1
# (notes/env-feasibility.md, "Pitfalls"); clawray serves and trains on loopback by default.
# The Serve proxy runs clawray's HeaderGuard (clawray/serve/guard.py) before it decodes any header.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", **PROXY_CALLBACK_ENV}

#: The concurrency group of an async actor's control methods (counters for the driver's metrics):
#: Ray runs each group on its own event loop thread, so these never queue behind the actor's work
#: (a judge with thousands of calls waiting on a slow endpoint answered ``get_stats`` last).
CONTROL_GROUP = "control"
CONTROL_GROUPS = {CONTROL_GROUP: 2}


def apply_loopback_env() -> None:
    """Set the environment variables that keep Ray on 127.0.0.1 (unless the user set them)."""
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)


def init_ray(address: str = "", num_cpus: int = 0) -> None:
    """Start a local Ray (``address=""``, always a new one, even beside a running cluster) or join a
    cluster (``"auto"`` or ``host:port``).

    Idempotent: does nothing when Ray is already initialised in this process (e.g. inside a Ray job).
    Python SIGINT/SIGTERM handlers installed before the call stay installed.
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
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(
            # "local": a new Ray of our own even when this machine already runs one (`ray start
            # --head`, another job's cluster); without it ray.init joins that cluster and then refuses
            # num_cpus ("When connecting to an existing cluster, num_cpus ... must not be provided")
            address="local",
            num_cpus=num_cpus or os.cpu_count(),
            include_dashboard=False,
            log_to_driver=True,
            _node_ip_address="127.0.0.1",
        )
    # ray.init installs its own C++ SIGTERM handler (it kills the process at once); put back the
    # Python handlers set before (the CLI's: unwind like Ctrl-C within a deadline, clawray.interrupt)
    if threading.current_thread() is threading.main_thread():
        for sig, handler in handlers.items():
            if callable(handler):
                signal.signal(sig, handler)


def actor_death_errors() -> tuple[type[BaseException], ...]:
    """The errors of a Ray call that mean its actor died: ``RayActorError`` (``ActorDiedError``,
    ``ActorUnavailableError``, ...) and ``OutOfMemoryError`` (Ray's memory monitor killed the worker
    that ran the call; its actor is dead or restarting, like any other death)."""
    import ray

    return (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)


def death_reason(e: BaseException) -> str:
    """How an actor died, in words, from the error of a call to it."""
    import ray

    chain: BaseException | None = e
    while chain is not None:
        if isinstance(chain, ray.exceptions.OutOfMemoryError):
            return "killed by Ray's memory monitor, out of host memory"
        chain = chain.__cause__ or chain.__context__
    return "killed or crashed"


def compute_device() -> str:
    """``"cuda"`` when the calling process may compute on a GPU, else ``"cpu"``: in a Ray actor only
    when Ray gave it one (``num_gpus`` > 0; a fraction counts), elsewhere when CUDA is available.
    Ray 2.60 leaves ``CUDA_VISIBLE_DEVICES`` alone for an actor that asked for no GPU
    (ray-project/ray#54868), so ``torch.cuda.is_available()`` alone put such actors on GPU 0."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    import ray

    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        return "cuda" if ray.get_gpu_ids() else "cpu"
    return "cuda"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (default: this machine's loopback) that is free right now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """The Ray node address of this process (``ray.util.get_node_ip_address()``): 127.0.0.1 in a
    local run, the node's cluster address on a cluster node. Call it inside an actor to learn where
    that actor runs."""
    import ray

    return ray.util.get_node_ip_address()


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) is a loopback address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def interface_of(ip: str) -> str | None:
    """Name of the network interface that holds ``ip`` or whose subnet contains it (``lo`` for
    127.0.0.0/8 on Linux); None when no interface does (e.g. an address behind NAT)."""
    import psutil

    want = ipaddress.ip_address(ip.strip("[]"))
    subnet_match = None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                addr = ipaddress.ip_address(a.address.split("%")[0])
            except ValueError:
                continue
            if addr == want:
                return name
            if subnet_match is None and a.netmask and addr.version == want.version:
                try:
                    if want in ipaddress.ip_network(f"{addr}/{a.netmask}", strict=False):
                        subnet_match = name
                except ValueError:
                    pass
    return subnet_match


def loopback_interface() -> str:
    """Name of the network interface that holds 127.0.0.1 (``lo`` on Linux).

    Raises:
        RuntimeError: no interface has 127.0.0.1.
    """
    name = interface_of("127.0.0.1")
    if name is None:
        raise RuntimeError("no network interface has the address 127.0.0.1")
    return name


def use_node_gloo(rendezvous_host: str) -> None:
    """Make gloo process groups created afterwards in this process open their pair sockets on the
    loopback interface when the group's rendezvous is on loopback (a one-host group), else on the
    interface that holds this node's Ray address (:func:`node_ip`), via ``GLOO_SOCKET_IFNAME`` (a
    value already set, e.g. by the user, is kept). gloo listens on that interface's address."""
    if is_loopback(rendezvous_host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        return
    name = interface_of(node_ip())
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)


def use_loopback_gloo() -> None:
    """:func:`use_node_gloo` for a loopback rendezvous: gloo pairs on the loopback interface."""
    use_node_gloo("127.0.0.1")


# rank 0's rendezvous sockets, bound and listening, waiting for the tcp_store() call that serves them
_RESERVED: dict[tuple[str, int], socket.socket] = {}


def _listen(host: str, port: int, backlog: int = 128) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def reserve_rendezvous(host: str = "", port: int = 0) -> tuple[str, int]:
    """Rank 0 of a group: bind the group's rendezvous socket now, on this node, and keep it for the
    next ``tcp_store(host, port, ..., is_master=True)`` in this process (no window in which another
    process could take the port). An earlier reservation not yet used is closed.

    Args:
        host: the address to bind; "" = this node's Ray address (:func:`node_ip`).
        port: the port; 0 = a free one chosen by the kernel.

    Returns:
        ``(host, port)`` to publish to the other members.

    Raises:
        OSError: the port is taken.
    """
    host = host or node_ip()
    for sock in _RESERVED.values():
        sock.close()
    _RESERVED.clear()
    sock = _listen(host, port)
    port = sock.getsockname()[1]
    _RESERVED[(host, port)] = sock
    return host, port


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: Any) -> Any:
    """A ``torch.distributed.TCPStore`` whose server (``is_master``) listens on ``host`` only: the
    socket is bound here, or taken from :func:`reserve_rendezvous`, and handed to torch
    (``master_listen_fd``), since torch's own server binds every interface and its store unpickles
    nothing but trusts every client.

    Args:
        host, port: the rendezvous address, published by rank 0 (its node's address; 127.0.0.1 in a
            local run).
        world_size: number of members; timeout: a ``datetime.timedelta``.

    Raises:
        OSError: the port is taken. ``torch.distributed.DistStoreError``: rendezvous timed out.
    """
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    sock = _RESERVED.pop((host, port), None) or _listen(host, port, max(128, world_size))
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.detach())

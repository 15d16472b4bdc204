"""Checks of the rendezvous endpoint that ``autopar run`` makes before torchrun starts.

torchrun connects as a client when it cannot bind the rendezvous port, so a port held by
another process, or an endpoint nobody serves, leaves it waiting without a word. The node
that hosts the store (the endpoint names this machine, and it is node 0 or the only node)
must be able to bind the port; any other node must reach it within ``--rdzv-wait-s``.
``--standalone`` picks a free port itself and needs no check.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from pathlib import Path

from autopar.errors import ConfigError

RDZV_DEFAULT_PORT = 29400
"""torchrun's c10d rendezvous port when ``--rdzv-endpoint`` names none."""


def check_rendezvous(endpoint: str, *, flag: str, node_rank: int | None, nnodes: int, wait_s: float) -> None:
    """Refuse a rendezvous ``endpoint`` (``host[:port]``, given as ``flag``) this node cannot
    use: bind its port where this node hosts the store (the host is this machine and
    ``node_rank`` is 0 or unset), else connect to it within ``wait_s`` seconds."""
    host, port = _parse_endpoint(endpoint, flag)
    if node_rank or not _is_this_machine(host):
        _check_reachable(host, port, wait_s, flag)
    else:
        _check_bindable(host, port, flag, node_rank=node_rank, nnodes=nnodes)


def _parse_endpoint(endpoint: str, flag: str) -> tuple[str, int]:
    """``host[:port]`` as torchrun reads it, its errors as a ConfigError."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        return parse_rendezvous_endpoint(endpoint, default_port=RDZV_DEFAULT_PORT)
    except ValueError:
        raise ConfigError(
            f"{flag} {endpoint!r} is not allowed: it must be host:port with a port from 1 to 65535, "
            f"e.g. node0.cluster:{RDZV_DEFAULT_PORT}."
        ) from None


def _is_this_machine(host: str) -> bool:
    """Whether torchrun's c10d rendezvous will host its store here for ``host``: torch's own
    rule (a loopback address, this machine's name or one of its addresses)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    try:
        return _matches_machine_hostname(host)
    except OSError:  # this machine's own name does not resolve
        return False


def _check_bindable(host: str, port: int, flag: str, *, node_rank: int | None, nnodes: int) -> None:
    """Bind ``port`` on every interface, as torch's TCPStore server does, and let go."""
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    try:
        socket.create_server(("", port), family=family, dualstack_ipv6=family == socket.AF_INET6).close()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise ConfigError(
                f"the rendezvous port {port} on {host} cannot be bound ({exc.strerror}); pass {flag} "
                f"{host}:PORT with a port from 1024 to 65535 that this user may bind."
            ) from None
        if nnodes == 1:
            fix = f"omit {flag} (one node then picks a free port itself), pass another port"
        else:
            fix = "pass another port on every node"
            if node_rank is None:
                fix += " (or, for a second node on this machine, --node-rank 1 or more)"
        raise ConfigError(
            f"the rendezvous port {port} on {host} is held by another process{_port_holder(port)}; "
            f"{fix}, or stop that process."
        ) from None


def _check_reachable(host: str, port: int, wait_s: float, flag: str) -> None:
    """Connect to ``host:port``, retrying for ``wait_s`` seconds (the host's node may start
    later than this one)."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(
            f"the rendezvous host {host!r} of {flag} {host}:{port} does not resolve ({exc.strerror}); "
            f"pass node 0's hostname or address as seen from this node."
        ) from None
    deadline = time.monotonic() + wait_s
    while (reason := _connect_error(host, port)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if reason:
        raise ConfigError(
            f"the rendezvous endpoint {host}:{port} could not be reached within {wait_s:g} s ({reason}); start "
            f"'autopar run' on the node it names first, check {flag} and the firewall, or wait longer "
            f"with --rdzv-wait-s."
        )


def _connect_error(host: str, port: int) -> str:
    """Why a TCP connection to ``host:port`` failed within two seconds; empty when it
    succeeded."""
    try:
        socket.create_connection((host, port), timeout=2.0).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return ""


def _port_holder(port: int) -> str:
    """ " (pid P, NAME)" of the process holding TCP ``port`` on this machine, read from
    ``/proc``; empty where that cannot be known (not Linux, another user's process)."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] != "0":
                    sockets.add(f"socket:[{fields[9]}]")
    for fds in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in sockets for fd in fds.iterdir()):
                name = (fds.parent / "comm").read_text().strip()
                return f" (pid {fds.parent.name}, {name})"
    return ""

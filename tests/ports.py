"""Ports for the servers tests start on 127.0.0.1, picked where nothing else takes them.

A port the kernel hands out for ``bind(("127.0.0.1", 0))`` lies in its ephemeral range, which
every outgoing connection also draws from: between the test closing its probe socket and the
server it starts binding the port, any ``connect`` on the machine (the API server dialling
etcd, a client of another test) may take it as its local port, and the server fails with
"address already in use" (the control plane's start used to be tried twice to hide this).
These ports are picked below
that range, where the kernel never assigns one by itself, checked free by binding them, and
never handed out twice by one test process; what remains is another process picking the same
port from the same range at the same moment, which a random pick over thousands makes rare.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

__all__ = ["free_port", "free_ports"]

_given: set[int] = set()
_lock = threading.Lock()
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_SPAN = 12_000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now, below the ephemeral range, and new to this
    process."""
    high = _ephemeral_low()
    low = max(1024, high - _SPAN)
    with _lock:
        for _ in range(1000):
            port = random.randrange(low, high)
            if port in _given:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((host, port))
                except OSError:
                    continue
            _given.add(port)
            return port
    raise RuntimeError(f"no free port in {low}-{high} on {host} after 1000 tries")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports as `free_port` picks them."""
    return [free_port(host) for _ in range(count)]

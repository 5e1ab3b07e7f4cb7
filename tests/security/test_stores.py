"""A local rendezvous store is reachable from this machine's loopback address alone.

Finding: `malleus run`'s store (`python -m malleus.trainer store`, told 127.0.0.1) and the one
`malleus train` hosts listened on every interface (`*:PORT`): a client over 127.0.0.2 or ::1
wrote `rec/dead/3`. The attack here is that client: the real store process is started as the
runner starts it, then dialled on another loopback address and over IPv6 (refused), and on its
own address (served); its listening socket is read from /proc/net.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("torch")

from malleus.trainer.launch.rendezvous import READY, listening_store

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net")


def _listening(port: int) -> set[str]:
    """Local addresses of the sockets listening on `port` (IPv4 and IPv6), from /proc/net."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                found.add(address if len(address) == width else "?")
    return found


def _refused(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        try:
            s.connect((host, port))
        except (ConnectionRefusedError, OSError):
            return True
    return False


def test_the_runners_store_listens_on_loopback_alone() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "malleus.trainer", "store", "--host", "127.0.0.1", "--port", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until it listens (or ends: then fails below)
        assert line.startswith(READY), (line, proc.stderr.read() if proc.stderr else "")
        port = int(line.rsplit(":", 1)[1])
        assert _listening(port) == {"0100007F"}  # 127.0.0.1, nothing else
        assert _refused("127.0.0.2", port)
        if socket.has_ipv6:
            assert _refused("::1", port)
        assert not _refused("127.0.0.1", port)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_store_serves_its_own_address_and_refuses_the_others() -> None:
    import torch.distributed as dist

    server = listening_store("127.0.0.1", 0, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=timedelta(seconds=10))
    client.set("rec/dead/3", "x")
    assert server.get("rec/dead/3") == b"x"
    assert _listening(server.port) == {"0100007F"}
    assert _refused("127.0.0.2", server.port)

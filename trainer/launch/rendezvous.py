"""`python -m malleus.trainer store --host H --port P`: the job's rendezvous store, hosted by no rank.

Under torchrun (and in `malleus train`), rank 0 or the launcher hosts the TCPStore every rank
meets at; losing that process loses the job. A job that must survive the loss of any rank
(`MALLEUS_STORE=host:port`, see docs/architecture.md) meets at this process instead, which
`malleus run` starts first and stops last (and the operator may run beside the pods): it holds
nothing but the store, so no rank's death takes it down.

It prints exactly one line, ``store ready on H:P``, once it listens (``--port 0`` lets the OS
pick a free port, so concurrent runs never race for one), and serves until SIGTERM or SIGINT.
Its parent may write lines ``set KEY VALUE`` to its stdin, which it sets in the store: that is
how the torch-free runner tells the trainers what it saw (``malleus/0//rec/dead/GPU``: that
GPU's process exited, trainer/launch/distributed.py `DEAD_KEY`), its value sealed by the runner
with the job's key (trainer/world/sealed.py): this process never holds the key. Other lines
are ignored.

Security: a TCPStore has no authentication and no encryption: anyone who can connect can read
and overwrite every key, including the process group's rendezvous. Binding narrowly is the
protection: the default and what `malleus run` uses is 127.0.0.1 (this machine only); bind a
pod IP only inside a network the job's pods alone can reach (a NetworkPolicy). A TCPStore told
a host still listens on every interface (it takes the host for its clients only), so
`listening_store` binds the socket itself, on that one address, and hands it to the store.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from datetime import timedelta
from typing import Any, TextIO

__all__ = ["READY", "listening_store", "main", "serve"]

READY = "store ready on"
"""The first words of the one line printed once the store listens: ``store ready on H:P``."""


def listening_store(
    host: str, port: int = 0, *, timeout: timedelta, world_size: int | None = None
) -> Any:
    """A TCPStore server listening on `host`:`port` alone (port 0: the OS picks one; the
    store's `port` says which). The socket is bound here and passed to the store
    (`master_listen_fd`): given only a host, TCPStore binds every interface."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        bound = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # the store owns the descriptor from here (it closes it when it goes)
    return dist.TCPStore(
        host,
        bound,
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


def serve(host: str = "127.0.0.1", port: int = 0, *, stop: threading.Event | None = None) -> int:
    """Host a TCPStore on `host`:`port` until `stop` is set (or SIGTERM/SIGINT); returns 0."""
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        store = listening_store(host, port, timeout=timedelta(seconds=60))
        print(f"{READY} {host}:{store.port}", flush=True)
        threading.Thread(target=_commands, args=(store, sys.stdin), daemon=True).start()
        while not stop.wait(1.0):
            pass
        del store
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _commands(store: Any, stream: TextIO) -> None:
    """`set KEY VALUE` lines from the parent, until its end of the pipe closes."""
    try:
        for line in stream:
            parts = line.split(None, 2)
            if len(parts) == 3 and parts[0] == "set":
                store.set(parts[1], parts[2].strip())
    except (OSError, ValueError, RuntimeError):
        return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m malleus.trainer store",
        description="Host the job's rendezvous store (a TCPStore) until SIGTERM or SIGINT.",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: no auth)"
    )
    parser.add_argument("--port", type=int, default=0, help="port (0: the OS picks a free one)")
    args = parser.parse_args(argv)
    try:
        return serve(args.host, args.port)
    except (RuntimeError, OSError) as e:
        print(f"malleus store: could not serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1

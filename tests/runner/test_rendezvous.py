"""The job's rendezvous store as a process of its own (`python -m malleus.trainer store`)."""

from __future__ import annotations

import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_store_serves_until_sigterm_and_a_tcpstore_client_uses_it() -> None:
    dist = pytest.importorskip("torch.distributed")
    proc = subprocess.Popen(
        [sys.executable, "-m", "malleus.trainer", "store", "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("store ready on 127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])
        assert port > 0
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
        client.set("malleus/test", "hello")
        other = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
        assert other.get("malleus/test") == b"hello"
        assert other.add("counter", 2) == 2 and client.add("counter", 1) == 3
        del client, other
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert proc.stdout.read() == ""  # exactly one line
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_taken_port_is_an_error_not_a_hang() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "malleus.trainer", "store", "--port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1
    assert "could not serve on 127.0.0.1" in proc.stderr


def test_the_runner_side_sets_keys_through_the_servers_stdin(tmp_path: Path) -> None:
    dist = pytest.importorskip("torch.distributed")
    from malleus.control.sealed import store_key
    from malleus.runner.processes import StoreServer
    from malleus.trainer.world.sealed import TOKEN_FILE_ENV, Sealer, job_store_key

    token = tmp_path / "control-token"
    token.write_text("the-runs-token\n")
    server = StoreServer(sys.executable, tmp_path / "store.log", key=store_key("the-runs-token"))
    address = server.start(timeout=60)
    try:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1"
        # The runner's key must be the one the trainers read through their PrefixStore.
        from malleus.runner.supervise import DEAD_KEY
        from malleus.trainer.world.errors import DEAD_KEY as TRAINER_DEAD_KEY

        assert server.set(f"{DEAD_KEY}3", "1")  # unsealed: as a stranger would write it
        assert server.mark_dead(4, "hung")  # sealed with the key of the run's token
        client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=20))
        trainers = dist.PrefixStore("malleus/0/", client)
        trainers.wait([f"{TRAINER_DEAD_KEY}3", f"{TRAINER_DEAD_KEY}4"], timedelta(seconds=20))
        assert trainers.get(f"{TRAINER_DEAD_KEY}3") == b"1"
        # A rank's key, from the same token file as its environment names it
        key = job_store_key({TOKEN_FILE_ENV: str(token)})
        assert key is not None
        seal = Sealer(key)
        assert seal.get(trainers, f"{TRAINER_DEAD_KEY}4") == "hung"
        assert seal.get(trainers, f"{TRAINER_DEAD_KEY}3") is None  # not believed
        del trainers, client
    finally:
        server.stop()
    assert not server.alive() and not server.set("k", "v")


def test_the_ranks_of_a_run_derive_the_runners_store_key_from_its_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `MALLEUS_STORE_KEY` of the user's shell never reaches the ranks (it would win over
    the token and their key would not be the runner's): they derive it from the token file."""
    from malleus.control.sealed import store_key
    from malleus.runner.launch import LaunchSpec
    from malleus.trainer.world.sealed import STORE_KEY_ENV, job_store_key

    token = tmp_path / "control-token"
    token.write_text("the-runs-token")
    monkeypatch.setenv(STORE_KEY_ENV, "ab" * 32)
    env = LaunchSpec("job.yaml", 2, tmp_path, token).env(1, 29500, "127.0.0.1:29400")
    assert STORE_KEY_ENV not in env
    assert job_store_key(env) == store_key("the-runs-token")

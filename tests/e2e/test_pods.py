"""The local kubelet alone, on an in-memory core store (no API server, no torch): fast, everywhere.

A pod runs a small script from its ConfigMap volume under ``torchrun``; the script writes what
it sees (torchrun's environment, the Secret's value, rewritten paths) into an ``emptyDir``.
"""

from __future__ import annotations

import base64
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.pods import LocalKubelet, PodError, _rewrite, parse_torchrun
from tests.k8s.apiserver import wait_until
from tests.k8s.core import ApiError, CoreStore

NS = "kubelet"

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TOKEN", "HOME")
    seen = {k: os.environ.get(k) for k in keys}
    seen["argv"] = sys.argv[1:]
    with open(os.path.join(out, f"rank-{os.environ['RANK']}.json"), "w") as f:
        json.dump(seen, f)
    if mode == "fail" and os.environ["RANK"] == "1":
        sys.exit(3)
    if mode == "sleep":
        time.sleep(600)
    """
)


def _pod(name: str, mode: str, nproc: int = 2) -> dict[str, Any]:
    command = [
        "torchrun",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--node-rank",
        "0",
        "--master-addr=nowhere.svc",
        "/etc/app/script.py",
        "/data",
        mode,
    ]
    env = [
        {"name": "HOME", "value": "/data/home"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
    ]
    return {
        "metadata": {"name": name, "labels": {"malleus.io/job": "j"}},
        "spec": {
            "containers": [
                {
                    "name": "trainer",
                    "command": command,
                    "env": env,
                    "volumeMounts": [
                        {"name": "app", "mountPath": "/etc/app"},
                        {"name": "data", "mountPath": "/data"},
                    ],
                }
            ],
            "volumes": [
                {"name": "app", "configMap": {"name": "app"}},
                {"name": "data", "emptyDir": {}},
            ],
        },
    }


@pytest.fixture
def store() -> CoreStore:
    core = CoreStore()
    secret = {"metadata": {"name": "s"}, "data": {"token": base64.b64encode(b"t0k").decode()}}
    core.create("secrets", NS, secret)
    return core


def _phase(store: CoreStore, name: str, phase: str) -> dict[str, Any] | None:
    try:
        pod = store.get("pods", NS, name)
    except ApiError:
        return None
    return pod if pod["status"].get("phase") == phase else None


def test_parse_torchrun_and_rewrite_paths() -> None:
    run = parse_torchrun(["torchrun", "--nnodes", "2", "--nproc_per_node=4", "-m", "m", "a"])
    assert (run.nnodes, run.nproc_per_node, run.node_rank, run.target) == (
        2,
        4,
        0,
        ["-m", "m", "a"],
    )
    with pytest.raises(PodError):
        parse_torchrun(["python", "x.py"])
    with pytest.raises(PodError):
        parse_torchrun(["torchrun", "--standalone", "x.py"])
    mounts = [("/etc/malleus", Path("/w/config")), ("/etc", Path("/w/etc"))]
    assert _rewrite("/etc/malleus/job.json", mounts) == "/w/config/job.json"
    assert _rewrite("--plan=/etc/malleus/plan.json", mounts) == "--plan=/w/config/plan.json"
    assert _rewrite("/etcetera", mounts) == "/etcetera"
    assert _rewrite("-m", mounts) == "-m"


def test_a_pod_runs_to_success_with_its_volumes_env_and_torchrun_env(
    store: CoreStore, tmp_path: Path
) -> None:
    with LocalKubelet(store, NS, tmp_path) as kubelet:
        store.create("pods", NS, _pod("ok", "exit"))  # waits for its ConfigMap
        store.create("configmaps", NS, {"metadata": {"name": "app"}, "data": {"script.py": SCRIPT}})
        pod = store.wait_for(lambda: _phase(store, "ok", "Succeeded"), 30, "pod Succeeded")
        assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
        assert kubelet.check() is None
    data = tmp_path / "ok" / "volumes" / "data"
    seen = [json.loads((data / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [(s["RANK"], s["LOCAL_RANK"], s["WORLD_SIZE"]) for s in seen] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]
    assert {s["MASTER_ADDR"] for s in seen} == {"127.0.0.1"}
    assert len({s["MASTER_PORT"] for s in seen}) == 1
    assert seen[0]["TOKEN"] == "t0k" and seen[0]["HOME"] == f"{data}/home"
    assert seen[0]["argv"] == [str(data), "exit"]


def test_a_failing_rank_fails_the_pod_and_deletion_kills_the_processes(
    store: CoreStore, tmp_path: Path
) -> None:
    store.create("configmaps", NS, {"metadata": {"name": "app"}, "data": {"script.py": SCRIPT}})
    with LocalKubelet(store, NS, tmp_path, grace_seconds=1) as kubelet:
        store.create("pods", NS, _pod("bad", "fail"))
        pod = store.wait_for(lambda: _phase(store, "bad", "Failed"), 30, "pod Failed")
        assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3

        store.create("pods", NS, _pod("long", "sleep", nproc=1))
        pod = store.wait_for(lambda: _phase(store, "long", "Running"), 30, "pod Running")
        assert pod["status"]["podIP"] == "127.0.0.1"
        assert kubelet.processes()
        store.delete("pods", NS, "long")
        wait_until(lambda: (not kubelet.processes()) or None, 30, "the processes killed")
        assert kubelet.check() is None

"""Pods on the real control plane: the real scheduler binds them to process-kubelet nodes,
which run them as processes, report their status and honour deletion grace periods."""

from __future__ import annotations

import base64
import os
import signal
import textwrap
import time
from typing import Any

from tests.cluster.controlplane import RESTRICTED, ControlPlane, wait_until
from tests.cluster.fixtures import SHARED_NODES
from tests.cluster.kubelet import ProcessKubelet


def _pod(name: str, code: str, **spec: Any) -> dict[str, Any]:
    container = {
        "name": "main",
        "image": "python:3",
        "command": ["python", "-c", textwrap.dedent(code)],
        **spec.pop("container", {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def _get_pod(cluster: ControlPlane, ns: str, name: str) -> dict[str, Any] | None:
    response = cluster.http().get(f"/api/v1/namespaces/{ns}/pods/{name}")
    return response.json() if response.status_code == 200 else None


def _phase(cluster: ControlPlane, ns: str, name: str, *phases: str) -> dict[str, Any] | None:
    pod = _get_pod(cluster, ns, name)
    return pod if pod is not None and pod["status"].get("phase") in phases else None


def _create(cluster: ControlPlane, ns: str, body: dict[str, Any]) -> None:
    response = cluster.http().post(f"/api/v1/namespaces/{ns}/pods", json=body)
    assert response.status_code == 201, response.text


def _logs(kubelets: list[ProcessKubelet]) -> str:
    return "\n".join(k.logs() for k in kubelets)


def test_a_scheduled_pod_runs_as_a_process_and_reports_its_exit_code(
    control_plane: ControlPlane, nodes: list[ProcessKubelet], namespace: str
) -> None:
    cluster, http = control_plane, control_plane.http()
    secret = {"metadata": {"name": "creds"}, "data": {"token": base64.b64encode(b"s3").decode()}}
    config = {"metadata": {"name": "conf"}, "data": {"plan.json": '{"generation": 4}'}}
    assert http.post(f"/api/v1/namespaces/{namespace}/secrets", json=secret).is_success
    assert http.post(f"/api/v1/namespaces/{namespace}/configmaps", json=config).is_success
    code = """
        import json, os, pathlib, sys
        plan = json.loads(pathlib.Path(sys.argv[1]).read_text())
        token = pathlib.Path(os.environ["SA_DIR"], "token").read_text()
        print("pod", os.environ["POD_NAME"], "ip", os.environ["POD_IP"],
              "token", os.environ["TOKEN"], "generation", plan["generation"],
              "sa-token", len(token.split(".")), flush=True)
        sys.exit(3)
    """
    body = _pod(
        "exit3",
        code,
        container={
            "args": ["/etc/malleus/plan.json"],
            "resources": {"limits": {"nvidia.com/gpu": "2"}},
            "env": [
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {
                    "name": "TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}},
                },
                {"name": "SA_DIR", "value": "/var/run/secrets/kubernetes.io/serviceaccount"},
            ],
            "volumeMounts": [{"name": "plan", "mountPath": "/etc/malleus"}],
        },
        volumes=[{"name": "plan", "configMap": {"name": "conf"}}],
    )
    _create(cluster, namespace, body)
    pod = wait_until(
        lambda: _phase(cluster, namespace, "exit3", "Failed", "Succeeded"),
        30,
        "pod exit3 ends",
        alive=lambda: nodes[0].check() or nodes[1].check(),
    )
    assert pod["status"]["phase"] == "Failed", _logs(nodes)
    assert pod["spec"]["nodeName"] in SHARED_NODES  # bound by the real scheduler
    (status,) = pod["status"]["containerStatuses"]
    assert status["state"]["terminated"]["exitCode"] == 3, _logs(nodes)
    ip = pod["status"]["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1"
    kubelet = next(k for k in nodes if k.name == pod["spec"]["nodeName"])
    run = kubelet.pod(namespace, "exit3")
    assert run is not None
    out = run.containers[0].log.read_text()
    # the service-account token is a JWT (three dot-separated parts) from the TokenRequest API
    assert out.split() == ["pod", "exit3", "ip", ip, "token", "s3", "generation", "4",
                           "sa-token", "3"], out  # fmt: skip


def test_a_pod_that_succeeds_is_succeeded(
    control_plane: ControlPlane, nodes: list[ProcessKubelet], namespace: str
) -> None:
    _create(control_plane, namespace, _pod("ok", "print('done')"))
    pod = wait_until(
        lambda: _phase(control_plane, namespace, "ok", "Failed", "Succeeded"), 30, "pod ok ends"
    )
    assert pod["status"]["phase"] == "Succeeded", _logs(nodes)
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0


def test_a_deleted_pod_gets_sigterm_then_goes_after_its_grace_period(
    control_plane: ControlPlane, nodes: list[ProcessKubelet], namespace: str
) -> None:
    cluster, http = control_plane, control_plane.http()
    ignores = """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM", flush=True))
        print("up", flush=True)
        while True: time.sleep(0.05)
    """
    _create(cluster, namespace, _pod("stubborn", ignores))
    pod = wait_until(lambda: _phase(cluster, namespace, "stubborn", "Running"), 30, "Running")
    kubelet = next(k for k in nodes if k.name == pod["spec"]["nodeName"])
    run = kubelet.pod(namespace, "stubborn")
    assert run is not None
    log = run.containers[0].log
    wait_until(lambda: True if "up" in log.read_text() else None, 20, "process up")
    path = f"/api/v1/namespaces/{namespace}/pods/stubborn"
    assert http.request("DELETE", path, json={"gracePeriodSeconds": 2}).is_success
    wait_until(lambda: True if "SIGTERM" in log.read_text() else None, 10, "SIGTERM seen")
    assert _get_pod(cluster, namespace, "stubborn") is not None  # still in its grace period
    wait_until(
        lambda: True if _get_pod(cluster, namespace, "stubborn") is None else None, 15, "gone"
    )
    assert run.pids() == [] and run.containers[0].exit_code == 128 + signal.SIGKILL


def test_a_deleted_pod_takes_its_containers_descendants_in_sessions_of_their_own(
    control_plane: ControlPlane, nodes: list[ProcessKubelet], namespace: str
) -> None:
    """As a runtime kills a container's cgroup: torchrun starts its ranks in sessions of their
    own, and signalling the container's process group alone left them running (orphans)."""
    cluster, http = control_plane, control_plane.http()
    parent = """
        import subprocess, sys, time
        child = subprocess.Popen(
            [sys.executable, "-c", "import time\\nwhile True: time.sleep(0.05)"],
            start_new_session=True,
        )
        print("child", child.pid, flush=True)
        while True: time.sleep(0.05)
    """
    _create(cluster, namespace, _pod("launcher", parent, terminationGracePeriodSeconds=1))
    pod = wait_until(lambda: _phase(cluster, namespace, "launcher", "Running"), 30, "Running")
    kubelet = next(k for k in nodes if k.name == pod["spec"]["nodeName"])
    run = kubelet.pod(namespace, "launcher")
    assert run is not None
    log = run.containers[0].log

    def child() -> int | None:
        words = log.read_text().split()
        return int(words[1]) if len(words) > 1 and words[0] == "child" else None

    pid = wait_until(child, 20, "the child started")
    assert pid in run.pids(), (pid, run.pids())  # found by its marker, not its session
    assert http.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/launcher").is_success
    wait_until(lambda: _get_pod(cluster, namespace, "launcher") is None or None, 20, "gone")
    wait_until(lambda: not os.path.exists(f"/proc/{pid}") or None, 10, "the child gone")
    assert run.pids() == []


def test_a_held_pod_stays_terminating_until_released(
    control_plane: ControlPlane, nodes: list[ProcessKubelet], namespace: str
) -> None:
    cluster, http = control_plane, control_plane.http()
    _create(cluster, namespace, _pod("held", "import time; time.sleep(600)"))
    pod = wait_until(lambda: _phase(cluster, namespace, "held", "Running"), 30, "Running")
    kubelet = next(k for k in nodes if k.name == pod["spec"]["nodeName"])
    kubelet.hold(namespace, "held")
    path = f"/api/v1/namespaces/{namespace}/pods/held"
    assert http.request("DELETE", path, json={"gracePeriodSeconds": 1}).is_success
    # the API server keeps the pod (Terminating) until its kubelet deletes it with grace 0
    terminating = wait_until(
        lambda: (p := _get_pod(cluster, namespace, "held")) and p["metadata"].get(
            "deletionTimestamp") and p, 10, "Terminating",
    )  # fmt: skip
    assert terminating["status"]["phase"] == "Running"
    deadline = time.monotonic() + 2.5  # past the grace period: held, it stays
    while time.monotonic() < deadline:
        assert _get_pod(cluster, namespace, "held") is not None
        time.sleep(0.2)
    run = kubelet.pod(namespace, "held")
    assert run is not None and run.pids()
    kubelet.release(namespace, "held")
    wait_until(lambda: True if _get_pod(cluster, namespace, "held") is None else None, 15, "gone")
    assert run.pids() == []


def test_a_pod_reaches_another_through_its_service_once_the_probe_passes(
    control_plane: ControlPlane, nodes: list[ProcessKubelet], namespace: str
) -> None:
    serve = """
        import os, socket, time
        time.sleep(1)  # not ready at once: the readiness probe must wait for the listener
        server = socket.create_server((os.environ["POD_IP"], 8080))
        while True:
            conn, _ = server.accept()
            conn.sendall(b"hello from " + os.environ["POD_IP"].encode())
            conn.close()
    """
    server = _pod(
        "server",
        serve,
        container={
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "ports": [{"name": "echo", "containerPort": 8080}],
            "readinessProbe": {"tcpSocket": {"port": "echo"}, "periodSeconds": 1},
        },
    )
    server["metadata"]["labels"] = {"app": "echo"}
    service = {
        "metadata": {"name": "echo"},
        "spec": {"selector": {"app": "echo"}, "ports": [{"port": 8080, "targetPort": "echo"}]},
    }
    http = control_plane.http()
    assert http.post(f"/api/v1/namespaces/{namespace}/services", json=service).is_success
    _create(control_plane, namespace, server)
    client = _pod(
        "client",
        """
        import os, socket
        host, port = os.environ["ECHO"].split(":")
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            print(conn.recv(100).decode(), flush=True)
        """,
        container={"env": [{"name": "ECHO", "value": f"echo.{namespace}.svc:8080"}]},
    )
    _create(control_plane, namespace, client)
    done = wait_until(
        lambda: _phase(control_plane, namespace, "client", "Succeeded", "Failed"),
        30,
        "client ends",
        alive=lambda: nodes[0].check() or nodes[1].check(),
    )
    assert done["status"]["phase"] == "Succeeded", _logs(nodes)
    served = _phase(control_plane, namespace, "server", "Running")
    assert served is not None and served["status"]["conditions"]
    ready = {c["type"]: c["status"] for c in served["status"]["conditions"]}
    assert ready["Ready"] == "True"
    kubelet = next(k for k in nodes if k.name == done["spec"]["nodeName"])
    run = kubelet.pod(namespace, "client")
    assert run is not None
    assert run.containers[0].log.read_text().strip() == f"hello from {served['status']['podIP']}"


def test_pod_security_admission_enforces_the_restricted_standard(
    control_plane: ControlPlane, namespace: str
) -> None:
    http = control_plane.http()
    labels = {"metadata": {"labels": RESTRICTED}}
    headers = {"Content-Type": "application/merge-patch+json"}
    assert http.patch(f"/api/v1/namespaces/{namespace}", json=labels, headers=headers).is_success
    response = http.post(f"/api/v1/namespaces/{namespace}/pods", json=_pod("loose", "pass"))
    assert response.status_code == 403, response.text
    message = response.json()["message"]
    assert 'violates PodSecurity "restricted:latest"' in message, message
    tight = _pod(
        "tight",
        "pass",
        securityContext={"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        container={
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            }
        },
    )
    response = http.post(f"/api/v1/namespaces/{namespace}/pods", json=tight)
    assert response.status_code == 201, response.text


def test_the_scheduler_counts_gpus_and_leaves_a_pod_that_fits_nowhere_pending(
    control_plane: ControlPlane, nodes: list[ProcessKubelet], namespace: str
) -> None:
    greedy = _pod(
        "greedy",
        "pass",
        container={"resources": {"limits": {"nvidia.com/gpu": "9"}}},  # every node has 8
    )
    _create(control_plane, namespace, greedy)

    def unschedulable() -> dict[str, Any] | None:
        pod = _get_pod(control_plane, namespace, "greedy") or {}
        conditions = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
        scheduled = conditions.get("PodScheduled") or {}
        return scheduled if scheduled.get("reason") == "Unschedulable" else None

    condition = wait_until(unschedulable, 20, "greedy pod Unschedulable")
    assert "Insufficient nvidia.com/gpu" in condition["message"], condition
    pod = _get_pod(control_plane, namespace, "greedy")
    assert pod is not None and not pod["spec"].get("nodeName")


def test_a_pod_the_kubelet_cannot_run_waits_with_the_reason(
    control_plane: ControlPlane, nodes: list[ProcessKubelet], namespace: str
) -> None:
    body = _pod("imageonly", "pass")
    del body["spec"]["containers"][0]["command"]  # no images here, so no entrypoint
    _create(control_plane, namespace, body)

    def waiting() -> dict[str, Any] | None:
        pod = _get_pod(control_plane, namespace, "imageonly") or {}
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            if "waiting" in status["state"]:
                return dict(status["state"]["waiting"])
        return None

    state = wait_until(waiting, 20, "container Waiting")
    assert state["reason"] == "CreateContainerConfigError", state
    assert "no command" in state["message"], state

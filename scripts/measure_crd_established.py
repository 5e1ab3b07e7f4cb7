"""How long the test control plane takes to establish a CRD, and what the harness's wait costs.

Starts `tests.cluster.controlplane.ControlPlane` (``MALLEUS_K8S_ASSETS``), then ``N`` times each:

(a) server: POST a CRD (a small one, then one with the MalleusJob schema) while a watch on CRDs
    is open; the POST's own time, then the time from its answer to the watch event that shows
    ``NamesAccepted``, then ``Established`` (no polling involved);
(b) the harness before, with the MalleusJob schema: ``kubectl apply --server-side``, then ``kubectl wait
    --for=condition=Established`` (two kubectl processes);
(c) the harness now: ``kubectl apply --server-side``, then `ControlPlane.wait_established`.

Run: ``MALLEUS_K8S_ASSETS=... .venv/bin/python scripts/measure_crd_established.py [N]``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's tests package

from tests.cluster.controlplane import ControlPlane, assets_dir

ROOT = Path(__file__).resolve().parents[1]
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


MALLEUS_VERSIONS = yaml.safe_load((ROOT / "crds" / "malleusjob.yaml").read_text())["spec"][
    "versions"
]
"""The MalleusJob CRD's versions: its 85 kB schema with its CEL rules, renamed per CRD."""


def crd(i: int, group: str, malleus: bool = False) -> dict[str, Any]:
    """A small CRD ``thing<i>s.<group>``; with ``malleus``, one with the MalleusJob schema."""
    plural, kind = f"thing{i}s", f"Thing{i}"
    body = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": f"thing{i}", "kind": kind},
            "versions": [
                {"name": "v1", "served": True, "storage": True,
                 "schema": {"openAPIV3Schema": {"type": "object"}}}
            ],
        },
    }  # fmt: skip
    if malleus:
        body["spec"]["versions"] = MALLEUS_VERSIONS
    return body


def summary(seconds: list[float]) -> str:
    ms = sorted(s * 1000 for s in seconds)
    p90 = ms[round(0.9 * (len(ms) - 1))]
    return (
        f"n={len(ms)} min={ms[0]:.0f} median={statistics.median(ms):.0f} p90={p90:.0f} "
        f"max={ms[-1]:.0f} ms"
    )


def watch(cp: ControlPlane, since: str, seen: dict[str, dict[str, float]]) -> Callable[[], None]:
    """Record when each CRD condition first shows True; returns a function that stops it."""
    client = cp.http(cp.identity("crd-watcher", ("system:masters",)))

    def run() -> None:
        params = {"watch": "1", "resourceVersion": since}
        try:
            with client.stream("GET", CRDS, params=params, timeout=None) as response:
                for line in response.iter_lines():
                    obj = json.loads(line)["object"]
                    mine = seen.setdefault(obj["metadata"]["name"], {})
                    for c in (obj.get("status") or {}).get("conditions") or []:
                        if c["status"] == "True":
                            mine.setdefault(c["type"], time.monotonic())
        except httpx.HTTPError:
            pass  # closed at the end

    threading.Thread(target=run, daemon=True).start()
    return client.close


def main(n: int) -> None:
    assets, why = assets_dir()
    if assets is None:
        sys.exit(why)
    with tempfile.TemporaryDirectory() as tmp, ControlPlane(assets, Path(tmp)) as cp:
        print(f"control plane up in {cp.start_seconds:.1f} s; load {os.getloadavg()}")
        http = cp.http()
        seen: dict[str, dict[str, float]] = {}
        stop = watch(cp, http.get(CRDS).json()["metadata"]["resourceVersion"], seen)
        time.sleep(1)  # the watch is open
        for malleus in (False, True):
            post, accepted, established = [], [], []
            for i in range(n):
                body = crd(i, "malleus.example.com" if malleus else "small.example.com", malleus)
                name = body["metadata"]["name"]
                t_post = time.monotonic()
                made = http.post(CRDS, json=body)
                assert made.status_code == 201, made.text
                t0 = time.monotonic()
                while "Established" not in seen.get(name, {}) and time.monotonic() < t0 + 120:
                    time.sleep(0.002)
                post.append(t0 - t_post)
                accepted.append(seen[name]["NamesAccepted"] - t0)
                established.append(seen[name]["Established"] - t0)
            what = "MalleusJob schema" if malleus else "small schema"
            print(f"(a) {what}: POST itself:", summary(post))
            print(f"(a) {what}: POST answered -> NamesAccepted:", summary(accepted))
            print(f"(a) {what}: POST answered -> Established:", summary(established))
        stop()

        steps: dict[str, list[float]] = {"apply": [], "kubectl wait": [], "wait_established": []}
        for i in range(2 * n):
            body = crd(i, "harness.example.com", malleus=True)
            name = body["metadata"]["name"]
            t0 = time.monotonic()
            cp.apply([body])
            t1 = time.monotonic()
            if i % 2 == 0:
                cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{name}")
                steps["kubectl wait"].append(time.monotonic() - t1)
            else:
                cp.wait_established(name)
                steps["wait_established"].append(time.monotonic() - t1)
            steps["apply"].append(t1 - t0)
        for step, seconds in steps.items():
            print(f"(b/c) {step}:", summary(seconds))
        print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)

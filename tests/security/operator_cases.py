"""A MalleusJob as kopf hands it to the operator, for the operator-side attack tests here
(tests/operator's conftest has the same; conftest modules cannot be imported)."""

from __future__ import annotations

from typing import Any

__all__ = ["job_body"]


def job_body(name: str = "demo", namespace: str = "ml", **spec: Any) -> dict[str, Any]:
    """2 nodes x 4 GPUs, tp 2, the tiny preset."""
    return {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": name, "namespace": namespace, "uid": "uid-1234", "generation": 1},
        "spec": {
            "image": "ghcr.io/example/malleus-trainer:0.1.0",
            "nodes": 2,
            "gpusPerNode": 4,
            "model": {"preset": "tiny"},
            "training": {
                "globalBatchSize": 16,
                "microBatchSize": 2,
                "steps": 100,
                "learningRate": 0.001,
            },
            "parallelism": {"tp": 2},
            **spec,
        },
    }

"""Shared pieces for the runner tests: small MalleusJob manifests written to files."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml


def manifest(
    *,
    nodes: int = 1,
    gpus: int = 4,
    layers: int = 4,
    global_batch: int = 4,
    steps: int = 28,
    forward_ms: float = 40.0,
    backward_ms: float = 80.0,
    schedule: list[dict[str, Any]] | None = None,
    policy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A tiny emulated job (tp 2); the defaults are the end-to-end scenario's."""
    return {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": "runner-test"},
        "spec": {
            "image": "malleus:test",
            "nodes": nodes,
            "gpusPerNode": gpus,
            "model": {"preset": "tiny", "layers": layers},
            "training": {
                "globalBatchSize": global_batch,
                "microBatchSize": 1,
                "steps": steps,
                "learningRate": 0.003,
                "warmupSteps": 2,
            },
            "parallelism": {"tp": 2},
            "stragglerPolicy": copy.deepcopy(policy or {}),
            "emulation": {
                "enabled": True,
                "layerForwardMs": forward_ms,
                "layerBackwardMs": backward_ms,
                "schedule": copy.deepcopy(schedule or []),
            },
        },
    }


def write_job(path: Path, obj: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(obj, sort_keys=False))
    return str(path)

"""Bad-manifest cases shared by tests/job (local validation) and tests/crd (API server)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["EXAMPLES", "REPO", "BadCase", "bad_cases", "base_manifest", "load_yaml"]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@dataclass(frozen=True)
class BadCase:
    """One bad manifest: changes to the base example and the fields that must be blamed."""

    id: str
    fields: frozenset[str]
    message: str
    local: str
    set: dict[str, Any] = field(default_factory=dict)
    unset: tuple[str, ...] = ()

    def manifest(self, name: str | None = None) -> dict[str, Any]:
        """The base manifest with this case's changes (and ``metadata.name``, if given)."""
        manifest = base_manifest()
        if name is not None:
            manifest["metadata"]["name"] = name
        for path, value in self.set.items():
            *parents, leaf = path.split(".")
            _walk(manifest, parents)[leaf] = copy.deepcopy(value)
        for path in self.unset:
            *parents, leaf = path.split(".")
            del _walk(manifest, parents)[leaf]
        return manifest


def _walk(manifest: dict[str, Any], parents: list[str]) -> dict[str, Any]:
    node = manifest
    for key in parents:
        node = node.setdefault(key, {})
    return node


def load_yaml(path: Path) -> dict[str, Any]:
    """One YAML document as a dict."""
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


def base_manifest() -> dict[str, Any]:
    """examples/tiny-cpu.yaml, freshly loaded."""
    return load_yaml(REPO / "examples" / "tiny-cpu.yaml")


def bad_cases() -> list[BadCase]:
    """The cases of bad_manifests.yaml."""
    raw = yaml.safe_load((Path(__file__).with_name("bad_manifests.yaml")).read_text())
    return [
        BadCase(
            id=item["id"],
            fields=frozenset(item["fields"]),
            message=item["message"],
            local=item.get("local", item["message"]),
            set=item.get("set", {}),
            unset=tuple(item.get("unset", ())),
        )
        for item in raw
    ]

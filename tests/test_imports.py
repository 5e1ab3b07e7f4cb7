"""The rooms and their one-way imports (docs/architecture.md), enforced by walking every module.

Each module of the product belongs to a room; a room may import only the rooms listed for it.
Imports are read with `ast` (no module is executed), both at module level and inside functions:
a lazy import is still a dependency. The one exception is `malleus/cli.py`, the command dispatch,
which imports the trainer lazily so that `malleus plan` and the operator image run without torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

ROOMS: dict[str, Path] = {
    "errors": REPO / "malleus" / "errors.py",
    "planner": REPO / "malleus" / "planner",
    "job": REPO / "malleus" / "job",
    "controller": REPO / "malleus" / "controller",
    "runner": REPO / "malleus" / "runner",
    "operator": REPO / "operator",
    "trainer": REPO / "trainer",
    "cli": REPO / "malleus" / "cli.py",
}

ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "planner": {"errors"},
    "job": {"errors", "planner"},
    "controller": {"errors", "planner", "job"},
    "runner": {"errors", "planner", "job", "controller"},
    "operator": {"errors", "planner", "job", "controller"},
    "trainer": {"errors", "planner", "job"},
    "cli": set(ROOMS),
}
"""Who may import whom: operator -> controller -> job -> planner; trainer -> job, planner."""

NO_TORCH = {"errors", "planner", "job", "controller", "runner", "operator", "cli"}
"""Rooms that must import without torch (the operator image carries none)."""


def room_of_module(name: str) -> str | None:
    """`malleus.job.schema` -> 'job'; None for anything outside the product."""
    parts = name.split(".")
    if parts[0] != "malleus":
        return None
    if len(parts) == 1:
        return "package"
    return parts[1] if parts[1] in ROOMS else None


def modules(room: str) -> list[Path]:
    where = ROOMS[room]
    return [where] if where.is_file() else sorted(where.rglob("*.py"))


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in a file, relative ones resolved."""
    package = path.parent.relative_to(REPO).parts
    mapped = {"operator": ("malleus", "operator"), "trainer": ("malleus", "trainer")}
    if package and package[0] in mapped:
        package = mapped[package[0]] + package[1:]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            out.append((node.lineno, name))
    return out


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_rooms_import_only_what_they_may(room: str) -> None:
    wrong = []
    for path in modules(room):
        for line, name in imports(path):
            target = room_of_module(name)
            if target is None or target == room:
                continue
            if target == "package" or target not in ALLOWED[room]:
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not wrong, f"{room} may import {sorted(ALLOWED[room])} only:\n" + "\n".join(wrong)


@pytest.mark.parametrize("room", sorted(NO_TORCH))
def test_torch_free_rooms_never_import_torch(room: str) -> None:
    wrong = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in modules(room)
        for line, name in imports(path)
        if name.split(".")[0] == "torch"
    ]
    assert not wrong, "\n".join(wrong)


def test_every_product_module_is_in_a_room() -> None:
    """A new top-level module under malleus/ needs a room (and a line in ALLOWED)."""
    known = {p for room in ROOMS for p in modules(room)}
    stray = [
        p.relative_to(REPO)
        for p in (REPO / "malleus").rglob("*.py")
        if p not in known and p.name != "__main__.py"
    ]
    assert not stray, f"modules in no room: {stray}"


def test_the_walker_sees_relative_and_lazy_imports() -> None:
    """So that the rules above can fail: a relative import resolves to its room, and an import
    inside a function body counts (resolved.py imports the planner's search lazily)."""
    found = {name for _, name in imports(REPO / "malleus" / "job" / "resolved.py")}
    assert "malleus.job.load" in found  # from .load import load_job
    assert "malleus.planner.search" in found  # inside ResolvedJob.initial_plan
    trainer = {name for _, name in imports(REPO / "trainer" / "emulation.py")}
    assert "malleus.job.presets" in trainer
    assert room_of_module("malleus.controller.loop") not in ALLOWED["trainer"]

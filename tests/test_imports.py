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
    "notation": REPO / "malleus" / "notation.py",
    "planner": REPO / "malleus" / "planner",
    "control": REPO / "malleus" / "control",
    "job": REPO / "malleus" / "job",
    "controller": REPO / "malleus" / "controller",
    "runner": REPO / "malleus" / "runner",
    "operator": REPO / "operator",
    "trainer": REPO / "trainer",
    "cli": REPO / "malleus" / "cli.py",
}

ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "notation": set(),
    "planner": {"errors", "notation"},
    "control": {"errors", "notation", "planner"},
    "job": {"errors", "notation", "planner"},
    "controller": {"errors", "notation", "planner", "control", "job"},
    "runner": {"errors", "notation", "planner", "control", "job", "controller"},
    "operator": {"errors", "notation", "planner", "control", "job", "controller"},
    "trainer": {"errors", "notation", "planner", "control", "job"},
    "cli": set(ROOMS),
}
"""Who may import whom: operator -> controller -> job -> planner; trainer -> control, job,
planner; control -> planner (the trainers' control API, which the controller, the runner and the
operator read through). `errors` and `notation` (how figures are written for people) are leaves
every room may use."""

NO_TORCH = {
    "errors",
    "notation",
    "planner",
    "control",
    "job",
    "controller",
    "runner",
    "operator",
    "cli",
}
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
    trainer = {name for _, name in imports(REPO / "trainer" / "measure" / "emulation.py")}
    assert "malleus.job.presets" in trainer
    assert room_of_module("malleus.controller.loop") not in ALLOWED["trainer"]


def imported(path: Path) -> list[tuple[int, str]]:
    """`imports(path)`, plus `pkg.name` for every `from pkg import name` (a submodule or not):
    so that `from . import search` counts as importing `...search`."""
    resolved = iter(imports(path))  # one entry per imported name / per `from`, in walk order
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [next(resolved) for _ in node.names]
        elif isinstance(node, ast.ImportFrom):
            line, base = next(resolved)
            found += [(line, base), *((line, f"{base}.{alias.name}") for alias in node.names)]
    return found


def test_the_planners_search_is_imported_by_none_of_its_contract() -> None:
    """One way inside the planner: `search/` imports the contract and the cost model, never the
    reverse (lazy imports included). The package's `__init__` alone may, to export `plan`."""
    planner = REPO / "malleus" / "planner"
    search = planner / "search"
    wrong = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted(planner.rglob("*.py"))
        if search not in path.parents and path != planner / "__init__.py"
        for line, name in imported(path)
        if name == "malleus.planner.search" or name.startswith("malleus.planner.search.")
    ]
    assert not wrong, "\n".join(wrong)
    assert (search / "__init__.py").exists()


def test_bench_has_no_import_cycle() -> None:
    """bench/ scripts import each other by bare name (bench/ is on sys.path when one runs);
    lazy and TYPE_CHECKING imports count."""
    bench = {p.stem: p for p in (REPO / "bench").glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in bench.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in bench}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module in bench:
                graph[name].add(node.module)
    cycles: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert graph["trainer"] and graph["e2e"]  # the walker sees bench's own imports
    assert not cycles, "import cycles in bench/:\n" + "\n".join(cycles)


# The trainer's own rooms (trainer/<room>/, docs/reference/trainer.md), bottom to top. A module may import
# its own room and the rooms on lower floors; `launch` stands apart and imports `world` only.
# `cli.py` and `__main__.py` sit on top of them all.
TRAINER_FLOORS: list[set[str]] = [
    {"world"},
    {"model", "data"},
    {"parallel"},
    {"measure"},
    {"checkpoint"},
    {"switching"},
    {"endpoint"},
    {"engine"},
    {"recovery"},
    {"launch"},
    {"run"},
    {"cli"},
    {"__main__"},
]
TRAINER_ONLY: dict[str, set[str]] = {"launch": {"world"}}
"""Rooms held to a narrower list than their floor gives them."""


def trainer_room(module: str) -> str | None:
    """`malleus.trainer.engine.trainer` -> 'engine'; `malleus.trainer.cli` -> 'cli'."""
    parts = module.split(".")
    if parts[:2] != ["malleus", "trainer"] or len(parts) < 3:
        return None
    return parts[2]


def trainer_module(path: Path) -> str:
    rel = path.relative_to(REPO / "trainer").with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["malleus", "trainer", *parts])


def test_every_trainer_module_is_in_a_room() -> None:
    floors = set().union(*TRAINER_FLOORS)
    stray = [
        p.relative_to(REPO)
        for p in (REPO / "trainer").rglob("*.py")
        if trainer_room(trainer_module(p)) not in floors
    ]
    assert not stray, f"trainer modules in no room (TRAINER_FLOORS): {stray}"
    for room in floors - {"cli", "__main__"}:
        init = REPO / "trainer" / room / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        assert "May import" in doc, f"{init.relative_to(REPO)} must say what the room may import"


def test_trainer_imports_run_one_way() -> None:
    """Lazy and TYPE_CHECKING imports included: a cycle hidden in a function body is a cycle."""
    floor = {room: i for i, rooms in enumerate(TRAINER_FLOORS) for room in rooms}
    wrong = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        src = trainer_room(trainer_module(path))
        for line, name in imports(path):
            dst = trainer_room(name)
            if dst is None or dst == src:
                continue
            allowed = TRAINER_ONLY.get(src)
            up = floor[dst] >= floor[src] if allowed is None else dst not in allowed
            if up:
                wrong.append(f"{path.relative_to(REPO)}:{line} ({src}) imports {name} ({dst})")
    assert not wrong, "imports running up or sideways in trainer/:\n" + "\n".join(wrong)


def _module_graph() -> dict[str, set[str]]:
    """Every product module -> the product modules it imports (a `from pkg import mod` counts
    as an import of `pkg.mod` where that is a module)."""
    paths = [p for room in ROOMS for p in modules(room)]
    names = {}
    for path in paths:
        rel = path.relative_to(REPO).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        if parts[0] in ("operator", "trainer"):
            parts = ["malleus", *parts]
        names[path] = ".".join(parts)
    known = set(names.values())
    graph: dict[str, set[str]] = {name: set() for name in known}
    for path, name in names.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        resolved = dict(imports(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom | ast.Import):
                continue
            target = resolved.get(node.lineno)
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else [target]
            if isinstance(node, ast.ImportFrom) and target:
                targets += [f"{target}.{a.name}" for a in node.names]
            graph[name] |= {t for t in targets if t in known and t != name}
    return graph


def test_no_import_cycles_between_modules() -> None:
    graph = _module_graph()
    seen: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph[node]):
            if seen.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_name_crosses_a_file() -> None:
    """`from x import _y` across modules of the product: make `_y` public or keep it home."""
    wrong = []
    for path in [p for room in ROOMS for p in modules(room)]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (
                node.level or "malleus" in (node.module or "")
            ):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno} imports {private}")
    assert not wrong, "\n".join(wrong)


MUTABLE_CALLS = frozenset({"dict", "list", "set", "defaultdict", "deque", "OrderedDict", "Counter"})
MUTATORS = frozenset(
    {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "clear"}
    | {"remove", "discard", "appendleft", "extendleft"}
)


def _is_container(value: ast.expr | None) -> bool:
    """A dict/list/set display or comprehension, or a call that makes one (`dict()`, ...)."""
    displays = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    if isinstance(value, displays):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        return name in MUTABLE_CALLS
    return False


def test_trainer_holds_no_module_state() -> None:
    """No process-wide mutable state in trainer/ (no Megatron-style `parallel_state`: the
    process group is an object, trainer/world/world.py `World`, handed to whoever needs it): no
    `global` statement; no module-level lowercase name bound to a
    dict/list/set (a constant is UPPER_CASE); and no module-level container that code mutates
    (a method such as `append`/`update`, an item assigned or deleted). Memoized pure functions
    (`functools.cache`) are not state and are not looked for."""
    wrong = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(REPO)
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                wrong.append(f"{where}:{node.lineno}: global {', '.join(node.names)}")
        containers: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign):
                targets, value = [node.target], node.value
            else:
                continue
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if not _is_container(value):
                continue
            for name in names:
                if name.startswith("__") and name.endswith("__"):
                    continue  # __all__
                containers.add(name)
                if name != name.upper():
                    wrong.append(f"{where}:{node.lineno}: module-level container {name}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in containers
                and node.func.attr in MUTATORS
            ):
                wrong.append(f"{where}:{node.lineno}: mutates {node.func.value.id}")
            targets = []
            if isinstance(node, ast.Assign | ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for t in targets:
                if (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.value, ast.Name)
                    and t.value.id in containers
                ):
                    wrong.append(f"{where}:{node.lineno}: mutates {t.value.id}")
    assert not wrong, "module-level state in trainer/:\n" + "\n".join(wrong)

"""The package layout: mapped folders must not shadow the stdlib, and the wheel must hold the tree."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder (docs/architecture.md): the core, the operator and the trainer
MAPPED = {"malleus": "malleus", "malleus.operator": "operator", "malleus.trainer": "trainer"}


def _declared() -> list[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["tool"]["setuptools"]["packages"]


def _tree_packages() -> set[str]:
    """Every folder holding Python modules, as its import name."""
    found: set[str] = set()
    for name, folder in MAPPED.items():
        base = ROOT / folder
        for py in base.rglob("*.py"):
            if "__pycache__" in py.parts:
                continue
            rel = py.parent.relative_to(base).parts
            found.add(".".join((name, *rel)))
    return found


def test_declared_packages_match_the_tree() -> None:
    declared = set(_declared())
    tree = _tree_packages()
    assert tree - declared == set(), (
        f"add to pyproject [tool.setuptools] packages: {tree - declared}"
    )
    assert declared - tree == set(), f"declared but absent from the tree: {declared - tree}"


def test_mapped_roots_have_no_init() -> None:
    for folder in ("operator", "trainer", "malleus"):
        assert not (ROOT / folder / "__init__.py").exists(), (
            f"{folder}/__init__.py must not exist: it would shadow or split the namespace"
        )


@pytest.mark.parametrize("cwd", [ROOT, ROOT / "operator"])
def test_import_operator_is_the_standard_library(cwd: Path) -> None:
    code = "import collections, operator; print(operator.__file__); print(operator.eq(1, 1))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "site-packages" not in out[0] and Path(out[0]).parent.name.startswith("python3")
    assert out[1] == "True"


def test_operator_imports_without_torch() -> None:
    """The operator image carries no torch: importing the planner and CLI must not pull it in."""
    code = (
        "import sys, malleus.cli, malleus.planner\n"
        "import malleus.planner.cli\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_wheel_holds_every_module(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("malleus-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name, folder in MAPPED.items():
        for py in (ROOT / folder).rglob("*.py"):
            rel = py.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            target = "/".join((*name.split("."), *rel.parts))
            assert target in names, f"{py.relative_to(ROOT)} is missing from the wheel"

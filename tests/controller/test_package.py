"""The controller package: torch-free and kube-free to import, and its default planner."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import malleus.controller as controller
from malleus.controller import default_planner
from malleus.planner import check_plan


def test_importing_the_controller_pulls_in_no_torch_and_no_kubernetes() -> None:
    code = (
        "import sys, malleus.controller; "
        "heavy = {'torch', 'kubernetes', 'kopf', 'prometheus_client', 'malleus.trainer'}; "
        "print(sorted(heavy & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_all_names_resolve() -> None:
    for name in controller.__all__:
        assert getattr(controller, name) is not None


def test_default_planner_gives_a_valid_plan(builder: Any) -> None:
    problem = builder({3: 2.0}, None)
    check_plan(problem, default_planner(problem, time_limit=5.0))

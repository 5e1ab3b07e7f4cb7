"""`malleus run` refuses bad input before anything starts: exit 2, every fault with its path."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

from malleus.job.resources import Machine
from malleus.runner import LocalRunOptions, run
from malleus.runner.processes import TrainerProcesses

from .conftest import manifest, write_job

ROOT = Path(__file__).resolve().parents[2]
BIG = Machine(cpus=64, memory_mib=1e6)


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: TrainerProcesses, *args: object, **kwargs: object) -> None:
        raise AssertionError("a trainer process was started")

    monkeypatch.setattr(TrainerProcesses, "start", refuse)


def bad_manifest() -> dict:
    m = manifest()
    m["spec"]["parallelism"]["tp"] = 3
    m["spec"]["training"]["learningRate"] = -0.1
    m["spec"]["trainig"] = {}
    return m


def call(tmp_path: Path, job: str, steps: int | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    options = LocalRunOptions(job=job, steps=steps, workdir=str(tmp_path / "work"), progress="none")
    code = run(options, out=out, err=err, machine=BIG)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.usefixtures("nothing_starts")
def test_a_malformed_manifest_lists_every_fault_with_its_field_path(tmp_path: Path) -> None:
    code, out, err = call(tmp_path, write_job(tmp_path / "bad.yaml", bad_manifest()))
    assert code == 2 and out == ""
    assert err.startswith(f"invalid MalleusJob in {tmp_path / 'bad.yaml'} (")
    lines = err.splitlines()
    assert any(ln.strip().startswith("- spec.parallelism.tp:") for ln in lines)
    assert any(ln.strip().startswith("- spec.training.learningRate:") for ln in lines)
    assert any('unknown field "spec.trainig"' in ln for ln in lines)
    assert not (tmp_path / "work").exists()


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "job.yaml (1 fault):\n  - <input>: no such file"),
        ("spec: [unclosed", "not valid YAML"),
        ("kind: Pod\napiVersion: v1\n", "kind: must be"),
    ],
)
def test_unreadable_or_foreign_files_exit_2(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "job.yaml"
    if content is not None:
        path.write_text(content)
    code, _, err = call(tmp_path, str(path))
    assert code == 2 and message in err


@pytest.mark.usefixtures("nothing_starts")
def test_a_machine_too_small_is_refused_saying_what_is_needed(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", manifest(nodes=2, gpus=4))
    small = Machine(cpus=1, memory_mib=512.0)
    out, err = io.StringIO(), io.StringIO()
    code = run(LocalRunOptions(job=job, progress="none"), out=out, err=err, machine=small)
    assert code == 2
    lines = err.getvalue().splitlines()
    assert lines[0] == f"invalid MalleusJob in {job} (2 faults):"
    assert lines[1].startswith("  - machine: too small for 8 ranks: CPU cores: needs 2 ")
    assert lines[2].startswith("  - machine: too small for 8 ranks: memory: needs ")


@pytest.mark.usefixtures("nothing_starts")
def test_bad_steps_exit_2(tmp_path: Path) -> None:
    code, _, err = call(tmp_path, write_job(tmp_path / "job.yaml", manifest()), steps=0)
    assert code == 2 and "  - --steps: 0: need at least 1" in err


def test_the_command_refuses_fast_in_a_fresh_process(tmp_path: Path) -> None:
    job = write_job(tmp_path / "bad.yaml", bad_manifest())
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "malleus.cli", "run", job, "--workdir", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert "spec.parallelism.tp" in proc.stderr and "spec.training.learningRate" in proc.stderr
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "w").exists()


def test_the_runner_imports_without_torch() -> None:
    code = "import sys, malleus.runner, malleus.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.usefixtures("nothing_starts")
def test_a_workdir_with_old_checkpoints_is_refused(tmp_path: Path) -> None:
    (tmp_path / "work" / "checkpoints" / "step-00000004").mkdir(parents=True)
    code, _, err = call(tmp_path, write_job(tmp_path / "job.yaml", manifest()))
    assert code == 2 and "holds checkpoints of an earlier run" in err

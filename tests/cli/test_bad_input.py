"""Every command judges bad input alike: exit 2, the same fault text, never a traceback.

Each case runs the real console script for `check`, `plan`, `run` and `train` side by side (in
parallel processes, to stay fast); none of them may start a trainer, since every input is refused
before anything starts.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-cpu.yaml"
MALLEUS = Path(sys.executable).with_name("malleus")
COMMANDS = ("check", "plan", "run", "train")
JOB_COMMANDS = ("check", "run", "train")
"""The commands that read only a MalleusJob: their messages must be identical, header included
(`plan` also reads PlanningProblems, so its header for an unreadable file says so)."""


def _tiny_with(old: str, new: str) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        text = TINY.read_text()
        assert old in text
        path.write_text(text.replace(old, new))

    return write


CASES: dict[str, tuple[Callable[[Path], None] | None, str]] = {
    "missing file": (None, "  - <input>: no such file"),
    "binary file": (
        lambda p: p.write_bytes(b"\x7fELF\x02\x01\x00\x00\xff\xfe"),
        "  - <input>: is a binary file, not text (YAML or JSON expected)",
    ),
    "not YAML": (lambda p: p.write_text("spec: [unclosed\n  nodes: {\n"), "not valid YAML: "),
    "CEL fault (tp 3)": (
        _tiny_with("tp: 2", "tp: 3"),
        "  - spec.parallelism.tp: spec.parallelism.tp must be a power of two",
    ),
    "semantic fault (odd head size)": (
        _tiny_with("    layers: 8\n", "    layers: 8\n    hidden: 60\n"),
        "  - spec.model.hidden: head size hidden/heads = 15 must be even (rotary positions)",
    ),
}


def _run_all(
    job: Path, workdir: Path, commands: tuple[str, ...] = COMMANDS
) -> dict[str, subprocess.CompletedProcess[str]]:
    extra = {"run": ["--workdir", str(workdir / "run")], "train": ["--quiet"]}
    procs = {
        command: subprocess.Popen(
            [str(MALLEUS), command, str(job), *extra.get(command, [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=workdir,
        )
        for command in commands
    }
    done = {}
    for command, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done[command] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def _faults(stderr: str) -> list[str]:
    """The fault lines (and their continuations): everything after the header."""
    return stderr.splitlines()[1:]


@pytest.mark.parametrize("case", list(CASES))
def test_every_command_refuses_alike(tmp_path: Path, case: str) -> None:
    write, expected = CASES[case]
    job = tmp_path / "job.yaml"
    if write is not None:
        write(job)
    results = _run_all(job, tmp_path)
    for command, result in results.items():
        where = f"malleus {command} ({case}): {result.stderr}"
        assert "Traceback" not in result.stderr + result.stdout, where
        assert result.returncode == 2, where
        assert result.stdout == "", where
        assert result.stderr.startswith("invalid "), where
        assert f" in {job} (" in result.stderr.splitlines()[0], where
        assert expected in result.stderr, where
    reference = results["check"].stderr
    for command in JOB_COMMANDS:
        assert results[command].stderr == reference, f"malleus {command} differs from check"
    assert _faults(results["plan"].stderr) == _faults(reference)
    assert not (tmp_path / "run").exists()  # refused before the work directory was made


def test_run_and_train_refuse_a_job_too_large_for_this_machine_alike(tmp_path: Path) -> None:
    job = ROOT / "examples" / "llama-70b.yaml"  # 64 ranks timed for real: a core each at least
    results = _run_all(job, tmp_path, commands=("run", "train"))
    for command, result in results.items():
        assert result.returncode == 2, f"malleus {command}: {result.stderr}"
        assert "Traceback" not in result.stderr, result.stderr
        assert "  - machine: too small for 64 ranks: " in result.stderr
        assert "--no-resource-check starts it anyway" in result.stderr.splitlines()[-1]
    available = re.compile(r"[\d.]+ GiB available")  # free memory moves between the two probes
    run, train = (available.sub("GiB available", results[c].stderr) for c in ("run", "train"))
    assert run == train

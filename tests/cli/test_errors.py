"""Refusals that help: each mistake made as a user makes it, answered with exit 2, where the
mistake is and the way out (the too-large job's `--no-resource-check` is held by
tests/cli/test_bad_input.py, which runs it)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from malleus.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-cpu.yaml"


def malleus(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as stop:  # --help
            code = int(stop.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_an_unknown_field_is_answered_with_the_name_it_most_likely_meant(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    text = TINY.read_text()
    assert "globalBatchSize:" in text and "gpusPerNode:" in text
    job.write_text(
        text.replace("globalBatchSize:", "globalBatchsize:").replace("gpusPerNode", "gpuPerNode")
    )
    code, out, err = malleus("check", str(job))
    assert (code, out) == (2, "")
    assert (
        '  - spec.training.globalBatchsize: unknown field "spec.training.globalBatchsize"; '
        "did you mean globalBatchSize?" in err
    )
    assert 'unknown field "spec.gpuPerNode"; did you mean gpusPerNode?' in err
    job.write_text(text.replace("  training:\n", "  training:\n    colour: blue\n"))
    code, _, err = malleus("check", str(job))
    assert code == 2 and 'unknown field "spec.training.colour"; allowed here: ' in err
    assert "globalBatchSize, gradClip" in err  # nothing close: the names allowed at that level


def test_bad_indentation_names_the_file_line_and_column(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    lines = TINY.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("gpusPerNode:"))
    lines[at] = " " + lines[at]  # one space too many
    job.write_text("\n".join(lines) + "\n")
    code, out, err = malleus("check", str(job))
    assert (code, out) == (2, "")
    assert "<unicode string>" not in err
    assert f'in "{job}", line {at + 1}, column ' in err
    assert f"\n      {lines[at]}\n" in err  # the line itself, with a caret under the fault
    assert "indented differently from the fields around it" in err


def test_rates_with_the_wrong_separator_name_the_separator() -> None:
    code, out, err = malleus("plan", str(TINY), "--rates", "3=2.5;7=failed")
    assert (code, out) == (2, "")
    assert (
        "  - --rates: '3=2.5;7=failed': separate the entries with commas, not ';': "
        "e.g. 3=2.5,17=failed" in err
    )
    assert "a rate is a slowdown" not in err


@pytest.mark.parametrize("command", [None, "check", "plan", "train", "run", "data"])
def test_help_speaks_the_users_words(command: str | None) -> None:
    code, out, err = malleus(*([command] if command else []), "--help")
    assert code == 0 and err == ""
    for internal in ("BadInput", "ResolvedJob", "str(", "§", "DESIGN", "torch"):
        assert internal not in out, f"malleus {command or ''} --help says {internal!r}"

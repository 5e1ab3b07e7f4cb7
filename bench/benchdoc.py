"""Write one benchmark's section of docs/benchmarks.md, leaving the other sections alone.

Each bench script owns the `## <Title>` section it writes; running one must never clobber
another's results (several benchmarks may run at once on a shared machine).
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import threading
from pathlib import Path

__all__ = ["DOC", "LoadSampler", "machine", "replace_section"]

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def replace_section(title: str, section: str, doc: Path = DOC) -> None:
    """Replace the `## title` section of `doc` with `section` (appended if absent)."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        # a function replacement: the section's backslashes are text, not group references
        text = pattern.sub(lambda _: section.rstrip() + "\n\n", text, count=1)
    else:
        text = text.rstrip() + "\n\n" + section.rstrip() + "\n"
    doc.write_text(text.rstrip() + "\n")


def machine() -> str:
    """The machine line every benchmark section records: cores, CPU model, Python."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} CPUs (`nproc`), {cpu}, Python {platform.python_version()}"


class LoadSampler:
    """Samples the 1-minute load average every few seconds while the benchmark runs."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.samples = [os.getloadavg()[0]]
        self._every = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> str:
        s = self.samples
        return f"mean {statistics.mean(s):.1f}, min {min(s):.1f}, max {max(s):.1f}"

"""How Malleus writes its figures for people: one notation, used by every printer.

The command line (`check`, `plan`, `train`, `run`), the run summary, the report's text, the plot
and the trainers' log lines all format through these functions, so that one thing is always
written one way:

- **layers**: inclusive ranges, `0-19` is layers 0 to 19, `5` one layer; a pipeline's split
  stage by stage `0-9 / 10-19` (`layer_range`, `layer_split`). Plan JSON keeps its half-open
  `[start, end)` pairs: this is how text shows them, not the data.
- **ranks**: `0-3,6` for a set of ranks (`rank_list`); failed ranks are said to be failed, never
  folded into the excluded ones.
- **speedup** (old time / new time) as `1.46x`, and **time saved** (1 - new / old) as `31.5%`,
  each named so in the text (`speedup`, `time_saved`): a speedup is never a percentage and time
  saved never an `x`.
- **bytes**: one binary family, `512 B`, `1.2 KiB`, `3.4 MiB`, `2.0 GiB`, `1.5 TiB`
  (`size`); the planner's MB are MiB (2^20 bytes): `size_mib`.
- **steps**: a step is named by its 0-based index, as the emulation schedule, the report and the
  plot name it (`step 0` is the first); a count of steps done is `N/T steps`. The trainers'
  step line says both: `step 0 (1/20)` (`step_progress`, parsed back by `STEP_LINE`).
- **rates**: a GPU's straggling rate (a slowdown, 1.00 = healthy) `4.00`, `failed` for an
  unusable GPU (`rate`); only GPUs have rates (a TP group's pace is not one).

A leaf module: it imports nothing from Malleus, so that every room (the planner at the bottom,
the trainers, the operator) can use it, and nothing here needs torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

__all__ = [
    "STEP_LINE",
    "layer_range",
    "layer_split",
    "parse_size",
    "rank_list",
    "rate",
    "size",
    "size_mib",
    "speedup",
    "step_progress",
    "time_saved",
]

_MIB = float(1 << 20)
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def layer_range(layers: Sequence[int]) -> str:
    """A stage's half-open `[a, b)` as inclusive text: `(0, 20)` -> `0-19`; `(5, 6)` -> `5`."""
    a, b = int(layers[0]), int(layers[1])
    return str(a) if b - a == 1 else f"{a}-{b - 1}"


def layer_split(stages: Iterable[Sequence[int]]) -> str:
    """A pipeline's layers stage by stage: `[(0, 2), (2, 4)]` -> `0-1 / 2-3`."""
    return " / ".join(layer_range(s) for s in stages)


def rank_list(ranks: Iterable[int]) -> str:
    """A set of ranks, runs compressed: `[0, 1, 2, 3, 6]` -> `0-3,6`; `-` for none."""
    ordered = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out) or "-"


def speedup(ratio: float | None) -> str:
    """old time / new time as `1.46x`; `-` when unknown."""
    return "-" if ratio is None else f"{ratio:.2f}x"


def time_saved(fraction: float | None) -> str:
    """1 - new time / old time as `31.5%`; `-` when unknown."""
    return "-" if fraction is None else f"{fraction:.1%}"


def size(n_bytes: float | None) -> str:
    """Bytes in binary units: `512 B`, `1.2 KiB`, `3.4 MiB`, `2.0 GiB`; `-` when unknown."""
    if n_bytes is None:
        return "-"
    value = float(n_bytes)
    unit = 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{value:.0f} B" if unit == 0 else f"{value:,.1f} {_UNITS[unit]}"


def parse_size(text: str) -> float:
    """`size`'s text back to bytes (to its precision): `1.1 MiB` -> 1153433.6."""
    number, _, unit = text.strip().partition(" ")
    return float(number.replace(",", "")) * 1024 ** _UNITS.index(unit.strip())


def size_mib(mib: float | None) -> str:
    """A figure in MiB (the planner's and the memory model's MB) in `size`'s units."""
    return "-" if mib is None else size(mib * _MIB)


def rate(value: float | None) -> str:
    """A GPU's straggling rate: `1.00`, `4.00`; `failed` for an unusable GPU (None)."""
    return "failed" if value is None else f"{value:.2f}"


def step_progress(index: int, total: int) -> str:
    """`step 0 (1/20)`: a finished step by its 0-based index, and the steps done with it."""
    return f"step {index} ({index + 1}/{total})"


STEP_LINE = re.compile(
    r"\[malleus\] step (?P<index>\d+) \((?P<done>\d+)/(?P<total>\d+)\) "
    r"loss (?P<loss>[-+0-9.eEnaif]+).*? (?P<seconds>[0-9.]+)s (?P<tps>[0-9,.]+) tok/s"
)
"""A trainer's step line (trainer/run/loop.py writes it with `step_progress`):
`[malleus] step 4 (5/30) loss 5.0400 norm 1.765 lr 3.00e-03 0.846s 1,211 tok/s`."""

"""Judging a write body of the control endpoint (trainer/endpoint/server.py) before anything acts on it.

Pure functions of the bytes, with no HTTP in them, so that the server module reads as the
routing and the plumbing: a body is strict JSON (no NaN), an object, bounded in nesting
(`MAX_DEPTH`, checked level by level, never by recursion), and an injection's fields are
checked against the world and `MAX_FACTOR`. Anything refused is a `Refused`, which the
handler turns into a 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from malleus.job import MAX_RATE

__all__ = ["MAX_DEPTH", "MAX_FACTOR", "Refused", "parse_body", "parse_injection"]

MAX_FACTOR = MAX_RATE
"""The largest slowdown `POST /inject` takes: the CRD's bound on a schedule's factor, so an
injection cannot stall the emulated clock for hours."""
MAX_DEPTH = 32
"""Deepest JSON nesting a write body may have (a plan nests 5 deep)."""


class Refused(ValueError):
    """A write body the endpoint will not act on: a 400 naming `path` (the field)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path, self.message = path, message


def _no_constant(name: str) -> Any:
    raise Refused("", f"body is not JSON: {name} is not a JSON number")


def parse_body(body: bytes) -> dict[str, Any]:
    """A write body as a JSON object (an empty body is ``{}``), or `Refused`.

    The nesting is bounded before anything recurses over the value: `json` itself stops near
    the interpreter's recursion limit, with a RecursionError that would kill the handler.
    """
    if not body.strip():
        return {}
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise Refused("", f"body nests deeper than {MAX_DEPTH}") from None
    except UnicodeDecodeError as e:
        raise Refused("", f"body is not UTF-8: {e}") from None
    except Refused:
        raise
    except ValueError as e:  # JSONDecodeError; also an integer of more than 4300 digits
        raise Refused("", f"body is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise Refused("", f"expected a JSON object, got {type(value).__name__}")
    if _deeper(value, MAX_DEPTH):
        raise Refused("", f"body nests deeper than {MAX_DEPTH}")
    return value


def _deeper(value: Any, limit: int) -> bool:
    """Whether `value` nests objects and arrays more than `limit` deep (level by level, so
    no recursion)."""
    level, depth = [value], 1
    while level:
        level = [
            v
            for c in level
            for v in (c.values() if isinstance(c, dict) else c)
            if isinstance(v, (dict, list))
        ]
        depth += bool(level)
        if depth > limit:
            return True
    return False


def _show(value: Any) -> str:
    """`value` for an error message, cut short: a refused body may be a megabyte of string."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_injection(req: Mapping[str, Any], world: int) -> tuple[int, float]:
    """``{"rank", "factor"}`` checked against the world and `MAX_FACTOR`, or `Refused`."""
    for name in sorted({"rank", "factor"} ^ set(req)):
        why = "unknown field" if name in req else "required"
        raise Refused(name, f'{why}: send exactly {{"rank": <int>, "factor": <number>}}')
    rank, factor = req["rank"], req["factor"]
    if not (_number(rank) and isinstance(rank, int) and 0 <= rank < world):
        raise Refused("rank", f"{_show(rank)}; need an integer from 0 to {world - 1} (the world)")
    # A comparison, not float(): an integer of 400 digits compares, but does not convert.
    if not (_number(factor) and 1.0 <= factor <= MAX_FACTOR):
        raise Refused(
            "factor", f"{_show(factor)}; need a number from 1 (healthy) to {MAX_FACTOR:g}"
        )
    return rank, float(factor)

"""`control_status`: a trainer's `GET /status` answer for tests, every field at a plain default
(a 4-rank job "demo" at step 3 of 10, generation 1, nothing pending, migrated or failed) and
the test's own fields over them, so a test names only what it is about."""

from __future__ import annotations

from typing import Any

from malleus.control import ControlStatus

__all__ = ["control_status"]


def control_status(**fields: Any) -> ControlStatus:
    base: dict[str, Any] = dict(
        job="demo", world=4, generation=1, pending_generation=None, step=3, steps=10,
        done=False, stopping=False, rates={}, step_seconds=None, tokens_per_second=None,
        last_migration=None, last_failure=None,
    )  # fmt: skip
    return ControlStatus(**(base | fields))

"""Process groups keyed by member set, created in one order every rank follows.

`new_group` is collective over the whole world: every rank, excluded ones included, must call
it for every group in the same order. The cache makes a later plan reuse the groups it shares
with an earlier one, so a plan switch creates only the new member sets. Members are GPU ids,
translated to process-group ranks by the process's `World` (trainer/world/world.py) when a
group is created.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from malleus.trainer.world.world import World

__all__ = ["GroupCache"]


class GroupCache:
    def __init__(self, world: World) -> None:
        self.world = world
        self._groups: dict[tuple[int, ...], Any] = {}

    def ensure(self, member_sets: Iterable[tuple[int, ...]]) -> None:
        """Create, in the given order, every set not created yet (called on all ranks)."""
        for members in member_sets:
            key = tuple(sorted(members))
            if key not in self._groups:
                ranks = [self.world.pg(g) for g in key]
                self._groups[key] = dist.new_group(ranks, timeout=self._timeout())

    def _timeout(self) -> timedelta | None:
        if self.world.store is None:  # failures are fatal: the job's own default
            return None
        return timedelta(seconds=self.world.collective_timeout_s)

    def groups(self) -> list[Any]:
        return list(self._groups.values())

    def get(self, members: Iterable[int]) -> Any:
        return self._groups[tuple(sorted(members))]

    def reset(self) -> None:
        """Forget every group: the process group they belonged to was re-formed."""
        self._groups.clear()

    def __len__(self) -> int:
        return len(self._groups)

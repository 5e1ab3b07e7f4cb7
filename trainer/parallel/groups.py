"""Process groups keyed by member set, created in one order every rank follows.

`new_group` is collective over the whole world: every rank, excluded ones included, must call
it for every group in the same order. The cache makes a later plan reuse the groups it shares
with an earlier one, so a plan switch creates only the new member sets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

__all__ = ["GroupCache"]


class GroupCache:
    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], Any] = {}

    def ensure(self, member_sets: Iterable[tuple[int, ...]]) -> None:
        """Create, in the given order, every set not created yet (called on all ranks)."""
        for members in member_sets:
            key = tuple(sorted(members))
            if key not in self._groups:
                self._groups[key] = dist.new_group(list(key))

    def get(self, members: Iterable[int]) -> Any:
        return self._groups[tuple(sorted(members))]

    def __len__(self) -> int:
        return len(self._groups)

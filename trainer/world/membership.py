"""Who is in the job now: GPU ids (the plan's ranks) against process-group ranks.

A job starts with every GPU `0..world-1` in one process group, GPU g being process-group rank
g. After a recovery (trainer/recovery/protocol.py) the survivors re-form the group among themselves, so
it has fewer ranks than the job has GPUs. The trainer keeps GPU ids everywhere (plans, layouts,
the step's world vector, checkpoints) and translates at the one place an id meets
torch.distributed: `pg(gpu)`. Members are kept sorted, so the translation is monotonic and a
group's process-group order is its GPU order. The coordinator is the lowest member.

The membership in force is held by the process's `World` (trainer/world/world.py), which installs
a new one when the process group is formed or re-formed. Without a re-form it is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Membership"]


@dataclass(frozen=True)
class Membership:
    """The job's process group at one epoch (0 = as started; +1 per re-form)."""

    epoch: int
    members: tuple[int, ...]  # sorted GPU ids in the process group
    lead: int | None = None  # the coordinator; None (or not a member): the lowest member
    _index: dict[int, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if list(self.members) != sorted(set(self.members)):
            raise ValueError(f"members must be sorted and distinct: {self.members}")
        self._index.update({g: i for i, g in enumerate(self.members)})

    @classmethod
    def full(cls, world: int) -> Membership:
        return cls(0, tuple(range(world)))

    @property
    def coordinator(self) -> int:
        """The coordinator stays where it is while it lives (a replacement of GPU 0 joining
        does not take it back); when it fails, the lowest survivor takes over."""
        return self.lead if self.lead in self._index else self.members[0]

    @property
    def size(self) -> int:
        return len(self.members)

    def pg(self, gpu: int) -> int:
        """GPU id -> its rank in the process group; KeyError for a GPU out of the job."""
        try:
            return self._index[gpu]
        except KeyError:
            raise KeyError(f"GPU {gpu} is not in the job (members {list(self.members)})") from None

    def gpu(self, pg_rank: int) -> int:
        return self.members[pg_rank]

    def __contains__(self, gpu: object) -> bool:
        return gpu in self._index

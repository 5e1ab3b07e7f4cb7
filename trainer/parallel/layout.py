"""`Layout`: everything a rank derives from a Plan, computed from the plan alone.

One object answers "where am I" (pipeline, stage, TP group, layers, logical shards,
micro-batches, P2P peers) and "what does everyone hold" (the holders of every piece, the
gradient-sync buckets, the process groups every rank must create and in which order). All
ranks build the same Layout from the same plan, which is what keeps collectives in step.
No torch here: the layout can be built, printed and tested anywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

from malleus.job import ModelConfig
from malleus.notation import layer_range, rank_list
from malleus.planner import Plan
from malleus.trainer.model.decoder import Piece, pieces

__all__ = ["Bucket", "Layout", "PieceRoles", "Place", "rank_matrix"]


@dataclass(frozen=True)
class Place:
    """A rank's seat in a plan: its stage, TP group and neighbours."""

    pipeline: int
    stage: int
    num_stages: int
    index: int  # position in the TP group; holds shards [index*n, (index+1)*n)
    group: tuple[int, ...]  # the TP group, in shard order
    layers: range
    shards: range
    micro_batches: int
    micro_offset: int  # global index (within a step) of the pipeline's first micro-batch
    prev_group: tuple[int, ...] = ()  # the previous stage's TP group (empty: first stage)
    next_group: tuple[int, ...] = ()  # the next stage's TP group (empty: last stage)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    # Activations and their gradients are whole on every GPU of a group, so receiving GPU i
    # takes from sending GPU i mod sender_size, in both directions.
    @property
    def fwd_src(self) -> int | None:
        """Who sends me my input activation."""
        return self.prev_group[self.index % len(self.prev_group)] if self.prev_group else None

    @property
    def fwd_dsts(self) -> tuple[int, ...]:
        """Whom I send my output activation."""
        n = len(self.group)
        return tuple(r for i, r in enumerate(self.next_group) if i % n == self.index)

    @property
    def bwd_src(self) -> int | None:
        """Who sends me the gradient of my output."""
        return self.next_group[self.index % len(self.next_group)] if self.next_group else None

    @property
    def bwd_dsts(self) -> tuple[int, ...]:
        """Whom I send the gradient of my input."""
        n = len(self.group)
        return tuple(r for i, r in enumerate(self.prev_group) if i % n == self.index)


@dataclass(frozen=True)
class PieceRoles:
    """Who holds a piece (pipeline, stage, group order) and whose gradient counts.

    A sharded piece's every holder computes its own partial gradient. A replicated norm has the
    same gradient on every GPU of a TP group, so only the first GPU of each group contributes
    (the others add zeros); `owner` counts the piece in the global gradient norm and writes it
    to checkpoints.
    """

    holders: tuple[int, ...]
    contributors: tuple[int, ...]

    @property
    def owner(self) -> int:
        return self.contributors[0]


@dataclass(frozen=True)
class Bucket:
    """Pieces with the same holder set, summed across it in one collective."""

    members: tuple[int, ...]  # sorted ranks
    pieces: tuple[str, ...]  # canonical order
    collective: bool  # False: one contributor, the gradient is already complete everywhere


def _stage_pieces(
    cfg: ModelConfig, tp: int, layers: range, shards: range, first: bool, last: bool
) -> Iterator[Piece]:
    """The pieces a GPU of such a stage holds."""
    for piece in pieces(cfg, tp):
        spec = piece.spec
        if spec.layer is not None:
            held = spec.layer in layers
        elif spec.name == "embed.weight":
            held = first or (last and cfg.tied_embeddings)
        else:  # norm.weight, head.weight
            held = last
        if held and (piece.shard is None or _meets(piece.serves(tp), shards)):
            yield piece


def _meets(a: range, b: range) -> bool:
    """Whether two shard ranges overlap (a replicated kv piece serves several shards)."""
    return a.start < b.stop and b.start < a.stop


@dataclass(frozen=True)
class Layout:
    """A plan as seen by one rank (`place` is None for excluded or idle ranks).

    The model is cut into the plan's `tp` logical shards per layer (the job's tp: a plan for
    another tp fails the trainer's `check_plan` first).
    """

    plan: Plan
    model: ModelConfig
    rank: int
    world: int
    place: Place | None
    roles: dict[str, PieceRoles] = field(repr=False)
    buckets: tuple[Bucket, ...] = field(repr=False)

    @classmethod
    def from_plan(cls, plan: Plan, model: ModelConfig, rank: int, world: int) -> Layout:
        place = None
        offset = 0
        for i, p in enumerate(plan.pipelines):
            for j, s in enumerate(p.stages):
                if rank in s.ranks:
                    index = s.ranks.index(rank)
                    place = Place(
                        pipeline=i,
                        stage=j,
                        num_stages=len(p.stages),
                        index=index,
                        group=tuple(s.ranks),
                        layers=range(*s.layers),
                        shards=s.shards_of(index, plan.tp),
                        micro_batches=p.micro_batches,
                        micro_offset=offset,
                        prev_group=tuple(p.stages[j - 1].ranks) if j else (),
                        next_group=tuple(p.stages[j + 1].ranks) if j + 1 < len(p.stages) else (),
                    )
            offset += p.micro_batches
        roles = _roles(plan, model)
        return cls(plan, model, rank, world, place, roles, _buckets(model, plan.tp, roles))

    @property
    def tp(self) -> int:
        """Logical shards per layer."""
        return self.plan.tp

    @property
    def active(self) -> bool:
        return self.place is not None

    @property
    def role(self) -> str:
        if self.place is not None:
            return "stage"
        return "excluded" if self.rank in self.plan.excluded else "idle"

    @property
    def total_micro_batches(self) -> int:
        return sum(p.micro_batches for p in self.plan.pipelines)

    def held(self) -> list[Piece]:
        """The pieces this rank holds, in canonical order."""
        return list(self._held)

    def owned(self) -> list[str]:
        """The pieces this rank counts in the gradient norm and writes to checkpoints."""
        return list(self._owned)

    @functools.cached_property
    def _held(self) -> tuple[Piece, ...]:
        return tuple(
            p for p in pieces(self.model, self.tp) if self.rank in self.roles[p.name].holders
        )

    @functools.cached_property
    def _owned(self) -> tuple[str, ...]:
        return tuple(
            p.name for p in pieces(self.model, self.tp) if self.roles[p.name].owner == self.rank
        )

    def contributes(self, name: str) -> bool:
        return self.rank in self.roles[name].contributors

    def my_buckets(self) -> Iterator[Bucket]:
        """Buckets this rank takes part in, in the global order."""
        return (b for b in self.buckets if b.collective and self.rank in b.members)

    def member_sets(self) -> list[tuple[int, ...]]:
        """Every multi-rank group of the plan in the order all ranks create them:
        TP groups by (pipeline, stage), then gradient-sync buckets in global order."""
        seen: dict[tuple[int, ...], None] = {}
        for _, _, s in self.plan.stages():
            if len(s.ranks) > 1:
                seen.setdefault(tuple(sorted(s.ranks)), None)
        for b in self.buckets:
            if b.collective:
                seen.setdefault(b.members, None)
        return list(seen)

    def rank_matrix(self) -> str:
        return rank_matrix(self.plan)


def _roles(plan: Plan, cfg: ModelConfig) -> dict[str, PieceRoles]:
    every = pieces(cfg, plan.tp)
    holders: dict[str, list[int]] = {p.name: [] for p in every}
    contributors: dict[str, list[int]] = {p.name: [] for p in every}
    for p in plan.pipelines:
        last = len(p.stages) - 1
        for j, s in enumerate(p.stages):
            for index, rank in enumerate(s.ranks):
                shards = s.shards_of(index, plan.tp)
                for piece in _stage_pieces(
                    cfg, plan.tp, range(*s.layers), shards, j == 0, j == last
                ):
                    name = piece.name
                    if rank in holders[name]:
                        continue  # a tied embedding on a one-stage pipeline
                    holders[name].append(rank)
                    if piece.shard is not None or index == 0:
                        contributors[name].append(rank)
    missing = [n for n, h in holders.items() if not h]
    if missing:
        raise ValueError(f"plan leaves pieces without a holder: {missing[:4]}...")
    return {n: PieceRoles(tuple(holders[n]), tuple(contributors[n])) for n in holders}


def _buckets(cfg: ModelConfig, tp: int, roles: dict[str, PieceRoles]) -> tuple[Bucket, ...]:
    groups: dict[tuple[int, ...], list[str]] = {}
    for piece in pieces(cfg, tp):
        groups.setdefault(tuple(sorted(roles[piece.name].holders)), []).append(piece.name)
    return tuple(
        Bucket(members, tuple(names), any(len(roles[n].contributors) > 1 for n in names))
        for members, names in groups.items()
    )


def rank_matrix(plan: Plan) -> str:
    """A printable picture: one row per pipeline, one cell per stage (ranks, layers inclusive
    as everywhere (`malleus.notation`), logical shards per GPU)."""
    lines = [f"plan generation {plan.generation}, tp {plan.tp}, {plan.dp} pipeline(s)"]
    for i, p in enumerate(plan.pipelines):
        cells = []
        for s in p.stages:
            n = s.shards_per_gpu(plan.tp)
            cells.append(
                f"ranks {','.join(map(str, s.ranks))} layers {layer_range(s.layers)} "
                f"({n} shard{'s' if n != 1 else ''} each)"
            )
        lines.append(f"  pipeline {i} ({p.micro_batches} micro-batches): " + " | ".join(cells))
    if plan.excluded:
        lines.append(f"  excluded ranks: {rank_list(plan.excluded)}")
    return "\n".join(lines)

"""What a re-plan changed, in words: one plan against the next, a pure function of the two.

`describe(old, new)` says which ranks left the layout (excluded: usable and idle, or failed:
unusable, in neither the new plan's stages nor its excluded ranks) and which came back,
which tensor-parallel groups were regrouped (a group's ranks or their shard order), which
pipelines hold different layers per stage or per rank, how the micro-batches were re-split, and
how much state moved (the trainers' figure, when given). The summary, the progress line of a
re-plan and the plot's re-plan markers all use it, so they say the same thing:

    rank 1 excluded; TP 0,1 -> 0; pipeline 0: layers 0-1 / 2-3 -> 0 / 1-3 on 0 > 2,3;
    micro-batches 8/8 -> 6/10; 1.2 MiB migrated

Layer ranges are shown inclusive (`0-3` is layers 0, 1, 2 and 3), stages separated by ` / `,
their ranks (`on 0 > 2,3`: TP groups in pipeline order) after them; sizes in binary units:
`malleus.notation`, as everywhere.
A new pipeline is compared with the old pipeline it shares most ranks with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from malleus.notation import layer_split, size
from malleus.planner.plan import Pipeline, Plan

__all__ = ["PipelineLayers", "PlanChange", "describe", "describe_summaries", "layers_text"]


def layers_text(splits: Sequence[Sequence[int]]) -> str:
    """A pipeline's layer split, stage by stage: `0-1 / 2-3` (`malleus.notation.layer_split`)."""
    return layer_split(splits)


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks))


def _who(ranks: Sequence[int], word: str) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {word}"


@dataclass(frozen=True)
class PipelineLayers:
    """A pipeline of the new plan whose layers moved: its split before and after."""

    pipeline: int
    """Index in the new plan."""
    stages: tuple[tuple[int, ...], ...]
    """The new stages' ranks."""
    before: tuple[tuple[int, int], ...] | None
    """The split of the old pipeline it shares most ranks with; None: no rank was in one."""
    after: tuple[tuple[int, int], ...]

    def text(self) -> str:
        after = layers_text(self.after)
        stages = " > ".join(_ranks(s) for s in self.stages)
        if self.before is None:
            return f"pipeline {self.pipeline}: new, layers {after} on {stages}"
        before = layers_text(self.before)
        if before == after:  # same split, other ranks on the stages
            return f"pipeline {self.pipeline}: layers {after} now on {stages}"
        return f"pipeline {self.pipeline}: layers {before} -> {after} on {stages}"


@dataclass(frozen=True)
class PlanChange:
    """The difference between two plans (see the module doc)."""

    excluded: tuple[int, ...] = ()
    """Ranks that ran under the old plan and sit out, usable, under the new one."""
    failed: tuple[int, ...] = ()
    """Ranks that ran under the old plan and are gone from the new one (unusable: failed)."""
    readmitted: tuple[int, ...] = ()
    """Ranks idle under the old plan that run under the new one."""
    tp_before: tuple[tuple[int, ...], ...] = ()
    """The old TP groups (shard order) that no longer exist."""
    tp_after: tuple[tuple[int, ...], ...] = ()
    """The new TP groups that did not exist."""
    layers: tuple[PipelineLayers, ...] = ()
    micro_batches: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """Micro-batches per pipeline, before and after; None: unchanged."""
    migrated_bytes: float | None = None
    """State the trainers moved; None: not known (then not said)."""

    @property
    def tp_regrouped(self) -> bool:
        return bool(self.tp_before or self.tp_after)

    @property
    def layers_moved(self) -> bool:
        return bool(self.layers)

    @property
    def unchanged(self) -> bool:
        return not (
            self.excluded
            or self.failed
            or self.readmitted
            or self.tp_regrouped
            or self.layers
            or self.micro_batches
        )

    def _migrated(self) -> str | None:
        if self.migrated_bytes is None:
            return None
        if self.migrated_bytes <= 0:
            return "nothing migrated"
        return f"{size(self.migrated_bytes)} migrated"

    def phrases(self) -> list[str]:
        """Every change, in full: `rank 1 excluded`, `TP 0,1 + 2,3 -> 0,2 + 3`, ..."""
        out = []
        if self.excluded:
            out.append(_who(self.excluded, "excluded"))
        if self.failed:
            out.append(_who(self.failed, "failed"))
        if self.readmitted:
            out.append(_who(self.readmitted, "re-admitted"))
        if self.tp_regrouped:
            before = " + ".join(_ranks(g) for g in self.tp_before) or "-"
            after = " + ".join(_ranks(g) for g in self.tp_after) or "-"
            out.append(f"TP {before} -> {after}")
        out += [p.text() for p in self.layers]
        if self.micro_batches is not None:
            old, new = self.micro_batches
            out.append(f"micro-batches {'/'.join(map(str, old))} -> {'/'.join(map(str, new))}")
        if self.unchanged:
            out.append("same layout")
        migrated = self._migrated()
        if migrated:
            out.append(migrated)
        return out

    def text(self) -> str:
        """One line: the phrases joined by `; `."""
        return "; ".join(self.phrases())

    def labels(self) -> list[str]:
        """Short phrases for a plot marker: `rank 1 excluded`, `TP regrouped`, `layers moved`."""
        out = []
        if self.excluded:
            out.append(_who(self.excluded, "out"))
        if self.failed:
            out.append(_who(self.failed, "failed"))
        if self.readmitted:
            out.append(_who(self.readmitted, "back"))
        if self.tp_regrouped:
            out.append("TP regrouped")
        if self.layers:
            out.append("layers moved")
        if self.micro_batches is not None:
            out.append("micro-batches re-split")
        if self.unchanged:
            out.append("same layout")
        migrated = self._migrated()
        if migrated and self.migrated_bytes and self.migrated_bytes > 0:
            out.append(size(self.migrated_bytes))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "excluded": list(self.excluded),
            "failed": list(self.failed),
            "readmitted": list(self.readmitted),
            "tp_regrouped": self.tp_regrouped,
            "tp_before": [list(g) for g in self.tp_before],
            "tp_after": [list(g) for g in self.tp_after],
            "layers_moved": [
                {
                    "pipeline": p.pipeline,
                    "stages": [list(s) for s in p.stages],
                    "before": None if p.before is None else [list(s) for s in p.before],
                    "after": [list(s) for s in p.after],
                }
                for p in self.layers
            ],
            "micro_batches": None
            if self.micro_batches is None
            else {"before": list(self.micro_batches[0]), "after": list(self.micro_batches[1])},
            "migrated_bytes": self.migrated_bytes,
            "text": self.text(),
            "labels": self.labels(),
        }


def _groups(plan: Plan) -> list[tuple[int, ...]]:
    return [tuple(s.ranks) for _, _, s in plan.stages()]


def _rank_layers(plan: Plan) -> dict[int, tuple[int, int]]:
    return {r: (s.layers[0], s.layers[1]) for _, _, s in plan.stages() for r in s.ranks}


def _split(p: Pipeline) -> tuple[tuple[int, int], ...]:
    return tuple((s.layers[0], s.layers[1]) for s in p.stages)


def _ranks_of(p: Pipeline) -> set[int]:
    return {r for s in p.stages for r in s.ranks}


def describe(old: Plan, new: Plan, migrated_bytes: float | None = None) -> PlanChange:
    """What going from `old` to `new` changes (see the module doc)."""
    before, after = set(old.active_ranks()), set(new.active_ranks())
    old_groups, new_groups = _groups(old), _groups(new)
    old_layers, new_layers = _rank_layers(old), _rank_layers(new)
    moved = []
    for i, p in enumerate(new.pipelines):
        ranks = _ranks_of(p)
        overlap = [(len(ranks & _ranks_of(q)), -j, q) for j, q in enumerate(old.pipelines)]
        best = max(overlap, key=lambda t: (t[0], t[1]), default=None)
        match = best[2] if best is not None and best[0] > 0 else None
        split = _split(p)
        old_split = None if match is None else _split(match)
        shifted = any(r in old_layers and old_layers[r] != new_layers[r] for r in ranks)
        if match is None or shifted or old_split != split:
            moved.append(
                PipelineLayers(
                    pipeline=i,
                    stages=tuple(tuple(s.ranks) for s in p.stages),
                    before=old_split,
                    after=split,
                )
            )
    old_mb = tuple(p.micro_batches for p in old.pipelines)
    new_mb = tuple(p.micro_batches for p in new.pipelines)
    gone = before - after
    idle = set(new.excluded)
    return PlanChange(
        excluded=tuple(sorted(r for r in gone if r in idle)),
        failed=tuple(sorted(r for r in gone if r not in idle)),
        readmitted=tuple(sorted(after - before)),
        tp_before=tuple(sorted(g for g in old_groups if g not in new_groups)),
        tp_after=tuple(sorted(g for g in new_groups if g not in old_groups)),
        layers=tuple(moved),
        micro_batches=None if old_mb == new_mb else (old_mb, new_mb),
        migrated_bytes=migrated_bytes,
    )


def describe_summaries(
    old: Mapping[str, Any], new: Mapping[str, Any], tp: int, migrated_bytes: float | None = None
) -> PlanChange:
    """`describe` on two plans as the report writes them (`plan_summary`: no `tp`)."""
    fields = ("pipelines", "excluded")
    return describe(
        Plan.model_validate({"tp": tp, **{k: old[k] for k in fields if k in old}}),
        Plan.model_validate({"tp": tp, **{k: new[k] for k in fields if k in new}}),
        migrated_bytes,
    )

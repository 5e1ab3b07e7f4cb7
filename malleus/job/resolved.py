"""The resolved job: one MalleusJob as every consumer sees it, judged and derived in one place.

The operator, `malleus check` / `run` / `train`, the trainers and the benchmarks all turn a
manifest into a `ResolvedJob` and read sizes, the world, micro-batches, tokens per step,
emulated times, the semantic faults, the planning problem and the initial plan from it, so that
every entry point decides alike: a job `malleus check` refuses is one the operator fails as
InvalidSpec, with the same messages.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from malleus.errors import BadInput, Fault
from malleus.planner.plan import Plan
from malleus.planner.problem import MAX_RATE, Calibration, MemorySpec, ModelSpec, PlanningProblem
from malleus.planner.validate import validate_plan

from .data import data_faults, data_file_faults
from .hf import folder_faults
from .load import load_job
from .memory import memory_model, model_parameters
from .model import resolve_model
from .presets import ModelConfig
from .rates import clean_rates
from .spec import MalleusJobSpec, StragglerPolicy
from .status import MalleusJob

__all__ = [
    "INITIAL_GENERATION",
    "MAX_RATE",
    "Planner",
    "ResolvedJob",
    "clean_rates",
    "resolve_model",
]

INITIAL_GENERATION = 1
"""Generation of the plan a job starts with; every applied re-plan adds one."""

Planner = Callable[..., Plan]
"""`planner(problem, *, time_limit=seconds) -> Plan`, e.g. `malleus.planner.search.plan`."""


@dataclass(frozen=True)
class ResolvedJob:
    """A validated MalleusJob and everything derived from it (build with `of` or `load`)."""

    job: MalleusJob
    model: ModelConfig
    """The model's sizes: the preset's, overridden by explicit fields."""
    source: str | None = None
    """The file the job was read from: every `BadInput` about the job names it."""

    @classmethod
    def of(cls, job: MalleusJob, source: str | None = None) -> ResolvedJob:
        """Resolve a typed job; `BadInput` when the model's sizes cannot be resolved."""
        try:
            return cls(job=job, model=resolve_model(job.spec.model), source=source)
        except BadInput as error:
            raise BadInput(error.faults, source) from None

    @classmethod
    def load(
        cls, source: str | os.PathLike[str] | Mapping[str, Any], *, strict: bool = True
    ) -> ResolvedJob:
        """Load a manifest (file or mapping) and resolve it; schema faults raise `BadInput`."""
        label = None if isinstance(source, Mapping) else os.fspath(source)
        return cls.of(load_job(source, strict=strict), label)

    # -- identity and sizes ---------------------------------------------------------------------

    @property
    def spec(self) -> MalleusJobSpec:
        return self.job.spec

    @property
    def name(self) -> str:
        return self.job.metadata.name

    @property
    def nodes(self) -> int:
        return self.spec.nodes

    @property
    def gpus_per_node(self) -> int:
        return self.spec.gpus_per_node

    @property
    def world(self) -> int:
        """GPUs (= trainer ranks) the job owns: nodes x gpusPerNode, excluded ones included."""
        return self.spec.nodes * self.spec.gpus_per_node

    @property
    def tp(self) -> int:
        """Nominal tensor-parallel degree: every layer is cut into this many logical shards."""
        return self.spec.parallelism.tp

    @property
    def micro_batch_size(self) -> int:
        return self.spec.training.micro_batch_size

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step (globalBatchSize / microBatchSize): every plan splits these."""
        return self.spec.training.global_batch_size // self.spec.training.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.spec.training.global_batch_size * self.model.sequence

    @property
    def steps(self) -> int:
        return self.spec.training.steps

    @property
    def parameters(self) -> int:
        """Parameters of the whole model."""
        return model_parameters(self.model)

    @property
    def policy(self) -> StragglerPolicy:
        return self.spec.straggler_policy

    # -- emulation ------------------------------------------------------------------------------

    @property
    def emulated(self) -> bool:
        return self.spec.emulation.enabled

    def layer_seconds(self) -> tuple[float, float] | None:
        """(forward, backward) emulated seconds of one layer-shard; None with real timings."""
        return self.spec.emulation.layer_seconds() if self.emulated else None

    @property
    def unit_seconds(self) -> float | None:
        """Emulated seconds of one cost-model unit (a layer's forward + backward); None if real."""
        seconds = self.layer_seconds()
        return sum(seconds) if seconds is not None else None

    @property
    def schedule(self) -> tuple[tuple[int, int, float], ...]:
        """Emulated compute slowdowns as (step, rank, factor); empty without emulation."""
        if not self.emulated:
            return ()
        return tuple(
            (e.step, e.rank, e.factor)
            for e in self.spec.emulation.schedule
            if e.rank is not None and e.factor is not None
        )

    @property
    def failures(self) -> tuple[tuple[int, int, str], ...]:
        """Emulated failures as (step, rank, "kill" | "hang"); empty without emulation."""
        if not self.emulated:
            return ()
        return tuple(
            (e.step, e.rank, e.fail)
            for e in self.spec.emulation.schedule
            if e.rank is not None and e.fail is not None
        )

    @property
    def link_schedule(self) -> tuple[tuple[int, int, float], ...]:
        """Emulated link slowdowns as (step, node, factor); empty without emulation."""
        if not self.emulated:
            return ()
        return tuple(
            (e.step, e.node, e.link)
            for e in self.spec.emulation.schedule
            if e.node is not None and e.link is not None
        )

    # -- what no schema can say -----------------------------------------------------------------

    def faults(self) -> list[Fault]:
        """Every semantic fault (the schema's and CEL's are `load_job`'s); empty when runnable.

        Memory is judged by the planner: `initial_plan` fails when no layout fits.
        """
        spec, cfg, tp = self.spec, self.model, self.tp
        faults: list[Fault] = []
        where = "spec.parallelism.tp"
        if tp & (tp - 1):
            faults.append(Fault(where, f"{tp} is not a power of two"))
        if spec.gpus_per_node % tp:
            faults.append(
                Fault(
                    where,
                    f"tp({tp}) does not divide gpusPerNode({spec.gpus_per_node}); "
                    "a tensor-parallel group lives inside one node",
                )
            )
        derived = self.spec.model.head_dim is None and self.spec.model.path is None
        if derived and cfg.hidden % cfg.heads:
            faults.append(
                Fault(
                    "spec.model.hidden",
                    f"hidden({cfg.hidden}) is not divisible by heads({cfg.heads})",
                )
            )
        elif cfg.head_dim % 2:
            faults.append(
                Fault(
                    "spec.model.hidden",
                    f"head size hidden/heads = {cfg.head_dim} must be even (rotary positions)",
                )
            )
        faults += self._kv_faults()
        for name, unit in (
            ("heads", "attention heads"),
            ("ffn", "MLP columns"),
            ("hidden", "hidden units"),
        ):
            value = getattr(cfg, name)
            if value % tp:
                faults.append(
                    Fault(
                        where,
                        f"{name}({value}) is not divisible by tp({tp}); {unit} are split into "
                        "tp shards",
                    )
                )
        faults += self._degree_faults()
        faults += data_faults(spec.training, cfg.vocab)
        return faults

    def _kv_faults(self) -> list[Fault]:
        """Grouped-query attention: kv heads split into tp shards, or (fewer than tp) each
        replicated over tp/kv shards, Megatron-style; either way the groups must tile."""
        cfg, tp = self.model, self.tp
        kv, where = cfg.kv_heads, "spec.model.kvHeads"
        if cfg.heads % kv:
            return [Fault(where, f"kvHeads({kv}) does not divide heads({cfg.heads})")]
        if kv % tp and tp % kv:
            return [
                Fault(
                    where,
                    f"kvHeads({kv}) and tp({tp}): one must divide the other (kv heads are "
                    "split into tp shards, or each replicated over tp/kvHeads shards)",
                )
            ]
        return []

    def _degree_faults(self) -> list[Fault]:
        spec, tp, gpus = self.spec, self.tp, self.world
        dp, pp = spec.parallelism.dp, spec.parallelism.pp
        faults: list[Fault] = []
        if pp is not None and pp > self.model.layers:
            faults.append(
                Fault(
                    "spec.parallelism.pp",
                    f"pp({pp}) exceeds the model's layers({self.model.layers}); "
                    "every stage needs a layer",
                )
            )
        if dp is not None and pp is not None and dp * pp * tp != gpus:
            faults.append(
                Fault(
                    "spec.parallelism",
                    f"dp({dp}) * pp({pp}) * tp({tp}) = {dp * pp * tp} does not match the GPU count "
                    f"nodes({spec.nodes}) * gpusPerNode({spec.gpus_per_node}) = {gpus}",
                )
            )
        elif dp is not None and dp * tp > gpus:
            faults.append(
                Fault(
                    "spec.parallelism.dp",
                    f"dp({dp}) * tp({tp}) = {dp * tp} exceeds the GPU count {gpus}",
                )
            )
        if dp is not None and dp > self.micro_batches:
            faults.append(
                Fault(
                    "spec.parallelism.dp",
                    f"dp({dp}) exceeds the micro-batches per step ({self.micro_batches}); "
                    "every pipeline needs one",
                )
            )
        return faults

    def check(self) -> ResolvedJob:
        """Self, or `BadInput` listing every semantic fault."""
        faults = self.faults()
        if faults:
            raise BadInput(faults, self.source)
        return self

    def file_faults(self) -> list[Fault]:
        """Faults of every file and folder the job names: the model's folder
        (`malleus.job.hf.folder_faults`) and the data (`malleus.job.data`). Judged where the
        files are (`malleus check` / `run` / `train`, each trainer at its start), never by the
        operator, which cannot see the trainers' volumes."""
        path = self.spec.model.path
        faults = folder_faults(path) if path is not None else []
        return faults + data_file_faults(self.spec.training, self.model.vocab, self.model.sequence)

    def check_files(self) -> ResolvedJob:
        """Self, or `BadInput` listing every fault of the job's files."""
        faults = self.file_faults()
        if faults:
            raise BadInput(faults, self.source)
        return self

    # -- planning -------------------------------------------------------------------------------

    @cached_property
    def memory(self) -> MemorySpec:
        """The per-logical-shard memory model the planner and the trainer both check plans with."""
        return memory_model(
            self.model,
            tp=self.tp,
            micro_batch_size=self.micro_batch_size,
            capacity_mib=self.spec.resources.gpu_memory_mib,
        )

    def problem(
        self,
        rates: Mapping[int, float | None] | None = None,
        previous_plan: Plan | None = None,
        calibration: Calibration | Mapping[str, Any] | None = None,
        link_rates: Mapping[int, float] | None = None,
    ) -> PlanningProblem:
        """The PlanningProblem of the job under ``rates`` (default: every GPU healthy), with the
        plan in force as ``previous_plan``. Rates are cleaned first (`clean_rates`).

        ``calibration``: the cost model's terms as the trainers measured them (absent: layer
        compute only); ``link_rates``: per node, its links' slowdown as measured."""
        if isinstance(calibration, Calibration):
            calibration = calibration.model_dump()
        return PlanningProblem.load(  # `load`: faults (every GPU failed, say) as BadInput
            {
                "calibration": calibration,
                "link_rates": _clean_links(link_rates or {}, self.nodes),
                "nodes": self.nodes,
                "gpus_per_node": self.gpus_per_node,
                "rates": clean_rates(rates or {}, self.world),
                "model": ModelSpec(layers=self.model.layers, tp=self.tp),
                "micro_batches": self.micro_batches,
                "memory": self.memory,
                "dp": self.spec.parallelism.dp,
                "previous_plan": previous_plan,
            }
        )

    def initial_plan(
        self, *, planner: Planner | None = None, time_limit: float | None = None
    ) -> Plan:
        """The plan for healthy GPUs, generation `INITIAL_GENERATION`.

        `BadInput` for semantic faults and when no layout fits (the model does not fit in memory
        at all, say). `time_limit` defaults to the policy's planning budget.
        """
        self.check()
        if planner is None:
            from malleus.planner.search import plan as planner
        problem = self.problem()
        budget = (
            time_limit if time_limit is not None else float(self.policy.planning_timeout_seconds)
        )
        try:
            plan = planner(problem, time_limit=budget)
        except BadInput as error:
            # The planner speaks of its problem's fields; say which job field to change.
            where = {"memory": "spec.resources.gpuMemoryMiB"}
            raise BadInput(
                [
                    Fault(
                        where.get(f.path, f.path),
                        f"no parallel layout of this job fits its GPUs: {f.message}",
                    )
                    for f in error.faults
                ],
                self.source,
            ) from None
        violations = validate_plan(problem, plan)
        if violations:
            raise BadInput(
                [Fault("", f"the planner's layout is invalid: {v}") for v in violations],
                self.source,
            )
        return plan.model_copy(update={"generation": INITIAL_GENERATION})


def _clean_links(links: Mapping[int, float], nodes: int) -> dict[int, float]:
    """Measured link rates as the planner takes them: nodes of the job only, finite figures,
    1.0 to `MAX_RATE` (a NaN or a figure below 1.0 is no slowdown)."""
    out: dict[int, float] = {}
    for node, rate in links.items():
        n, v = int(node), float(rate)
        if 0 <= n < nodes and v == v:
            out[n] = min(MAX_RATE, max(1.0, v))
    return out

"""The "Trainer" section of docs/benchmarks.md: the table and notes bench/trainer.py writes."""

from __future__ import annotations

import argparse
import datetime as dt
from typing import TYPE_CHECKING

from benchdoc import machine

if TYPE_CHECKING:
    from malleus.planner import Plan
    from trainer import Job, Row  # bench/trainer.py, run as a script

TARGET = 0.15
"""|measured / predicted - 1| allowed for every plan."""

NOTES = [
    "Sensitivity (earlier runs on this machine, same day): the gap grows with the load and "
    "with the TP group size, and shrinks with longer emulated layers. At 40/80 ms per "
    "layer-shard, 8 GPUs at a load of 7-17 missed by 9-13%; 16 GPUs as 2 nodes x 8 at tp 4 "
    "(a 4-GPU all-reduce is 6 sequential gloo steps) at a load of 17 (max 24) missed by "
    "23-25%, its planner's pipelines running 1.4-1.6x their model time. At 50/100 ms, 16 GPUs "
    "(4x4, tp 2) with 2 layers met the target at a mean load of 6.9 (worst -13.6%) but missed "
    "it at 8.5 (max 16, with another benchmark running: -17.9% and -15.8%; pipelines alone "
    "within -14.2%), its 0.1-0.2 s per step outside the pipelines weighing on 1.5 s planner "
    "steps. Hence 50/100 ms, tp 2, and 4 layers at 16 GPUs here. On GPUs the effect is the same in kind but small: TP communication over "
    "NVLink is a small fraction of a layer's time.",
]


def describe(p: Plan) -> str:
    """A plan in one line: per pipeline `m: ranks[layers] > ...`; excluded ranks."""
    parts = []
    for pipe in p.pipelines:
        stages = " > ".join(
            f"{','.join(map(str, st.ranks))}[{st.layers[0]}:{st.layers[1]}]" for st in pipe.stages
        )
        parts.append(f"{pipe.micro_batches}: {stages}")
    text = "; ".join(parts)
    return text + (f"; excluded {','.join(map(str, p.excluded))}" if p.excluded else "")


def render(
    rows: list[Row],
    jobs: dict[tuple[int, str], Job],
    command: str,
    load: str,
    args: argparse.Namespace,
    wall_s: float,
) -> str:
    m = next(iter(jobs.values())).resolved.model
    unit_ms = args.forward_ms + args.backward_ms
    met = [r for r in rows if r.ok]
    met_pipe = [r for r in rows if abs(r.pipeline_error) <= TARGET]
    lines = [
        "## Trainer",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine()}; load average during the run (1-minute, sampled every 5 s): "
        f"{load} — the CPUs are shared with other work  ",
        f"Date: {dt.date.today().isoformat()}; {wall_s:.0f} s in all",
        "",
        "Does the trainer, executing a plan, run at the speed the cost model (DESIGN §4.3) "
        "gives that plan? Emulated GPU clock (DESIGN §4.4): every layer-shard forward is "
        f"charged {args.forward_ms:g} ms and every backward {args.backward_ms:g} ms, times the "
        "rank's injected slowdown; the real math of a tiny model (hidden "
        f"{m.hidden}, {m.heads} heads, ffn {m.ffn}, sequence {m.sequence}, micro-batch 1; "
        "layers and micro-batches per step as in the GPUs column) runs inside that budget. Per scale one spawned gloo job, one process "
        "per emulated GPU; per straggler situation the uniform plan and the planner's plan "
        "(planned for the injected rates) are two Trainers in that job whose steps alternate, "
        f"so both see the same load: {args.warmup} warm-up step(s), then {args.steps} measured "
        "steps each, medians. Stragglers come from the job's emulation schedule.",
        "",
        "- *predicted*: uniform T / planner T of the cost model; in parentheses after each "
        f"step time, the plan's cost-model time, T x {unit_ms:g} ms.",
        "- *measured*: uniform / planner median step time; *error* = measured / predicted - 1, "
        f"target within {TARGET:.0%}.",
        "- *pipelines*: the same on the slowest rank's 1F1B schedule alone (`pipeline.run`), "
        "leaving out the step's gradient sync, world all-reduces and optimizer, which the "
        'cost model does not count ("DP sync not counted in v1").',
        "- *rates*: the stragglers' straggling rates as the trainer measured them under the "
        "uniform plan (injected: the situation's factors).",
        "",
        "| GPUs | stragglers | uniform s (model) | planner s (model) | predicted | measured "
        "| error | pipelines | error | rates |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        rates = ", ".join(f"r{k} {v:.2f}" for k, v in sorted(r.measured_rates.items()))
        lines.append(
            f"| {r.scale.label} | {r.situation} | {r.measured['uniform']:.3f} "
            f"({r.model['uniform'] * r.unit_s:.3f}) | {r.measured['planner']:.3f} "
            f"({r.model['planner'] * r.unit_s:.3f}) | {r.predicted:.2f} | {r.speedup:.2f} "
            f"| {r.error:+.1%} | {r.pipeline_speedup:.2f} | {r.pipeline_error:+.1%} | {rates} |"
        )
    lines += [
        "",
        f"Within {TARGET:.0%} of the prediction: step times {len(met)} of {len(rows)}"
        + (
            ""
            if len(met) == len(rows)
            else f" (misses: {'; '.join(miss_reason(r) for r in rows if not r.ok)})"
        )
        + f"; pipelines alone {len(met_pipe)} of {len(rows)}.",
        "",
        "Where the gap comes from: the cost model counts layer compute only. Each layer call "
        "also pays its TP all-reduces (two forward, two backward; gloo between processes on "
        "two shared, loaded cores takes milliseconds for each, where NVLink takes "
        "microseconds), each micro-batch its embedding, head, loss and pipeline transfers, "
        "and each step its gradient sync, two world all-reduces and the optimizer. None of "
        "that grows with a rank's slowdown, so it weighs more on the planner's plan, whose "
        "critical path is shorter and runs more layer calls at healthy speed, than on the "
        "uniform plan's, which waits on a straggler; the measured speedup falls short of the "
        "predicted one by about the difference. Per plan: the slowest pipeline's measured "
        "time over its cost-model time, and the seconds of a step spent outside the pipelines; "
        "the emulated clock's accuracy (layer calls whose real math overran the budget, over "
        "both plans and all ranks; mean wake-up lateness per layer call):",
        "",
        "| GPUs | stragglers | pipelines / model, uniform | planner | outside pipelines s, "
        "uniform | planner | overruns | lateness ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r.scale.world} | {r.situation} | {r.fidelity('uniform'):.2f} | "
            f"{r.fidelity('planner'):.2f} | {r.fixed_s('uniform'):.2f} | "
            f"{r.fixed_s('planner'):.2f} | {r.overruns} | {r.late_ms:.2f} |"
            for r in rows
        ),
        "",
        *NOTES,
        "",
        "Plans (`micro-batches: ranks[layers] > ...; excluded`):",
        "",
    ]
    for r in rows:
        job = jobs[(r.scale.world, r.situation)]
        lines.append(
            f"- {r.scale.world} GPUs, {r.situation}: planner `{describe(job.plans['planner'])}`"
            f"; uniform `{describe(job.plans['uniform'])}`"
        )
    return "\n".join(lines) + "\n"


def miss_reason(r: Row) -> str:
    return f"{r.scale.world} GPUs / {r.situation} ({r.error:+.1%})"

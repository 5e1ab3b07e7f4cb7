"""Planner against every other way to plan the problems the project holds (issue 27).

Run: .venv/bin/python bench/planner_held.py [--long 6] [--no-write] [--json out.json]
                                             [--before rows.json --before-label COMMIT]

For each held problem (`examples/problems/*.json`; the "Planner" table's 8- and 64-GPU
situations; a uniformly slow node beside healthy ones at 16 and 64 GPUs, with and without the
70B memory model; `random_problem(seed)` for the seeds in `RANDOM_SEEDS`), the planner's plan under its default budget (ours) is held against: the
uniform plan (what a user runs without a planner), hand-built plans (every TP group a one-stage
pipeline, healthy nodes in groups of one size and straggler nodes in groups of another, every
size pair tried, micro-batches dealt to whichever pipeline ends first; where memory lets one
group hold the model) and the same search with a long budget. All are scored by the same cost
model (`plan_step_time`). Ratio = ours / the best of the others (<= 1.01 is the target); the
reference column is the authors' yardstick (docs/architecture.md, "Cost model": recovery =
reference / T). Exhaustive optima of tiny problems are held in tests/planner/test_optimality.py
and test_calibration.py (within 1%).

`--before` adds the rows of a run at an earlier commit (`--json` of this script run with that
commit's `malleus` first on PYTHONPATH): its step times and CPU seconds beside today's.

Writes the "Planner: held problems" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchdoc import machine, replace_section  # bench/ is on sys.path when run as a script
from planner import EXAMPLES, base_problem, situations

from malleus.planner import (
    Pipeline,
    Plan,
    PlanningProblem,
    Stage,
    plan,
    plan_step_time,
    reference_step_time,
    uniform_plan,
    validate_plan,
)
from malleus.planner.search import Deadline
from malleus.planner.search.deadline import cpu_clock

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
TARGET = 1.01
ALPHA = [1.0, 1.9, 3.66, 7.22]


def slow_node(world: int, rate: float, micro_batches: int, memory: bool) -> dict[str, Any]:
    """Nodes of 8, the 70B model, node 1 uniformly at `rate`."""
    data = base_problem(max(world, 64))
    data.update(nodes=world // 8, micro_batches=micro_batches)
    data["rates"] = {str(r): rate for r in range(8, 16)}
    if not memory:
        del data["memory"]
    return data


def random_problem(seed: int) -> dict[str, Any]:
    """A random problem in the shape of the held ones (24-128 GPUs in nodes of 8, the 70B
    model, its memory model or none, micro-batches a multiple of the GPUs or half of them,
    1-3 straggler nodes each with 1, 2, 3, 4 or 8 GPUs slow at one rate in 1.1-8.4x), drawn
    from `seed` alone (`random.Random` is reproducible across Python versions)."""
    rng = random.Random(seed)
    world = rng.choice([24, 32, 48, 64, 96, 128])
    data = base_problem(64)
    data.update(nodes=world // 8)
    data["micro_batches"] = rng.choice(
        [world, 2 * world, world // 2, 4 * world + rng.randrange(16)]
    )
    if rng.random() < 0.5:
        del data["memory"]
    rates: dict[str, float] = {}
    for n in rng.sample(range(world // 8), rng.randint(1, min(3, world // 8))):
        k = rng.choice([1, 2, 3, 4, 8])
        rate = round(rng.choice([1.2, 1.5, 1.57, 2.0, 3.0, 4.0, 8.0]) * rng.uniform(0.95, 1.05), 2)
        for g in rng.sample(range(8), k):
            rates[str(n * 8 + g)] = rate
    data["rates"] = rates
    return data


# Seeds of `random_problem` (of 0-59, 100-174) where the default search ended more than 1%
# above the same search given 4 CPU seconds at 142d19e (issue 27: the budget cut the templates
# of small clusters, each scored at its exact per-m times, before they reached the winner)
RANDOM_SEEDS = (12, 122, 127, 131, 167, 168)


def described(data: dict[str, Any]) -> str:
    """`random 12: 64 GPUs, 4 at 1.59x, 32 mb` (and `, 70B memory` where it has one)."""
    by: dict[float, int] = {}
    for v in data["rates"].values():
        by[v] = by.get(v, 0) + 1
    slow = ", ".join(f"{n} at {v:g}x" for v, n in sorted(by.items()))
    mem = ", 70B memory" if "memory" in data else ""
    return f"{data['nodes'] * 8} GPUs, {slow}, {data['micro_batches']} mb{mem}"


def held() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(EXAMPLES.glob("*.json")):
        out.append((f"examples/{path.name}", PlanningProblem.load(path.read_text()).model_dump()))
    for world in (8, 64):
        base = base_problem(world)
        for name, rates in situations(world, base["gpus_per_node"]).items():
            out.append((f"{world} GPUs, {name}", {**base, "rates": rates}))
    for rate, m in ((1.57, 16), (2.0, 16), (2.0, 24), (3.0, 16), (3.0, 8)):
        out.append((f"16 GPUs, node at {rate}x, {m} mb", slow_node(16, rate, m, False)))
    out.append(("64 GPUs, node at 2x, 272 mb", slow_node(64, 2.0, 272, False)))
    out.append(("64 GPUs, node at 1.57x, 276 mb", slow_node(64, 1.57, 276, False)))
    for rate in (1.57, 2.0, 3.0):
        out.append((f"64 GPUs, node at {rate}x, 70B memory", slow_node(64, rate, 64, True)))
    for seed in RANDOM_SEEDS:
        data = random_problem(seed)
        out.append((f"random {seed}: {described(data)}", data))
    return out


def hand_built(p: PlanningProblem) -> float:
    """Best one-stage-per-group plan over (healthy node size, straggler node size) pairs."""
    if p.dp is not None or any(v is None for v in p.rates.values()):
        return float("inf")
    gpn, tp = p.gpus_per_node, p.tp
    slow = {p.node_of(r) for r, v in p.rates.items() if v != 1.0}
    sizes = [tp >> k for k in range(tp.bit_length())]
    best = float("inf")
    for a, b in itertools.product(sizes, repeat=2):
        groups = [
            list(range(n * gpn + i, n * gpn + i + s))
            for n in range(p.nodes)
            for s in [b if n in slow else a]
            for i in range(0, gpn - s + 1, s)
        ]
        one = [
            Pipeline(micro_batches=1, stages=[Stage(ranks=g, layers=(0, p.layers))]) for g in groups
        ]
        per = [plan_step_time(p, Plan(tp=tp, pipelines=[x])) for x in one]
        m = [0] * len(groups)
        for _ in range(p.micro_batches):
            i = min(range(len(groups)), key=lambda j: ((m[j] + 1) * per[j], j))
            m[i] += 1
        used = [x.model_copy(update={"micro_batches": n}) for x, n in zip(one, m, strict=True) if n]
        idle = sorted(r for g, n in zip(groups, m, strict=True) if not n for r in g)
        hand = Plan(tp=tp, pipelines=used, excluded=idle)
        if not validate_plan(p, hand):
            best = min(best, plan_step_time(p, hand))
    return best


@dataclass
class Row:
    name: str
    world: int
    ours: float
    cpu: float
    uniform: float | None
    hand: float | None
    long: float
    reference: float

    @property
    def best_other(self) -> float:
        return min(x for x in (self.uniform, self.hand, self.long) if x is not None)

    @property
    def ratio(self) -> float:
        return self.ours / self.best_other


def run(name: str, data: dict[str, Any], long_s: float) -> Row:
    p = PlanningProblem.load(data)
    c0 = time.thread_time()
    ours = plan(p)
    cpu = time.thread_time() - c0
    assert validate_plan(p, ours) == [], name
    long = plan(p, deadline=Deadline(long_s, clock=cpu_clock))
    uni = uniform_plan(p)
    t_uni = None if uni is None or validate_plan(p, uni) else plan_step_time(p, uni)
    hand = hand_built(p)
    return Row(
        name,
        p.world,
        plan_step_time(p, ours),
        cpu,
        t_uni,
        hand if hand < float("inf") else None,
        plan_step_time(p, long),
        reference_step_time(p),
    )


def fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def render(
    rows: list[Row],
    command: str,
    long_s: float,
    load: tuple[float, float],
    before: dict[str, Row] | None = None,
    label: str = "",
) -> str:
    worst = max(rows, key=lambda r: r.ratio)
    then = before or {}
    lines = [
        "## Planner: held problems",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine()}; load average {load[0]:.1f} at the start, {load[1]:.1f} at "
        "the end  ",
        f"Date: {dt.date.today().isoformat()}",
        "",
        "Step times (cost-model units) of every problem the project holds, planned by the "
        "default search (ours, its CPU seconds beside it) and by every other method at hand: "
        "the uniform plan (a user's static layout), the best hand-built plan (every TP group a "
        "one-stage pipeline, healthy and straggler nodes each in groups of one size, every "
        f"size pair; — where memory needs deeper pipelines) and the same search given {long_s:g} "
        "s. Ratio = ours / the best other (target <= 1.01); recovery = reference / ours, "
        "the authors' yardstick. Exhaustive optima of tiny problems are in the tests "
        "(tests/planner/test_optimality.py, test_calibration.py: within 1%). The `random N` "
        "rows are `random_problem(N)` (this script: 24-128 GPUs in nodes of 8, 1-3 straggler "
        "nodes with 1-8 GPUs slow at 1.1-8.4x, the 70B model with or without its memory "
        "model), the seeds of 135 drawn where the default search at 142d19e ended more than "
        "1% above the same search given 4 s. Since 1ae3fbc (issue 27) clusters of up to 16 "
        "nodes split healthy nodes alike beside the straggler nodes' options and up to 64 "
        "GPUs rank groupings by their one-stage-per-group layout; since 142d19e templates and "
        "partitions are scored on any-m lines and refined the likeliest first by their "
        "pipelines' floors, and the climbs skip neighbours whose floor bound is slower (the "
        "Planner and Planner spread sections hold the larger scales). `random 167` is the "
        "fragile one: its 415.4 is reached by the last hill climb, from a partition layout, "
        "near the end of the budget: on 2026-12-04 this run and one of it alone reached it, "
        "one beside another planning job ended at 424.7 (ratio 1.0225).",
        "",
        "| problem | GPUs | ours | CPU s | uniform | hand-built | long | ratio | recovery |"
        + (" before | CPU s before |" if then else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if then else ""),
    ]
    for r in rows:
        b = then.get(r.name)
        extra = "" if not then else " — | — |" if b is None else f" {b.ours:.1f} | {b.cpu:.2f} |"
        lines.append(
            f"| {r.name} | {r.world} | {r.ours:.1f} | {r.cpu:.2f} | {fmt(r.uniform)} | "
            f"{fmt(r.hand)} | {r.long:.1f} | {r.ratio:.4f} | {r.reference / r.ours:.3f} |{extra}"
        )
    met = "met" if worst.ratio <= TARGET else "NOT met"
    lines += [
        "",
        f"Worst ratio {worst.ratio:.4f} ({worst.name}; target {TARGET}: {met}); ours is the "
        f"best of all on {sum(r.ratio <= 1 + 1e-9 for r in rows)} of {len(rows)}.",
    ]
    pairs = [(r, then[r.name]) for r in rows if r.name in then]
    if pairs:
        # the same comparison for the earlier commit's plans (its long search was its own)
        old = max(b.ours / min(r.best_other, b.best_other) for r, b in pairs)
        cpu = sorted(r.cpu / max(b.cpu, 1e-3) for r, b in pairs)
        lines.append(
            f"Before ({label}): worst ratio {old:.4f} against the best of both runs; CPU "
            f"seconds now / before, per problem: median {cpu[len(cpu) // 2]:.2f}, max "
            f"{cpu[-1]:.2f}; largest CPU {max(r.cpu for r, _ in pairs):.2f} s now, "
            f"{max(b.cpu for _, b in pairs):.2f} s before (the budget up to 64 GPUs is 0.6 s)."
            + (
                " At 1ae3fbc (issue 27's start) the worst ratio was 1.3151."
                if label != "1ae3fbc"
                else ""
            )
        )
    lines += [*speed_lines(), ""]
    return "\n".join(lines)


SPEED = Path(__file__).resolve().parent / "planner_speed_1ae3fbc.json"


def speed_lines() -> list[str]:
    """The Planner and Planner spread tables' CPU seconds at 1ae3fbc and after issue 27's
    change, measured in one session on one machine (`SPEED`, written from the two runs)."""
    if not SPEED.exists():
        return []
    d = json.loads(SPEED.read_text())
    out = ["", f"Planning speed before ({d['before']}) and after, {d['date']}, same session:"]
    for key, title in (("planner", "Planner table"), ("spread", "Planner spread table")):
        rows = d[key]
        ratio = sorted(new / max(old, 1e-2) for old, new in rows.values())
        worst = max(rows, key=lambda k: rows[k][1] / max(rows[k][0], 1e-2))
        most = max(rows, key=lambda k: rows[k][1])
        out.append(
            f"- {title} ({len(rows)} rows, CPU s): after / before median "
            f"{ratio[len(ratio) // 2]:.2f}, max {ratio[-1]:.2f} ({worst}: "
            f"{rows[worst][0]:.2f} -> {rows[worst][1]:.2f}); largest {rows[most][1]:.2f} s "
            f"({most}; {rows[most][0]:.2f} s before)."
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=float, default=6.0, help="long search CPU s")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument("--json", default="", help="also save the rows (JSON)")
    ap.add_argument("--before", default="", help="rows of an earlier commit's run (JSON)")
    ap.add_argument("--before-label", default="an earlier commit", help="what --before is")
    args = ap.parse_args(argv)
    before = None
    if args.before:
        before = {d["name"]: Row(**d) for d in json.loads(Path(args.before).read_text())}
    load_start = os.getloadavg()[0]
    rows = []
    for name, data in held():
        row = run(name, data, args.long)
        rows.append(row)
        print(
            f"{name:<40} ours {row.ours:9.2f} ({row.cpu:.2f} s) uniform {fmt(row.uniform):>8} "
            f"hand {fmt(row.hand):>8} long {row.long:9.2f} ratio {row.ratio:.4f}",
            file=sys.stderr,
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    command = "python bench/planner_held.py" + (f" --long {args.long:g}" if args.long != 6 else "")
    if args.before:
        command += f" --before {args.before} --before-label {args.before_label}"
    load = (load_start, os.getloadavg()[0])
    section = render(rows, command, args.long, load, before, args.before_label)
    print("\n".join(section.rstrip().splitlines()[-3:]))
    if not args.no_write:
        replace_section("Planner: held problems", section, DOC)
        print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

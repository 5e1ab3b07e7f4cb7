"""No job's planning can hold up another's: 20 jobs' controllers in one event loop, one hostile.

The harness drives the jobs as the operator does (operator/daemon.py): one `Controller` per job,
every one a task of one asyncio loop, each job's policy taken through `jobs.limited` (the
operator's planning limits) and its planner from the shared planner processes
(`Context.planner`). The trainers are `SimulatedJob`s read at wall-clock ticks (a scrape every
`SCRAPE` seconds, each tick an absolute deadline, so a late loop never shifts the schedule).

The hostile job has the largest world the limits allow, ``planningTimeoutSeconds: 3600``
(clamped to the limit) and ``cooldownSeconds: 0`` (allowed here: ``minCooldownSeconds: 0``),
and new rates at every scrape, so it re-plans back to back, each plan using its whole budget.
The 19 others each get one straggler, one job after another (`SPACING` apart); each must
publish its re-plan within its own planning time plus `MARGIN`. Its own planning time is what
planning its problem costs on this machine at that moment, in a process of its own: the slowest
of that problem planned alone before the storm and of a probe process's plans of it around the
onset (`_Probe`; the machine these tests run on is shared, and its load moves a 0.07 s plan to
over a second).

``MALLEUS_TEST_PLANNER_THREADS=1`` runs the same test with the planner in threads of the test's
process (the operator before the planner processes). Measured on the shared 2-core machine:
re-plans land 0.1-0.7 s after the onset with processes in quiet stretches, 0.2-1.9 s with
threads (1-9 s, some never, when the machine is busier); with the bound measured by the probe
the latencies of a threads run fail in some runs only, by tenths of a second: the GIL's switch
interval gives the event loop its turns, so a planning thread slows the others about twofold,
not without bound. What fails a threads run every time is where the CPU went during the storm
(`_CpuMeter`): with processes 0.7 CPU seconds in the operator's process against 6.0 in the
planner processes (2026-12-03, beside four other jobs' test runs); with threads 8.2 against
none. What only processes give besides (killing an overrunning plan) is tested in
test_planning_limits.py. Each run prints every job's latency and bound, and the CPU split.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import time
from collections.abc import Mapping
from typing import Any

from malleus.controller import SimulatedJob
from malleus.controller.events import DecisionEvent, Planned
from malleus.controller.loop import Controller
from malleus.controller.planning import Planner, default_planner
from malleus.controller.processes import PlannerProcesses
from malleus.controller.simulate import ManualClock
from malleus.job import ResolvedJob
from malleus.job.limits import PlanningLimits
from malleus.operator import jobs
from malleus.operator.settings import Settings
from malleus.planner.plan import Plan
from malleus.planner.problem import PlanningProblem
from tests.operator.planners import probe

SCRAPE = 0.2
"""Seconds between two observations of a job."""
SPACING = 0.7
"""Seconds between two jobs' straggler onsets."""
FIRST_ONSET = 2.0
"""Seconds after the start of the first onset (the hostile job is planning by then)."""
PROBE_WINDOW = 0.5
"""A job's own planning time is the slowest of its problem's plans alone (before the storm) and
of the probe's plans that ran between this many seconds before its straggler's onset and its
re-plan's publication."""
MARGIN = 2.0
"""What a re-plan may take beyond its own planning time: one scrape (the observation with the
straggler is read at its tick), a process's turn (the pool has the operator's default number
of processes: the hostile job holds at most one, and the jobs' onsets are `SPACING` apart), the
JSON both ways (~10 ms at 4 GPUs), and the event loop's share of CPUs that the hostile planner
and the rest of the machine share (the suite runs on a loaded 2-core box)."""
LIMITS = PlanningLimits(max_gpus=256, max_planning_seconds=3, min_cooldown_seconds=0)
"""Small enough for a test: the hostile job's plans take 3 s of a 256-GPU search each."""
SMALL = 19
EVENTS: dict[str, Any] = {}


def _body(name: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "image": "malleus:test",
        "nodes": 2,
        "gpusPerNode": 2,
        "model": {"preset": "tiny"},
        "training": {
            "globalBatchSize": 16,
            "microBatchSize": 2,
            "steps": 100_000,
            "learningRate": 0.001,
        },
        "parallelism": {"tp": 2},
        "stragglerPolicy": {"windowSteps": 1},
    }
    base.update(spec)
    return {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": base,
    }


def _hostile_rates(world: int) -> Any:
    def rates_at(step: int) -> Mapping[int, float]:
        rng = random.Random(step)  # new stragglers every scrape, reproducibly
        return {r: rng.choice((2.0, 4.0, 8.0)) for r in rng.sample(range(world), 6)}

    return rates_at


def _one_straggler(onset: int, rank: int) -> Any:
    def rates_at(step: int) -> Mapping[int, float]:
        return {rank: 3.0} if step >= onset else {}

    return rates_at


class _Paced:
    """A `SimulatedJob` read at wall-clock ticks, each read costing the round trips the
    operator makes per observation (on a loopback socket); remembers when each plan was
    published."""

    def __init__(self, sim: SimulatedJob, start: float) -> None:
        self.sim = sim
        self.start = start
        self.published: list[float] = []
        self.stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    def due(self, step: int) -> float:
        return self.start + step * SCRAPE

    async def read(self) -> Any:
        await asyncio.sleep(max(0.0, self.due(self.sim.step) - time.monotonic()))
        if self.stream is not None:  # the scrape, the coordinator's /status, a status patch
            reader, writer = self.stream
            for ask in (b"GET /metrics\n", b"GET /status\n", b"PATCH status\n"):
                writer.write(ask)
                await writer.drain()
                await reader.readline()
        return await self.sim.read()

    async def publish(self, plan: Plan) -> int:
        self.published.append(time.monotonic())
        return await self.sim.publish(plan)

    async def wait_applied(self, generation: int, timeout: float) -> Any:
        return await self.sim.wait_applied(generation, timeout)

    async def recorded_plan(self, generation: int) -> Plan | None:
        return await self.sim.recorded_plan(generation)


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The trainers' metrics endpoint: one line back per line asked."""
    while await reader.readline():
        writer.write(b"malleus_step 1\n")
        await writer.drain()
    writer.close()


def _controller(
    job: ResolvedJob, rates_at: Any, start: float, planner: Planner, plan: Plan | None = None
) -> tuple[Controller, _Paced, list[DecisionEvent]]:
    job, _ = jobs.limited(job, LIMITS)  # as operator/daemon.py takes the policy
    plan = plan or job.initial_plan(planner=default_planner, time_limit=1.0)
    sim = SimulatedJob(job.problem, plan, rates_at, clock=ManualClock(), steps=10**9)
    paced = _Paced(sim, start)
    events: list[DecisionEvent] = []
    controller = Controller(
        paced,
        paced,
        initial_plan=plan,
        problem_builder=job.problem,
        policy=job.policy,
        planner=planner,
        clock=time.monotonic,
        on_event=events.append,
    )
    return controller, paced, events


class _Probe:
    """A process of its own planning a small job's problem again and again during the storm
    (`tests.operator.planners.probe`): what that planning costs on this machine at each
    moment, whatever else the machine runs. Problem in, samples out, as JSON."""

    def __init__(self, problem: PlanningProblem, *, until: float) -> None:
        mp = multiprocessing.get_context("spawn")
        self.conn, child = mp.Pipe()
        self.process = mp.Process(
            target=probe, args=(child, problem.model_dump_json(), until, 0.5), daemon=True
        )
        self.process.start()
        child.close()
        self.until = until

    def samples(self) -> list[tuple[float, float]]:
        try:
            if not self.conn.poll(max(0.0, self.until - time.monotonic()) + 30):
                return []
            return [(t0, wall) for t0, wall in json.loads(self.conn.recv_bytes())]
        finally:
            self.process.kill()
            self.process.join()


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (``/proc``), None once it is gone."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()  # noqa: SIM115
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class _CpuMeter:
    """Where the CPU went during the storm: this process (the operator's: its event loop and,
    with threads, its planning) against its planner processes (every child process but the
    probe, sampled while the storm runs: a killed process keeps its last sample)."""

    def __init__(self, exclude: int) -> None:
        self.exclude = exclude
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.own = -time.process_time()
        self.sample()
        self.first = dict(self.last)

    def sample(self) -> None:
        for child in multiprocessing.active_children():
            if child.pid is not None and child.pid != self.exclude:
                cpu = _cpu_seconds(child.pid)
                if cpu is not None:
                    self.last[child.pid] = cpu

    def stop(self) -> tuple[float, float]:
        """(this process's CPU seconds, the planner processes') since the meter started."""
        self.sample()
        planners = sum(cpu - self.first.get(pid, 0.0) for pid, cpu in self.last.items())
        return self.own + time.process_time(), planners


def _own_seconds(job: ResolvedJob, rank: int, plan: Plan) -> float:
    """Wall seconds of this job's re-plan alone (nothing else planning), in this process."""
    problem = job.problem({rank: 3.0}, plan)
    t0 = time.perf_counter()
    default_planner(problem, time_limit=float(job.policy.planning_timeout_seconds))
    return time.perf_counter() - t0


async def _storm(
    threads: bool,
) -> tuple[list[tuple[str, float, float]], int, tuple[float, float]]:
    """(job, re-plan latency, bound) for each small job, the hostile job's plans, and the CPU
    seconds of the storm in this process and in the planner processes (`_CpuMeter`)."""
    pool = None if threads else PlannerProcesses(Settings().planner_processes).start()
    try:
        if pool is not None:  # both processes have imported the planner before the clock runs
            warm = jobs.resolve(_body("warm")).problem()
            await asyncio.gather(
                *(asyncio.to_thread(pool.plan, warm, time_limit=30.0) for _ in range(pool.size))
            )

        def planner(name: str) -> Planner:
            return default_planner if pool is None else pool.for_job(f"ml/{name}")

        hostile = jobs.resolve(
            _body(
                "hostile",
                nodes=32,
                gpusPerNode=8,  # 256 GPUs: LIMITS.max_gpus
                training={
                    "globalBatchSize": 512,
                    "microBatchSize": 2,
                    "steps": 100_000,
                    "learningRate": 0.001,
                },
                stragglerPolicy={
                    "windowSteps": 1,
                    "cooldownSeconds": 0,
                    "planningTimeoutSeconds": 3600,
                },
            )
        )
        assert jobs.limited(hostile, LIMITS)[1] == [
            "planningTimeoutSeconds 3600 -> 3 (the operator's planningLimits.maxPlanningSeconds)"
        ]
        h_ctl, h_paced, h_events = _controller(
            hostile, _hostile_rates(hostile.world), 0.0, planner("hostile")
        )
        onsets: dict[str, int] = {}
        small: list[tuple[str, Controller, _Paced, float]] = []
        first = jobs.resolve(_body("job-00"))
        plan = first.initial_plan(planner=default_planner)  # the same for every small job
        own = {rank: _own_seconds(first, rank, plan) for rank in range(first.world)}
        for i in range(SMALL):
            name, rank = f"job-{i:02d}", i % first.world
            onset = round((FIRST_ONSET + i * SPACING) / SCRAPE)
            job = jobs.resolve(_body(name))
            ctl, paced, ev = _controller(job, _one_straggler(onset, rank), 0.0, planner(name), plan)
            EVENTS[name] = ev
            onsets[name] = onset
            small.append((name, ctl, paced, own[rank]))
        server = await asyncio.start_server(_answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        start = time.monotonic() + 1.0  # every job's step 0, its scrapes at its own phase
        for j, paced in enumerate((h_paced, *(s[2] for s in small))):
            paced.stream = await asyncio.open_connection("127.0.0.1", port)
            paced.start = start + j * SCRAPE / (SMALL + 1)
        last = start + max(onsets.values()) * SCRAPE
        deadline = last + 3 * MARGIN + 1.0  # past every bound: what has not landed is late
        probe = _Probe(first.problem({0: 3.0}, plan), until=deadline)

        stop = asyncio.Event()
        meter = _CpuMeter(exclude=probe.process.pid or 0)
        tasks = [asyncio.ensure_future(c.run(stop)) for c in (h_ctl, *(s[1] for s in small))]
        try:
            while time.monotonic() < deadline and not all(p.published for _, _, p, _ in small):
                await asyncio.sleep(SCRAPE)
                meter.sample()
        finally:
            cpu = meter.stop()
            stop.set()
            await asyncio.gather(*tasks)
            for c in (h_ctl, *(s[1] for s in small)):
                c.close()
            for paced in (h_paced, *(s[2] for s in small)):
                if paced.stream is not None:
                    paced.stream[1].close()
            server.close()
        samples = await asyncio.to_thread(probe.samples)
        results = []
        for name, _, paced, alone in small:
            landed = paced.published[0] if paced.published else float("inf")
            onset = paced.due(onsets[name])
            end = min(landed, onset + 3 * MARGIN)  # probe plans that ran while it re-planned
            now = [w for t0, w in samples if t0 <= end and t0 + w >= onset - PROBE_WINDOW]
            results.append((name, landed - onset, max([alone, *now]) + MARGIN))
        if pool is not None:
            print(f"planner processes killed: {pool.killed}")
        return results, sum(isinstance(e.data, Planned) for e in h_events), cpu
    finally:
        if pool is not None:
            pool.close()


def test_a_hostile_job_does_not_delay_the_others_re_plans() -> None:
    threads = os.environ.get("MALLEUS_TEST_PLANNER_THREADS") == "1"
    results, hostile_plans, (own_cpu, planners_cpu) = asyncio.run(_storm(threads))
    report = "\n".join(
        f"{name}: re-plan published {latency:.3f} s after its straggler's onset "
        f"(bound {bound:.3f} s)"
        for name, latency, bound in results
    )
    print(("threads" if threads else "processes") + f", hostile plans {hostile_plans}, CPU "
          f"{own_cpu:.1f} s in the operator's process, {planners_cpu:.1f} s in planner "
          "processes\n" + report)  # fmt: skip
    for n, lat, b in results:
        if lat > b:
            print(n, [(round(e.time % 1000, 2), e.kind.value, e.message[:80]) for e in EVENTS[n]])
    assert hostile_plans >= 2, f"the hostile job planned {hostile_plans} times: not hostile"
    # The hostile job's planning burns CPU, but not in the operator's process, whose event loop
    # handles every job: most of the storm's CPU is the planner processes'. Planning in threads
    # of the operator puts all of it in the operator's process (this fails), however the
    # shared machine's load moves the latencies.
    assert own_cpu < planners_cpu, (
        f"the operator's process used {own_cpu:.1f} CPU seconds during the storm, its planner "
        f"processes {planners_cpu:.1f}: the planning ran in the operator's process"
    )
    late = [(n, lat, b) for n, lat, b in results if not lat <= b]
    worst = max(lat - b for _, lat, b in results)
    assert not late, f"{len(late)} of {SMALL} re-plans late (worst by {worst:.2f} s):\n{report}"

"""Planner processes: one bounded pool the operator's jobs share, so that no job's planning can
stall another's.

Run in a thread of the operator's process, a CPU-heavy planner holds the GIL in turns with the
event loop that handles every other job (its observations, decisions, status, kopf's handlers):
one job planning a large world back to back slows them all, and a thread cannot be stopped.
Here each plan runs in a process of the pool instead:

- the problem goes in and the plan comes out as JSON text (`PlanningProblem` and `Plan` are
  pydantic models): nothing is unpickled from a planner process, whose input is a job author's;
- processes are started with ``spawn`` (no copy of the operator's threads, sockets, state);
- at most ``size`` plans run at once; a job waits its turn first in, first served, and has at
  most one plan in flight (`JobPlanner`): a job that re-plans back to back holds one process,
  never the pool;
- a plan that overruns its time limit (plus ``kill_grace``, the controller's own grace) has its
  process killed and replaced: the job gets `PlanningTimeout`, the process's CPU is free at
  once. A replacement takes plans once it has imported the planner (its first message), so a
  cold process never spends a plan's budget.

`JobPlanner` is a `Planner` (``planner(problem, time_limit=...)``), blocking in its caller's
thread while a process works (the wait releases the GIL): `run_planner` runs it in a worker
thread as it runs any planner, so the controller and the initial plan need no other path. The
local runner (``malleus run``) keeps planning in a thread.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from malleus.errors import BadInput, Fault
from malleus.planner.plan import Plan
from malleus.planner.problem import PlanningProblem

from .planning import PlanningTimeout

__all__ = ["DEFAULT_PLANNER", "JobPlanner", "PlannerProcesses"]

log = logging.getLogger(__name__)

DEFAULT_PLANNER = "malleus.planner.search:plan"
"""``module:function`` of the planner the processes run (imported there, by name)."""


def _serve(conn: Connection, planner_ref: str) -> None:
    """A planner process: (header, problem) JSON in, ``{"plan": ...}`` or ``{"error": ...}`` out,
    until the pipe closes."""
    module, _, name = planner_ref.partition(":")
    planner = getattr(importlib.import_module(module), name)
    try:
        conn.send_bytes(_READY)
    except (EOFError, OSError):
        return
    while True:
        try:
            header = json.loads(conn.recv_bytes())
            text = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            problem = PlanningProblem.load(text)
            plan = planner(problem, time_limit=float(header["time_limit"]))
            answer: dict[str, Any] = {"plan": json.loads(plan.to_json())}
        except BadInput as e:
            answer = {"faults": [[f.path, f.message] for f in e.faults]}
        except Exception as e:  # the parent reports it as the planner's failure
            answer = {"error": f"{type(e).__name__}: {e}"}
        try:
            conn.send_bytes(json.dumps(answer).encode())
        except (EOFError, OSError):
            return


_READY = b"ready"
"""A planner process's first message: it has imported its planner (a cold process may take
seconds; no plan's budget is spent waiting for that)."""


class _Worker:
    """One planner process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, planner_ref: str) -> None:
        self.conn, child = multiprocessing.Pipe(duplex=True)
        self.process: BaseProcess = ctx.Process(
            target=_serve, args=(child, planner_ref), name="malleus-planner", daemon=True
        )
        self.process.start()
        child.close()
        self.ready = False

    def wait_ready(self, timeout: float) -> bool:
        """Whether the process has imported its planner (waiting up to ``timeout``)."""
        if not self.ready and self.conn.poll(max(0.0, timeout)):
            self.ready = self.conn.recv_bytes() == _READY
        return self.ready

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        self.conn.close()  # the process sees EOF and returns
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.kill()


class PlannerProcesses:
    """A pool of ``size`` planner processes (see the module's docstring)."""

    def __init__(
        self, size: int = 4, *, planner: str = DEFAULT_PLANNER, kill_grace: float = 1.0
    ) -> None:
        if size < 1:
            raise ValueError(f"a planner pool needs at least one process, got {size}")
        self.size = size
        self.planner = planner
        self.kill_grace = kill_grace
        self._mp = multiprocessing.get_context("spawn")
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self._idle: list[_Worker] = []
        self._busy = 0
        self._closed = False
        self.killed = 0
        """Processes killed for overrunning their plan's limit (a count, for tests and logs)."""
        self._jobs: weakref.WeakValueDictionary[str, JobPlanner] = weakref.WeakValueDictionary()

    def start(self) -> PlannerProcesses:
        """Start every process now (they import the planner while nothing waits on them)."""
        with self._cond:
            while len(self._idle) + self._busy < self.size:
                self._idle.append(_Worker(self._mp, self.planner))
        return self

    def for_job(self, key: str) -> JobPlanner:
        """The `Planner` of job ``key``: at most one plan of it in flight at a time, however
        many controllers hold it (a daemon restarted mid-plan gets the same one)."""
        with self._cond:
            planner = self._jobs.get(key)
            if planner is None:
                planner = self._jobs[key] = JobPlanner(self, key)
            return planner

    def close(self) -> None:
        """Stop the idle processes; a busy one is stopped when its plan returns."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for w in idle:
            w.stop()

    # ---- one plan --------------------------------------------------------------------------
    def plan(self, problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
        """Plan ``problem`` in a process of the pool, blocking; the whole call (the wait for a
        free process included) ends within ``time_limit + kill_grace`` seconds.

        `PlanningTimeout` past it (the overrunning process killed), `BadInput` as the planner
        raised it (no layout fits), RuntimeError for any other failure of the planner.
        """
        limit = 60.0 if time_limit is None else float(time_limit)
        deadline = time.monotonic() + limit + self.kill_grace
        worker = self._acquire(deadline)
        healthy = True  # killed and replaced unless it answers in time
        try:
            if not worker.wait_ready(deadline - self.kill_grace - time.monotonic()):
                raise PlanningTimeout("no planner process was ready in time (still starting)")
            budget = max(0.0, min(limit, deadline - self.kill_grace - time.monotonic()))
            try:
                worker.conn.send_bytes(json.dumps({"time_limit": budget}).encode())
                worker.conn.send_bytes(problem.model_dump_json().encode())
                answered = worker.conn.poll(max(0.0, deadline - time.monotonic()))
                answer = json.loads(worker.conn.recv_bytes()) if answered else None
            except (EOFError, OSError) as e:
                healthy = False
                raise RuntimeError(f"the planner process died: {e!r}") from None
            if answer is None:
                healthy = False
                raise PlanningTimeout(
                    f"the planner did not answer within {limit:g} s "
                    f"(+{self.kill_grace:g} s grace): its process was killed"
                )
        finally:
            self._release(worker, healthy)
        if "plan" in answer:
            return Plan.model_validate(answer["plan"])
        if "faults" in answer:
            raise BadInput([Fault(str(p), str(m)) for p, m in answer["faults"]])
        raise RuntimeError(str(answer.get("error", "the planner process gave no plan")))

    def _acquire(self, deadline: float) -> _Worker:
        """A free process, first come first served; `PlanningTimeout` at ``deadline``."""
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                ready = self._cond.wait_for(
                    lambda: self._closed or (self._queue[0] is ticket and self._busy < self.size),
                    timeout=max(0.0, deadline - time.monotonic()),
                )
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
            if self._closed:
                raise RuntimeError("the planner processes are closed")
            if not ready:
                raise PlanningTimeout("no planner process became free in time")
            self._busy += 1
            # One that has imported its planner first (a replacement may still be starting).
            ready = [w for w in self._idle if w.ready or w.wait_ready(0.0)]
            worker = (ready or self._idle or [None])[-1]
            if worker is not None:
                self._idle.remove(worker)
        if worker is None:
            try:
                worker = _Worker(self._mp, self.planner)
            except BaseException:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()
                raise
        return worker

    def _release(self, worker: _Worker, healthy: bool) -> None:
        if not healthy:  # overran or died: kill it, and start its replacement at once
            with self._cond:
                self.killed += 1
            log.warning("killing planner process %s", worker.process.pid)
            worker.kill()
        replacement: _Worker | None = None
        with self._cond:
            closed = self._closed
        if healthy and not closed:
            replacement = worker
        elif not closed:
            try:
                replacement = _Worker(self._mp, self.planner)
            except Exception:  # started again on demand
                log.exception("starting a planner process failed")
        elif healthy:
            worker.stop()
        with self._cond:
            self._busy -= 1
            if replacement is not None:
                self._idle.append(replacement)
            self._cond.notify_all()


class JobPlanner:
    """One job's `Planner` on a `PlannerProcesses`: its plans run one at a time."""

    def __init__(self, pool: PlannerProcesses, key: str) -> None:
        self.pool = pool
        self.key = key
        self._lock = threading.Lock()

    def __call__(self, problem: PlanningProblem, *, time_limit: float | None = None) -> Plan:
        limit = 60.0 if time_limit is None else float(time_limit)
        if not self._lock.acquire(timeout=limit + self.pool.kill_grace):
            raise PlanningTimeout(f"{self.key}: its previous plan is still running")
        try:
            return self.pool.plan(problem, time_limit=time_limit)
        finally:
            self._lock.release()

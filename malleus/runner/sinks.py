"""How a local run switches plans: live (POST /plan, in-place migration) or by restarting.

`LiveSink` is the controller's HTTP sink plus bookkeeping: the trainers' acknowledgement says
which step the new plan took over at and what the migration cost, and it goes into the record. `RestartSink` is what
elastic frameworks (TorchElastic, DLRover) do instead: checkpoint, stop every process, relaunch
all of them under the new plan and resume; its "migration" is the whole downtime, and its bytes
the checkpoint written and read back. Same controller, same decisions: only the switch differs.

`CoordinatorClient` is the one control client of a run (controller source, sink, runner): every
rank has its own control port and serves it while it is the coordinator (the lowest GPU of the
current membership), so the client follows the lowest rank whose process is alive and answers
`GET /status`, looking again when its endpoint stops answering or a lower rank comes back.
`/status`, not `/healthz`: a rank that rejoined while another coordinates serves its node's
metrics page (trainer/engine/services.py, as in a pod) and answers `/healthz` but not `/status`,
which is how the operator's search passes it by too (operator/trainers.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from malleus.control import AsyncControlClient, ControlError
from malleus.control.capped import Answer
from malleus.controller.ports import Ack, AckTimeout, PlanRejected
from malleus.controller.sources import HttpPlanSink
from malleus.errors import BadInput
from malleus.planner.plan import Plan

from .processes import TrainerProcesses
from .record import PlanSwitch, RunRecord

__all__ = [
    "CoordinatorClient",
    "LiveSink",
    "RestartSink",
    "checkpoint_bytes",
    "latest_checkpoint_step",
]


class CoordinatorClient(AsyncControlClient):
    """An AsyncControlClient whose endpoint is the current coordinator's (see the module)."""

    def __init__(
        self, procs: TrainerProcesses, token: str | None, *, timeout: float = 10.0
    ) -> None:
        super().__init__(procs.url, token, timeout=timeout)
        self.procs = procs
        self.rank = 0
        """The rank whose endpoint is called."""
        self._probe = httpx.AsyncClient(timeout=httpx.Timeout(1.0), trust_env=False)
        self._lock: asyncio.Lock | None = None

    @property
    def current_url(self) -> str:
        return self.procs.url_of(self.rank)

    def _url(self, path: str) -> str:
        return self.current_url + path

    async def _answers(self, rank: int) -> bool:
        """Whether `rank` coordinates: its ``GET /status`` answers 200."""
        try:
            response = await self._probe.get(
                self.procs.url_of(rank) + "/status", headers=self._auth()
            )
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def locate(self) -> int | None:
        """Follow the lowest live rank that answers /status; its rank (None: none answers)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            for rank in sorted(self.procs.alive()):
                if await self._answers(rank):
                    self.rank = rank
                    return rank
            return None

    async def follow(self) -> None:
        """Look again if the followed rank is gone, or a lower rank is alive (re-admitted)."""
        alive = self.procs.alive()
        if alive and (self.rank not in alive or min(alive) < self.rank):
            await self.locate()

    async def _call(self, method: str, path: str, body: bytes | None = None) -> Answer:
        try:
            return await super()._call(method, path, body)
        except ControlError as e:
            if e.code is not None:
                raise
            before = self.rank
            if await self.locate() in (None, before):
                raise
            return await super()._call(method, path, body)

    async def aclose(self) -> None:
        await self._probe.aclose()
        await self._http.aclose()


class LiveSink(HttpPlanSink):
    """POST /plan to rank 0, wait for the switch, record where and at what cost it happened."""

    def __init__(
        self,
        url: str,
        token: str,
        record: RunRecord,
        *,
        poll_seconds: float = 0.2,
        client: AsyncControlClient | None = None,
        plans_dir: Path | None = None,
    ):
        super().__init__(url, token, poll_seconds=poll_seconds)
        if client is not None:
            self.client = client
        self._record = record
        self._plans_dir = plans_dir

    async def publish(self, plan: Plan) -> int:
        """Keep every published plan in the work directory (a resumed run starts from the one
        its checkpoint was taken under), then POST it."""
        if self._plans_dir is not None:
            (self._plans_dir / f"gen-{plan.generation}.json").write_text(plan.to_json())
        return await super().publish(plan)

    async def recorded_plan(self, generation: int) -> Plan | None:
        """The plan of `generation` as the trainers serve it (`GET /plan`, the plan in force),
        or None: the trainers made it themselves (a recovery's plan, never published here),
        and the controller must re-plan from the layout really in force (`PlanRecords`)."""
        try:
            plan = await self.client.plan()
        except ControlError:
            return None
        return plan if plan is not None and plan.generation == generation else None

    async def wait_applied(self, generation: int, timeout: float) -> Ack:
        ack = await super().wait_applied(generation, timeout)
        self._record.add_switch(
            PlanSwitch(ack.generation, ack.step, ack.migration_seconds, ack.migration_bytes)
        )
        return ack


def latest_checkpoint_step(directory: Path) -> int | None:
    """The step of the checkpoint `directory/latest` names (`step-00000020` -> 20), or None."""
    try:
        name = (directory / "latest").read_text().strip()
        return int(name.rsplit("-", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of the latest checkpoint (0 if none)."""
    try:
        folder = directory / (directory / "latest").read_text().strip()
    except OSError:
        return 0
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@dataclass
class _Relaunch:
    generation: int
    resume_step: int
    bytes: int
    started: float


class RestartSink:
    """Switch plans by checkpoint, stop, relaunch with `--plan NEW --resume`."""

    def __init__(
        self,
        procs: TrainerProcesses,
        client: AsyncControlClient,
        record: RunRecord,
        plans_dir: Path,
        checkpoint_dir: Path,
        *,
        on_fatal: Callable[[BaseException], None],
        stop_timeout: float = 180.0,
        poll_seconds: float = 0.1,
    ) -> None:
        self.procs = procs
        self.client = client
        self.record = record
        self.plans_dir = plans_dir
        self.checkpoint_dir = checkpoint_dir
        self.on_fatal = on_fatal
        self.stop_timeout = stop_timeout
        self.poll_seconds = poll_seconds
        self._relaunch: _Relaunch | None = None

    def _fatal(self, error: BaseException) -> BaseException:
        self.procs.expect_exit = False
        self.on_fatal(error)
        return error

    async def publish(self, plan: Plan) -> int:
        path = self.plans_dir / f"gen-{plan.generation}.json"
        path.write_text(plan.to_json())
        self.procs.expect_exit = True  # before asking: the exits may come before the answer
        try:
            await self.client.stop(checkpoint=True)
        except (BadInput, ControlError) as e:
            self.procs.expect_exit = False
            code = 400 if isinstance(e, BadInput) else e.code
            if code is None:  # nothing answered: not a refusal
                raise
            raise PlanRejected(code, f"POST /stop refused: {e}") from e
        deadline = time.monotonic() + self.stop_timeout
        while self.procs.running():
            if time.monotonic() > deadline:
                self.procs.terminate()
                raise self._fatal(
                    RuntimeError(f"the trainers did not stop within {self.stop_timeout:g} s")
                )
            await asyncio.sleep(self.poll_seconds)
        bad = [(r, c) for r, c in enumerate(self.procs.codes()) if c]
        if bad:
            rank, code = bad[0]
            raise self._fatal(RuntimeError(f"rank {rank} failed while stopping (code {code})"))
        step = latest_checkpoint_step(self.checkpoint_dir)
        if step is None:
            raise self._fatal(RuntimeError(f"no checkpoint in {self.checkpoint_dir} after stop"))
        self.procs.start(path, resume=True)  # the event loop's (main) thread: see processes
        self._relaunch = _Relaunch(
            plan.generation, step, checkpoint_bytes(self.checkpoint_dir), time.monotonic()
        )
        return plan.generation

    async def wait_applied(self, generation: int, timeout: float) -> Ack:
        job = self._relaunch
        if job is None or job.generation != generation:
            raise AckTimeout(f"generation {generation} was not relaunched")
        deadline = time.monotonic() + timeout
        while True:
            failure = self.procs.failure()
            if failure is not None:
                raise self._fatal(failure)
            first = self.record.get(job.resume_step)
            if first is not None and first.seconds is not None and first.time is not None:
                break
            if time.monotonic() > deadline:
                raise AckTimeout(f"generation {generation}: no step {timeout:g} s after relaunch")
            await asyncio.sleep(self.poll_seconds)
        before = self.record.get(job.resume_step - 1)
        downtime = None
        if before is not None and before.time is not None:
            downtime = max(0.0, first.time - first.seconds - before.time)
        self.record.add_switch(PlanSwitch(generation, job.resume_step, downtime, job.bytes))
        self._relaunch = None
        return Ack(generation, job.resume_step, downtime, float(job.bytes))

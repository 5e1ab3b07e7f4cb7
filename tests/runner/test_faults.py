"""`malleus run` across failures, with real processes: a rank SIGKILLed mid-run is replaced and
the run ends with the model a single process trains; SIGTERM checkpoints first, and
`--resume` continues the run and appends to its report.

Every wait polls against a deadline; the runner's output is kept for the assertion messages.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import manifest, write_job
from .test_shutdown import trainers, wait_for

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")


def job(tmp_path: Path, *, steps: int, tp: int = 2, **spec: Any) -> str:
    m = manifest(gpus=2, layers=2, global_batch=2, steps=steps, forward_ms=30, backward_ms=60)
    m["spec"]["parallelism"]["tp"] = tp
    m["spec"].update(spec)
    return write_job(tmp_path / "job.yaml", m)


def rejoin_job(tmp_path: Path) -> str:
    """tp 1 on 2 GPUs: two data-parallel replicas, so losing either loses no state; a
    replacement after 1 s, and a cooldown of 1 s: the controller may re-admit it soon after
    the failure's re-plan."""
    return job(
        tmp_path,
        steps=40,
        tp=1,
        failurePolicy={"restartBackoffSeconds": 1, "hangTimeoutSeconds": 20},
        stragglerPolicy={"cooldownSeconds": 1},
    )


def runner(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "malleus.cli", "run", *args]
    cmd += ["--progress", "lines", "--progress-interval", "2"]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=open(tmp_path / f"out-{time.monotonic_ns()}.txt", "w"),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def live_run(
    tmp_path: Path, job_file: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """`malleus run` of `job_file` with its work directory, report and final model in
    `tmp_path` (`work`, `r.json`, `model.pt`), as every test here reads them."""
    paths = ["--workdir", str(tmp_path / "work"), "--report", str(tmp_path / "r.json")]
    paths += ["--save-model", str(tmp_path / "model.pt")]
    return runner(tmp_path, job_file, *paths, *extra, env=env)


def step_done(workdir: Path, step: int, runner: subprocess.Popen[str]) -> bool:
    if runner.poll() is not None:
        _, err = runner.communicate()
        raise AssertionError(f"malleus run ended early ({runner.returncode}): {err[-3000:]}")
    logs = workdir / "logs" / "launch-1"
    if not logs.is_dir():
        return False
    return any(
        f"[malleus] step {step - 1} ({step}/" in p.read_text(errors="replace")
        for p in logs.glob("*.log")
    )


def reference(tmp_path: Path, job_file: str) -> dict[str, Any]:
    """The single-process reference's final model, trained in this process (no interpreter or
    torch to start again: the CPUs are shared)."""
    import torch

    from malleus.job import ResolvedJob
    from malleus.trainer.run.reference import train_reference

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return dict(train_reference(ResolvedJob.load(job_file)).full_state())
    finally:
        torch.set_num_threads(threads)


def assert_same_model(path: Path, want: dict[str, Any]) -> None:
    import torch

    got = torch.load(path)
    assert got.keys() == want.keys()
    worst = max(float((got[k] - want[k]).abs().max() / (1 + want[k].abs().max())) for k in want)
    assert worst <= 1e-4, worst


def runner_says(tmp_path: Path, text: str, runner: subprocess.Popen[str]) -> bool:
    """`text` in the runner's progress output (`runner` writes it to `tmp_path/out-*.txt`)."""
    if runner.poll() is not None:
        _, err = runner.communicate()
        raise AssertionError(f"malleus run ended early ({runner.returncode}): {err[-3000:]}")
    return any(text in p.read_text(errors="replace") for p in tmp_path.glob("out-*.txt"))


def test_sigterm_checkpoints_first_and_resume_continues_and_appends(tmp_path: Path) -> None:
    # No spec.checkpoint (as in the quickstart): a local run can be continued all the same.
    # Rank 1 slows 4x at step 2, so generation 2 (rank 1 left out) is in force at the stop; a
    # grace period of 10 minutes, so a stop that waited for it rather than for the next step
    # boundary would time out below.
    job_file = job(
        tmp_path,
        steps=14,
        tp=1,
        stragglerPolicy={"cooldownSeconds": 1, "windowSteps": 2},
        failurePolicy={"gracePeriodSeconds": 600},
        emulation={
            "enabled": True,
            "layerForwardMs": 30,
            "layerBackwardMs": 60,
            "schedule": [{"step": 2, "rank": 1, "factor": 4.0}],
        },
    )
    work, report = tmp_path / "work", tmp_path / "r.json"
    first = live_run(tmp_path, job_file, "--plot", str(tmp_path / "p.png"))
    wait_for("generation 2", lambda: runner_says(tmp_path, "run generation 2", first), 240)
    os.kill(first.pid, signal.SIGTERM)  # what `kill` or a pod's deletion sends
    _, err = first.communicate(timeout=120)
    assert first.returncode == 130, err
    assert "interrupted: saved a checkpoint of step" in err, err
    assert f"malleus run --resume {work}" in err
    assert trainers(work) == {}
    saved = json.loads(report.read_text())
    assert saved["exit"]["code"] == 130
    stopped_at = int(err.split("saved a checkpoint of step ")[1].split()[0])
    assert 3 <= stopped_at < 14
    assert (work / "checkpoints" / "latest").read_text().strip() == f"step-{stopped_at:08d}"
    assert saved["per_step"][-1]["generation"] == 2, saved["per_step"]
    first_log = (work / "logs" / "launch-1" / "rank-0.log").read_text()

    again = runner(tmp_path, "--resume", str(work))
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    out = json.loads(report.read_text())
    assert out["exit"]["code"] == 0 and out["steps"] == 14
    assert [r["step"] for r in out["per_step"]] == list(range(14))
    # the plan in force at the checkpoint, and its generation, go on after the resume
    resumed_rows = [r for r in out["per_step"] if r["step"] >= stopped_at]
    assert {r["generation"] for r in resumed_rows} == {2}, resumed_rows
    assert [c["generation"] for c in out["plan_changes"]] == [2]
    last = out["windows"][-1]  # the re-plan's window spans both launches
    assert (last["old_generation"], last["generation"], last["last_step"]) == (1, 2, 13)
    assert [r["step"] for r in out["resumes"]] == [stopped_at]
    assert out["resumes"][0]["previous_exit"]["code"] == 130
    assert out["started"] == saved["started"]
    assert (tmp_path / "p.png").stat().st_size > 0
    # logs appended: the first launch's as it was, the continuation's beside it
    assert (work / "logs" / "launch-1" / "rank-0.log").read_text() == first_log
    resumed = (work / "logs" / "launch-2" / "rank-0.log").read_text()
    assert f"at step {stopped_at}" in resumed  # "resumed from ... at step N"
    assert_same_model(tmp_path / "model.pt", reference(tmp_path, job_file))

    # a finished run says so, and its report is left as it was
    before = report.read_bytes()
    done = subprocess.run(
        [sys.executable, "-m", "malleus.cli", "run", "--resume", str(work)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert f"the run in {work} finished: it trained all 14 steps" in done.stderr
    assert report.read_bytes() == before
    assert not (work / "logs" / "launch-3").exists()


def test_resume_needs_a_checkpoint(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "malleus.cli", "run", "--resume", str(work)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "is not the work directory of a malleus run" in proc.stderr


def test_killing_the_coordinator_rank_replaces_it_and_a_later_plan_readmits_it(
    tmp_path: Path,
) -> None:
    job_file = rejoin_job(tmp_path)
    from malleus.trainer.recovery.join import AWAIT_JOIN_ENV

    work, report = tmp_path / "work", tmp_path / "r.json"
    # Deterministic on a loaded machine: the survivor, coordinating alone, waits at its step
    # boundaries until the replacement of GPU 0 has asked to join (trainer/recovery/join.py's
    # test hook), so the run cannot end before it is admitted however slowly it starts.
    run = live_run(tmp_path, job_file, env={AWAIT_JOIN_ENV: "0"})
    wait_for("step 3", lambda: step_done(work, 3, run), 240)
    pids = trainers(work)
    assert sorted(pids) == [0, 1]
    os.kill(pids[0], signal.SIGKILL)  # the coordinator: its control endpoint goes with it
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    out = json.loads(report.read_text())
    assert out["steps"] == 40 and out["exit"]["code"] == 0
    first = out["failures"][0]
    assert first["rank"] == 0 and first["why"] == "killed by SIGKILL"
    assert first["step"] >= 3 and first["action"] == "replace in 1 s"
    recovery = out["recoveries"][0]
    assert list(recovery["failed"]) == ["0"]
    assert recovery["steps_lost"] == 0 and recovery["mode"] == "replicas"
    assert recovery["seconds"] is not None and 0 < recovery["seconds"] < 120
    assert trainers(work) == {}
    # The replacement: rank 0's command plus --join, admitted at a step boundary ...
    (replacement,) = out["replacements"]
    log = (work / "logs" / "launch-1" / "rank-0.join-1.log").read_text()
    assert replacement["rank"] == 0 and replacement["joined_step"] is not None, log[-3000:]
    # started only once the survivor committed a step after the failure (not to compete with
    # its recovery for this host's CPUs), and after the backoff
    assert replacement["time"] >= first["time"] + max(1.0, recovery["seconds"]) - 0.05
    assert f"[malleus] rank 0 joined at step {replacement['joined_step']}" in log
    # ... and re-admitted by a later plan (the controller's, once rank 0's rate is back): it
    # joined holding nothing, so a plan that places it after its join re-admits it.
    readmitted = [
        c
        for c in out["plan_changes"]
        if c["step_applied"] > replacement["joined_step"]
        and any(0 in s["ranks"] for p in c["plan"]["pipelines"] for s in p["stages"])
    ]
    assert readmitted, out["plan_changes"]
    assert_same_model(tmp_path / "model.pt", reference(tmp_path, job_file))


def test_no_valid_plan_on_the_gpus_left_ends_the_run_with_that_reason(tmp_path: Path) -> None:
    # tp 2 on one node of 2 GPUs, each with just the memory its half of the model needs: the
    # survivor of a killed rank would have to hold both shards, and no plan fits it.
    m = yaml_load(Path(job(tmp_path, steps=12, failurePolicy={"restartBackoffSeconds": 1})))
    m["spec"]["resources"] = {"gpuMemoryMiB": _tightest_memory(tmp_path, m)}
    m["spec"]["emulation"]["schedule"] = [{"step": 3, "rank": 1, "fail": "kill"}]
    job_file = write_job(tmp_path / "job.yaml", m)
    work = tmp_path / "work"
    run = runner(tmp_path, job_file, "--workdir", str(work))
    _, err = run.communicate(timeout=300)
    assert run.returncode == 1, err
    assert "no valid plan on the GPUs left" in err, err[-3000:]
    out = json.loads((work / "report.json").read_text())
    assert out["exit"]["code"] == 1
    reason = out["exit"]["reason"]
    assert reason.startswith("no valid plan on the GPUs left: "), reason
    assert "memory: no layout fits" in reason.splitlines()[0]  # the planner's own fault
    assert "rank 0 exited with code 4 (no valid plan)" in reason  # NO_PLAN_EXIT
    assert 3 <= out["steps"] < 12
    # The survivor says it in one line: the GPUs left, the one lost, the planner's fault.
    said = (work / "logs" / "launch-1" / "rank-0.log").read_text()
    (line,) = [x for x in said.splitlines() if x.startswith("malleus trainer: no valid plan")]
    assert line.startswith(
        "malleus trainer: no valid plan on the GPUs left: 1 of 2 after losing GPU(s) 1 at "
        "recovery epoch 1: memory: no layout fits"
    ), said[-3000:]
    assert "\n  - " not in said.split("malleus trainer: no valid plan", 1)[1][:2000]
    # The survivor's exit is the job's end, not one more failure to replace.
    (failure,) = out["failures"]
    assert failure["rank"] == 1 and failure["why"] == "killed by SIGKILL"
    assert trainers(work) == {}


def _tightest_memory(tmp_path: Path, m: dict[str, Any]) -> int:
    """The least gpuMemoryMiB under which the job's GPUs, all healthy, still have a plan (found
    by bisection over the planner's own memory check), asserted to leave none for one GPU."""
    from malleus.errors import BadInput
    from malleus.job import ResolvedJob
    from malleus.planner.search import plan

    def fits(mib: int, rates: dict[int, float | None]) -> bool:
        m["spec"]["resources"] = {"gpuMemoryMiB": mib}
        job = ResolvedJob.load(write_job(tmp_path / "probe.yaml", m))
        try:
            plan(job.problem(rates), time_limit=5.0)
        except BadInput:
            return False
        return True

    low, high = 1, 1 << 20  # fits(high) on one GPU too: the least for two is below it
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid, {}) else (mid, high)
    assert fits(high, {}) and not fits(high, {1: None})
    return high


def test_restart_mode_restarts_every_process_from_the_checkpoint(tmp_path: Path) -> None:
    # The baseline bench/faults.py measures: a scheduled kill, and every process restarted from
    # the checkpoint of step 3 (steps 3 and 4 trained again), without the fault a second time.
    job_file = job(
        tmp_path,
        steps=8,
        checkpoint={"intervalSteps": 3},
        failurePolicy={"restartBackoffSeconds": 0},
    )
    m = yaml_load(Path(job_file))
    m["spec"]["emulation"]["schedule"] = [{"step": 5, "rank": 1, "fail": "kill"}]
    job_file = write_job(tmp_path / "job.yaml", m)
    work = tmp_path / "work"
    run = runner(tmp_path, job_file, "--mode", "restart", "--workdir", str(work))
    _, err = run.communicate(timeout=600)
    assert run.returncode == 0, err
    out = json.loads((work / "report.json").read_text())
    assert out["steps"] == 8 and out["exit"]["code"] == 0
    (failure,) = out["failures"]
    assert failure["rank"] == 1 and failure["why"] == "killed by SIGKILL"
    assert failure["action"] == "restart every process from the latest checkpoint"
    (recovery,) = out["recoveries"]
    assert recovery["mode"] == "restart" and recovery["step"] == 3
    assert recovery["steps_lost"] == 2 and recovery["bytes_restored"] > 0
    assert sorted(p.name for p in (work / "logs").iterdir()) == ["launch-1", "launch-2"]
    relaunched = yaml_load(work / "job-launch-2.yaml")
    assert relaunched["spec"]["emulation"]["schedule"] == []
    assert trainers(work) == {}


def test_restart_mode_restarts_a_rank_that_dies_before_the_job_is_up(tmp_path: Path) -> None:
    # Rank 1 SIGKILLed as soon as its process exists, before the ranks have met (the control
    # endpoint is not up yet): every process is started again at once (before, the runner
    # waited out --init-timeout + 120 s and gave up, however early the failure).
    job_file = job(tmp_path, steps=4, failurePolicy={"restartBackoffSeconds": 0})
    work = tmp_path / "work"
    started = time.monotonic()
    run = runner(tmp_path, job_file, "--mode", "restart", "--workdir", str(work))
    wait_for("rank 1's process", lambda: 1 in trainers(work) or run.poll() is not None, 120)
    assert not (work / "logs" / "launch-1" / "rank-0.log").read_text().count("[malleus] step ")
    os.kill(trainers(work)[1], signal.SIGKILL)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    assert time.monotonic() - started < 240  # no wait for the init timeout
    out = json.loads((work / "report.json").read_text())
    assert out["steps"] == 4 and out["exit"]["code"] == 0
    (failure,) = out["failures"]
    assert failure["rank"] == 1 and failure["step"] == 0
    (recovery,) = out["recoveries"]
    assert recovery["mode"] == "restart" and recovery["steps_lost"] == 0
    assert sorted(p.name for p in (work / "logs").iterdir()) == ["launch-1", "launch-2"]


def yaml_load(path: Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text())


def _store_pid(runner_pid: int) -> int:
    """The pid of the runner's rendezvous store (`python -m malleus.trainer store`)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == runner_pid and b"malleus.trainer" in cmd and b"store" in cmd:
            return int(proc.name)
    raise AssertionError("no store process under the runner")


def test_a_lost_store_is_started_again_and_a_later_failure_is_still_survived(
    tmp_path: Path,
) -> None:
    # The store process is SIGKILLed mid-run: the runner starts it again, empty, on its port,
    # the trainers' clients dial it again; then a rank is killed, and the survivor recovers
    # through the new store (before, every rank exited on its first store call).
    job_file = job(tmp_path, steps=30, tp=1, failurePolicy={"hangTimeoutSeconds": 20})
    work, report = tmp_path / "work", tmp_path / "r.json"
    model = tmp_path / "model.pt"
    run = live_run(tmp_path, job_file)
    wait_for("step 3", lambda: step_done(work, 3, run), 240)
    os.kill(_store_pid(run.pid), signal.SIGKILL)
    wait_for("step 8", lambda: step_done(work, 8, run), 240)
    os.kill(trainers(work)[1], signal.SIGKILL)
    _, err = run.communicate(timeout=300)
    output = "".join(p.read_text() for p in tmp_path.glob("out-*.txt")) + err
    assert run.returncode == 0, output[-4000:]
    assert "the rendezvous store died (killed by SIGKILL)" in output, output[-4000:]
    out = json.loads(report.read_text())
    assert out["steps"] == 30 and out["exit"]["code"] == 0
    (recovery,) = out["recoveries"]
    assert list(recovery["failed"]) == ["1"] and recovery["mode"] == "replicas"
    assert recovery["steps_lost"] == 0
    logs = "".join(p.read_text(errors="replace") for p in (work / "logs").rglob("rank-*.log"))
    assert "is back after" in logs  # the clients said they dialed the new store
    assert_same_model(model, reference(tmp_path, job_file))


def test_a_gpu_replaced_before_the_store_was_lost_is_replaced_again_after(
    tmp_path: Path,
) -> None:
    # GPU 1 is killed and its replacement admitted; the store is SIGKILLed (started again,
    # empty: the join counter starts again at 1); the replacement is killed too, and its own
    # replacement must be admitted as well (before, it looked admitted already: the counter's
    # 1 was the first replacement's, so it waited until its timeout and GPU 1 stayed out).
    job_file = rejoin_job(tmp_path)
    from malleus.trainer.recovery.join import AWAIT_JOIN_ENV

    work, report = tmp_path / "work", tmp_path / "r.json"
    model = tmp_path / "model.pt"
    # The survivor waits at its step boundaries for GPU 1's replacement (the test hook), so
    # the run cannot end before each replacement asked to join, however slowly it starts.
    run = live_run(tmp_path, job_file, env={AWAIT_JOIN_ENV: "1"})
    logs = work / "logs" / "launch-1"

    def joined(k: int) -> bool:
        step_done(work, 0, run)  # raises if the run ended
        path = logs / f"rank-1.join-{k}.log"
        return path.is_file() and "[malleus] rank 1 joined at step" in path.read_text()

    wait_for("step 3", lambda: step_done(work, 3, run), 240)
    os.kill(trainers(work)[1], signal.SIGKILL)
    wait_for("the first replacement joined", lambda: joined(1), 240)
    os.kill(_store_pid(run.pid), signal.SIGKILL)
    said = "the rendezvous store died (killed by SIGKILL)"
    wait_for("the store restarted", lambda: said in "".join(_outputs(tmp_path)), 240)
    os.kill(trainers(work)[1], signal.SIGKILL)
    wait_for("the second replacement joined", lambda: joined(2), 240)
    _, err = run.communicate(timeout=300)
    output = "".join(_outputs(tmp_path)) + err
    assert run.returncode == 0, output[-4000:]
    out = json.loads(report.read_text())
    assert out["steps"] == 40 and out["exit"]["code"] == 0
    assert [r["rank"] for r in out["replacements"]] == [1, 1]
    assert all(r["joined_step"] is not None for r in out["replacements"]), out["replacements"]
    assert [list(r["failed"]) for r in out["recoveries"]] == [["1"], ["1"]]
    assert all(r["steps_lost"] == 0 for r in out["recoveries"])
    assert_same_model(model, reference(tmp_path, job_file))


def _outputs(tmp_path: Path) -> list[str]:
    return [p.read_text() for p in sorted(tmp_path.glob("out-*.txt"))]

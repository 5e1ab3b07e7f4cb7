"""The switch protocol: 202 / 409 / 400, newest pending wins, take() clears, threads are safe."""

from __future__ import annotations

import json
import random
import threading

from malleus.control import PlanFailure
from malleus.trainer.switching.plan_inbox import PlanInbox


def test_accept_take_apply(problem, plan_factory) -> None:
    inbox = PlanInbox(problem, current_generation=0)
    assert inbox.take() is None
    assert inbox.offer(json.dumps(plan_factory(1)).encode()) == (202, {"generation": 1})
    assert inbox.pending_generation == 1
    plan = inbox.take()
    assert plan is not None and plan.generation == 1
    assert inbox.take() is None and inbox.pending_generation is None
    # taken but not yet applied: a retry of the same generation is stale, not applied twice
    assert inbox.offer(plan_factory(1))[0] == 409
    inbox.applied(1)
    assert inbox.current_generation == 1
    assert inbox.offer(plan_factory(1))[0] == 409  # now in force
    assert inbox.offer(plan_factory(2))[0] == 202


def test_stale_generations_conflict(problem, plan_factory) -> None:
    inbox = PlanInbox(problem, current_generation=3)
    code, body = inbox.offer(plan_factory(3))
    assert code == 409 and body["generation"] == 3 and body["pending"] is None
    assert inbox.offer(plan_factory(4))[0] == 202
    code, body = inbox.offer(plan_factory(4))
    assert code == 409 and body == {
        "error": "generation 4 is not newer than 4",
        "generation": 3,
        "newest": 4,
        "pending": 4,
    }


def test_newest_pending_wins(problem, plan_factory) -> None:
    inbox = PlanInbox(problem, current_generation=0)
    assert inbox.offer(plan_factory(1))[0] == 202
    assert inbox.offer(plan_factory(2))[0] == 202
    plan = inbox.take()
    assert plan is not None and plan.generation == 2


def test_invalid_plans_carry_validate_plan_faults(problem, plan_factory) -> None:
    inbox = PlanInbox(problem, current_generation=0)
    bad = plan_factory(1)
    bad["pipelines"][0]["micro_batches"] = 3  # sums to 5, not 4
    bad["pipelines"][1]["stages"] = [
        {"ranks": [2, 3], "layers": [0, 2]},
        {"ranks": [0], "layers": [3, 4]},  # a gap, and rank 0 twice
    ]
    code, body = inbox.offer(bad)
    assert code == 400 and body["error"] == "invalid plan"
    faults = {f["path"]: f["message"] for f in body["faults"]}
    assert faults["pipelines[1].stages[1].layers"].startswith("starts at 3 but the previous stage")
    assert faults["pipelines[1].stages[1]"].startswith("rank 0 is also in pipelines[0].stages[0]")
    assert faults["micro_batches"].startswith("pipelines sum to 5")
    assert inbox.pending_generation is None

    code, body = inbox.offer(b"{not json")
    assert code == 400 and body["faults"][0]["message"].startswith("body is not JSON")
    code, body = inbox.offer({"generation": 1, "tp": 2, "pipelines": "x", "extra": 1})
    assert code == 400 and {f["path"] for f in body["faults"]} == {"pipelines", "extra"}


def test_left_out_ranks_are_accepted_as_excluded(problem, plan_factory) -> None:
    inbox = PlanInbox(problem, current_generation=0)
    plan = plan_factory(
        1, pipelines=[{"micro_batches": 4, "stages": [{"ranks": [0, 1], "layers": [0, 4]}]}]
    )
    assert inbox.offer(plan)[0] == 202  # ranks 2 and 3 sit out (say the controller nulled them)


def test_failed_apply_frees_the_generation(problem, plan_factory) -> None:
    inbox = PlanInbox(problem, current_generation=0)
    inbox.offer(plan_factory(1))
    inbox.take()
    inbox.failed(1, "migration timed out")
    assert inbox.last_failure == PlanFailure(generation=1, reason="migration timed out")
    assert inbox.offer(plan_factory(1))[0] == 202
    inbox.take()
    inbox.applied(1)
    assert inbox.last_failure is None


def test_concurrent_offers(problem, plan_factory) -> None:
    inbox = PlanInbox(problem, current_generation=0)
    results: list[tuple[int, int]] = []
    lock = threading.Lock()
    gens = list(range(1, 81))
    random.Random(7).shuffle(gens)

    def worker(part: list[int]) -> None:
        for g in part:
            code, _ = inbox.offer(plan_factory(g))
            with lock:
                results.append((g, code))

    threads = [threading.Thread(target=worker, args=(gens[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 80 and {c for _, c in results} <= {202, 409}
    accepted = sorted(g for g, c in results if c == 202)
    assert accepted == list(range(1, len(accepted) + 1))  # each the next one, none twice
    assert inbox.pending_generation == accepted[-1]
    plan = inbox.take()
    assert plan is not None and plan.generation == accepted[-1]

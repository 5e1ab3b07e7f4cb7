"""Generations are bounded: the inbox takes the next one only, so no POST can run ahead of it.

A generation of 10^30 used to be accepted and applied, after which every controller's next
generation was stale for good. The 409 carries what a controller needs to resynchronise.
"""

from __future__ import annotations

from malleus.trainer.switching.plan_inbox import PlanInbox


def test_a_huge_generation_is_refused_and_changes_nothing(problem, plan_factory) -> None:
    inbox = PlanInbox(problem, current_generation=1)
    code, body = inbox.offer(plan_factory(10**30))
    assert code == 409
    assert body["generation"] == 1 and body["newest"] == 1 and body["pending"] is None
    assert "the next one is 2" in body["error"]
    assert inbox.pending_generation is None and inbox.take() is None
    assert inbox.offer(plan_factory(2)) == (202, {"generation": 2})  # the next one still is


def test_only_the_next_generation_after_the_newest_is_accepted(problem, plan_factory) -> None:
    inbox = PlanInbox(problem, current_generation=4)
    for stale in (0, 3, 4):
        assert inbox.offer(plan_factory(stale))[0] == 409
    assert inbox.offer(plan_factory(6))[0] == 409  # skips 5
    assert inbox.offer(plan_factory(5))[0] == 202  # in force + 1
    assert inbox.offer(plan_factory(7))[0] == 409  # skips 6
    assert inbox.offer(plan_factory(6))[0] == 202  # pending + 1 replaces the pending 5
    assert inbox.pending_generation == 6
    taken = inbox.take()
    assert taken is not None and taken.generation == 6
    code, body = inbox.offer(plan_factory(6))  # being applied: stale
    assert code == 409 and (body["generation"], body["newest"]) == (4, 6)
    inbox.applied(6)
    assert inbox.offer(plan_factory(8))[0] == 409
    assert inbox.offer(plan_factory(7))[0] == 202


def test_a_failed_generation_is_the_next_one_again(problem, plan_factory) -> None:
    inbox = PlanInbox(problem, current_generation=1)
    assert inbox.offer(plan_factory(2))[0] == 202
    inbox.take()
    inbox.failed(2, "migration timed out")
    assert inbox.offer(plan_factory(3))[0] == 409
    assert inbox.offer(plan_factory(2))[0] == 202

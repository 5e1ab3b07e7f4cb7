"""Spawned body of tests/trainer/measure/test_calibration.py (imported by path, so children can
unpickle it; no test_ prefix, not collected)."""

from __future__ import annotations

from rank_cases import spawned_rank

from malleus.job import ResolvedJob
from malleus.planner import Plan


def run(job: ResolvedJob, plans: list[Plan], steps: int, out: str) -> None:
    """Train `steps` steps under each plan in turn (a live switch between them); rank 0 writes
    OUT/result.json: per plan the step seconds, the calibration and the link rates."""
    with spawned_rank(shared_groups=False) as rank:
        trainer = rank.trainer(job, plans[0])
        result = []
        for i, plan in enumerate(plans):
            if i:
                trainer.switch(plan.model_copy(update={"generation": trainer.plan.generation + 1}))
            seconds = [trainer.train_step().seconds for _ in range(steps)]
            cal = trainer.calibrator
            status = trainer.services.status()
            result.append(
                {
                    "seconds": seconds,
                    "calibration": cal.calibration,
                    "link_rates": cal.link_rates,
                    "generation": cal.generation,
                    "status_calibration": status.model_dump(mode="json")["calibration"],
                    "status_links": status.model_dump(mode="json")["link_rates"],
                }
            )
        rank.save(out, "result.json", result)

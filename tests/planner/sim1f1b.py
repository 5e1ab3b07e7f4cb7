"""A discrete-event simulation of the 1F1B schedule, written apart from `cost.pipeline_time`.

Stage j of S with m micro-batches runs min(S-1-j, m) warm-up forwards, then alternates one
forward and one backward, then drains its backwards (Megatron's non-interleaved schedule, as
trainer/parallel/pipeline.py runs it). A forward of stage j costs c_j/3 and a backward 2c_j/3.
Events are operation completions, processed in time order from a heap; an operation starts when
its stage is idle and its input (the previous stage's forward, the next stage's backward, or for
the last stage its own forward) has completed.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["schedule", "simulate"]


def schedule(S: int, j: int, m: int) -> list[tuple[str, int]]:
    """Stage j's operations in order: ("F", i) or ("B", i)."""
    w = min(S - 1 - j, m)
    ops = [("F", i) for i in range(w)]
    for i in range(m - w):
        ops += [("F", w + i), ("B", i)]
    return ops + [("B", i) for i in range(m - w, m)]


def simulate(costs: Sequence[float], m: int) -> float:
    """Makespan of one step of the 1F1B schedule over these stage costs."""
    S = len(costs)
    ops = [schedule(S, j, m) for j in range(S)]
    nxt = [0] * S
    busy = [False] * S
    done: dict[tuple[str, int, int], float] = {}
    events: list[tuple[float, int]] = []  # (completion time, stage)
    now = 0.0

    def ready(j: int) -> bool:
        kind, i = ops[j][nxt[j]]
        if kind == "F":
            return j == 0 or ("F", j - 1, i) in done
        return ("F", j, i) in done if j == S - 1 else ("B", j + 1, i) in done

    def start_all() -> None:
        for j in range(S):
            if not busy[j] and nxt[j] < len(ops[j]) and ready(j):
                kind, _ = ops[j][nxt[j]]
                busy[j] = True
                heapq.heappush(events, (now + costs[j] * (1 if kind == "F" else 2) / 3, j))

    start_all()
    while events:
        now, j = heapq.heappop(events)
        kind, i = ops[j][nxt[j]]
        done[(kind, j, i)] = now
        nxt[j] += 1
        busy[j] = False
        # every completion at this instant first, then new starts
        while events and events[0][0] <= now:
            _, j2 = heapq.heappop(events)
            k2, i2 = ops[j2][nxt[j2]]
            done[(k2, j2, i2)] = now
            nxt[j2] += 1
            busy[j2] = False
        start_all()
    assert all(n == 2 * m for n in nxt), "1F1B deadlocked"
    return now

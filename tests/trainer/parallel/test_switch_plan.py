"""The pure half of migration and the switch protocol: transfers, minimal volume, control words.

No process group: these check the transfer planner against the planner's own holdings on many
plan pairs, the sender choice (same node first, bytes balanced), and the protocol's small parts.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import math
import sys
from dataclasses import replace
from math import prod
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parents[1]))
tc = importlib.import_module("trainer_cases")
sc = importlib.import_module("switch_cases")

from malleus.errors import BadInput  # noqa: E402
from malleus.planner.cost import holdings  # noqa: E402
from malleus.trainer import cli  # noqa: E402
from malleus.trainer.model.decoder import pieces  # noqa: E402
from malleus.trainer.parallel.layout import Layout  # noqa: E402
from malleus.trainer.parallel.migrate import (  # noqa: E402
    minimal_bytes,
    plan_transfers,
    state_elements,
    unit_pieces,
)
from malleus.trainer.run import inputs  # noqa: E402
from malleus.trainer.switching.protocol import Boundary, StopControl  # noqa: E402

MODEL = tc.small_job().model  # 2 nodes x 4 GPUs, tp 2, 6 layers
TIED = replace(MODEL, tied_embeddings=True)

PLANS = {
    "uniform": tc.plan(
        [(6, [([0, 1], (0, 3)), ([2, 3], (3, 6))]), (6, [([4, 5], (0, 3)), ([6, 7], (3, 6))])]
    ),
    "exclude": tc.plan(
        [
            (7, [([0, 1], (0, 2)), ([2], (2, 6))]),
            (5, [([4], (0, 3)), ([5, 6], (3, 5)), ([7], (5, 6))]),
        ],
        excluded=[3],
    ),
    "three": tc.plan(
        [
            (3, [([3, 2], (0, 6))]),
            (5, [([0], (0, 3)), ([1], (3, 6))]),
            (4, [([5, 4], (0, 4)), ([6, 7], (4, 6))]),
        ]
    ),
    "long": tc.plan(
        [(12, [([1, 0], (0, 2)), ([6], (2, 4)), ([3], (4, 6))])], excluded=[2, 4, 5, 7]
    ),
    "one_stage": tc.plan([(12, [([7, 6], (0, 6))])], excluded=[0, 1, 2, 3, 4, 5]),
}
PAIRS = list(itertools.permutations(PLANS, 2))


def _state_bytes(model, tp: int = 2) -> dict[str, int]:
    return {p.name: state_elements(prod(p.shape(tp))) * 4 for p in pieces(model, tp)}


def _held(plan, model) -> dict[int, set[str]]:
    return {r: {p.name for p in Layout.from_plan(plan, model, r, 8).held()} for r in range(8)}


@pytest.mark.parametrize("model", [MODEL, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("name", list(PLANS))
def test_planner_holdings_name_the_trainers_real_pieces(model, name: str) -> None:
    # The planner's units (layer shards, embedding and head shards) and the pieces the trainer
    # really holds must agree, or "minimal bytes" would measure something else.
    plan = PLANS[name]
    units = holdings(plan)
    for rank, held in _held(plan, model).items():
        assert unit_pieces(model, units.get(rank, set())) == held, rank


@pytest.mark.parametrize("model", [MODEL, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_transfers_are_exactly_the_minimal_volume(model, a: str, b: str) -> None:
    old, new = PLANS[a], PLANS[b]
    la, lb = Layout.from_plan(old, model, 0, 8), Layout.from_plan(new, model, 0, 8)
    moves = plan_transfers(la.roles, lb.roles, model, 2, 4)
    # Expected from the trainer's real pieces: every piece a rank holds under `new` and did not
    # hold under `old`, with its parameter, two Adam moments and step (fp32).
    size = _state_bytes(model)
    before, after = _held(old, model), _held(new, model)
    expected = sum(size[n] for r in range(8) for n in after[r] - before[r])
    assert moves.nbytes == expected == minimal_bytes(model, old, new)
    for t in moves.transfers:
        assert t.src in la.roles[t.piece].holders  # from a current holder
        assert t.dst in lb.roles[t.piece].holders and t.dst not in la.roles[t.piece].holders
    assert len({(t.piece, t.dst) for t in moves.transfers}) == len(moves.transfers)


def test_nothing_moves_when_the_layout_stays() -> None:
    lay = Layout.from_plan(PLANS["three"], MODEL, 0, 8)
    assert plan_transfers(lay.roles, lay.roles, MODEL, 2, 4).transfers == ()


def test_a_sender_on_the_receivers_node_is_preferred() -> None:
    # Under "uniform" every piece is held on both nodes. When one node's ranks take the whole
    # model, every piece they lack must come from their own node.
    new = tc.plan([(12, [([3, 2], (0, 6))])], excluded=[0, 1, 4, 5, 6, 7])
    la = Layout.from_plan(PLANS["uniform"], MODEL, 0, 8)
    lb = Layout.from_plan(new, MODEL, 0, 8)
    moves = plan_transfers(la.roles, lb.roles, MODEL, 2, 4)
    assert moves.transfers and {t.src // 4 for t in moves.transfers} == {0}
    mirrored = tc.plan([(12, [([7, 6], (0, 6))])], excluded=[0, 1, 2, 3, 4, 5])
    moves = plan_transfers(la.roles, Layout.from_plan(mirrored, MODEL, 0, 8).roles, MODEL, 2, 4)
    assert {t.src // 4 for t in moves.transfers} == {1}


def test_bytes_are_balanced_across_senders() -> None:
    # Two full replicas of shard 0 on node 0 (ranks 0 and 1, one stage each); rank 2 needs it all.
    two = tc.plan([(6, [([0], (0, 6))]), (6, [([1], (0, 6))])], excluded=[2, 3, 4, 5, 6, 7], tp=1)
    one = tc.plan([(12, [([2], (0, 6))])], excluded=[0, 1, 3, 4, 5, 6, 7], tp=1)
    old, new = (Layout.from_plan(p, MODEL, 0, 8).roles for p in (two, one))
    sent = plan_transfers(old, new, MODEL, 1, 4).sent_bytes()
    assert set(sent) == {0, 1}
    biggest = max(_state_bytes(MODEL, tp=1).values())
    assert abs(sent[0] - sent[1]) <= biggest  # greedy: within one piece of even


def test_boundary_words_round_trip() -> None:
    b = Boundary(plan_bytes=1234, stop=2)
    assert Boundary.decode(b.words()) == b and b.stopping and b.checkpoint
    assert not Boundary().stopping


def test_stop_requests() -> None:
    stop = StopControl()
    assert stop.request(b'{"checkpoint": true}')[0] == 400  # no checkpoint directory
    assert stop.request(b'{"checkpoint": 1}')[0] == 400
    assert stop.request(b'{"now": true}')[0] == 400
    assert stop.code == 0
    assert stop.request(b"") == (202, {"stopping": True, "checkpoint": False})
    stop.can_checkpoint = True
    assert stop.request(b"{}") == (202, {"stopping": True, "checkpoint": True})
    assert stop.request(b'{"checkpoint": false}')[1]["checkpoint"] is True  # never downgraded


def test_switch_option_is_validated_before_anything_starts(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(sc.manifest(1, 2, layers=2)))
    files = {
        "good": sc.plan_dict((8, [([1, 0], 0, 2)])),
        "gap": sc.plan_dict((8, [([0, 1], 0, 1)])),
    }
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    good, gap = tmp_path / "good.json", tmp_path / "gap.json"

    def parse(*switch: str) -> argparse.Namespace:
        p = argparse.ArgumentParser()
        cli.add_arguments(p)
        extra = [x for s in switch for x in ("--switch", s)]
        return p.parse_args([str(job), "--plan", str(good), *extra, "--no-resource-check"])

    args = parse(f"3:{good}", f"1:{good}")
    inputs.load_inputs(args)
    assert [(s, p.generation) for s, p in args.switch_plans] == [(1, 1), (3, 2)]  # renumbered
    for spec, message in [
        (f"1:{gap}", r"layers end at 1; they must cover \[0, 2\)"),
        (f"0:{good}", "STEP >= 1"),
        ("2", "STEP:PLAN.json"),
        (f"2:{tmp_path / 'missing.json'}", "missing.json"),
    ]:
        with pytest.raises(BadInput, match=message):
            inputs.load_inputs(parse(spec))


def test_a_failed_rank_is_published_as_nan_not_dropped() -> None:
    # The controller reads a NaN rate as "unusable" and a missing series as "no sample".
    from malleus.controller.sources import observation_from_metrics
    from malleus.trainer.endpoint.metrics import TrainerMetrics

    m = TrainerMetrics("j", 0, 0)
    m.observe_step(3, 1.0, 10.0, 1.0, 0.5)
    m.observe_rates({0: 1.0, 1: math.nan, 2: None}, {0: 0, 1: 0, 2: 0})
    obs = observation_from_metrics(m.render().decode(), job="j")
    assert obs is not None and obs.rates == {0: 1.0, 1: None}  # rank 2: not measured yet

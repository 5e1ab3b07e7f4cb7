"""Ranks trust only what they can check (issue 25, item 3): attacks from a compromised rank.

- Code execution between ranks: torch.distributed's `*_object` collectives unpickled a peer's
  bytes, so a crafted pickle from GPU 1 ran code in GPU 0. Now every exchange carries JSON
  bytes (trainer/world/exchange.py): a 2-rank gloo job where GPU 1 sends an armed pickle into
  each former channel (a resume's verdicts, the starting plan, a checkpoint's file reports)
  shows the file it would create never appears and the receiver refuses, naming the GPU; a
  lie about a length is refused before anything is allocated; a rank cannot report another's
  piece as its own.
- Spoofed figures and control words: the step's world vector was an all-reduce SUM, so any rank
  could add to any other's slot and to the coordinator's control words (stop included). Now it
  is a gather of each rank's own row (`world_vector`): in the same job GPU 1 announces a stop
  as if it were the coordinator and nobody stops, while the real coordinator's stop still stops
  every rank; a pure test shows a forged row changes only its own slot.
- Nothing in the product calls a pickle-based collective or `torch.load` without
  `weights_only=True` (an AST walk, so a new one fails here).
"""

from __future__ import annotations

import ast
import json
import pickle
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import rank_attacks

from malleus.trainer.engine.step import OWN_WORDS, world_vector
from malleus.trainer.launch.spawn import spawn_local
from malleus.trainer.switching.protocol import STOP
from malleus.trainer.world.exchange import PayloadError, decode_json

REPO = Path(__file__).resolve().parents[2]


def test_the_payload_is_armed(tmp_path: Path) -> None:
    """The pickle the ranks send does run code when unpickled (so its absence below means
    something): here, unpickled on purpose, it creates its file."""
    marker = tmp_path / "ran"
    pickle.loads(rank_attacks.armed_pickle(str(marker)))  # the point of this test
    assert marker.exists()


@pytest.mark.timeout(180)
def test_a_compromised_rank_neither_runs_code_nor_speaks_for_another(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    spawn_local(2, rank_attacks.attack, (str(tmp_path), str(marker)))
    gpu0 = json.loads((tmp_path / "gpu0.json").read_text())
    gpu1 = json.loads((tmp_path / "gpu1.json").read_text())

    assert not marker.exists(), "a peer's pickle was unpickled"
    assert gpu0["verdicts"].startswith("CheckpointError")
    assert "GPU 1 sent" in gpu0["verdicts"] and "not UTF-8 JSON" in gpu0["verdicts"]
    assert "GPU 1 announced 1099511627776 bytes" in gpu0["oversize"]
    assert "refused before allocating" in gpu0["oversize"]
    assert gpu1["plan"].startswith("ValidationError")  # parsed as JSON, refused
    assert "GPU 1 sent" in gpu0["reports"] and "not UTF-8 JSON" in gpu0["reports"]
    assert "GPU 1 reported 'embed.weight'" in gpu0["report_claims"]
    assert "not its own" in gpu0["report_claims"]

    assert gpu0["forged_stop"] is False and gpu1["forged_stop"] is False
    assert gpu0["real_stop"] is True and gpu1["real_stop"] is True


def _row(grad2: float, loss: float, per_unit: float, compute: float, words: list[float]):
    return [grad2, loss, per_unit, compute, *words]


def test_a_row_speaks_only_for_its_own_slot_and_control_words_only_from_the_coordinator() -> None:
    honest = {
        0: _row(1.0, 2.0, 0.5, 3.0, [0.0, 0.0, 0.0]),
        1: _row(4.0, 0.0, 0.25, 6.0, [0.0, 0.0, 0.0]),
        2: _row(9.0, 5.0, 0.75, 9.0, [0.0, 0.0, 0.0]),
    }
    clean = world_vector(honest, 3, coordinator=0)
    assert clean == [14.0, 7.0, 0.5, 0.25, 0.75, 3.0, 6.0, 9.0, 0.0, 0.0, 0.0]
    # GPU 2 announces a plan of 999 bytes, a stop and a joiner, and claims huge figures: only
    # its own slots and its own share of the sums change; the control words stay GPU 0's.
    forged = dict(honest)
    forged[2] = _row(9.0, 5.0, 1e9, 1e9, [999.0, float(STOP), 1.0])
    got = world_vector(forged, 3, coordinator=0)
    assert got[:2] == clean[:2]
    assert got[2:4] == clean[2:4] and got[5:7] == clean[5:7]  # GPUs 0 and 1 untouched
    assert got[4] == 1e9 and got[7] == 1e9  # its own slots: what it says of itself
    assert got[8:] == [0.0, 0.0, 0.0]
    # The coordinator's words are read, wherever it is (after a recovery, say GPU 1).
    led = dict(honest)
    led[1] = _row(4.0, 0.0, 0.25, 6.0, [0.0, float(STOP), 0.0])
    assert world_vector(led, 3, coordinator=1)[8:] == [0.0, float(STOP), 0.0]
    assert world_vector(led, 3, coordinator=0)[8:] == [0.0, 0.0, 0.0]
    assert len(clean) == 2 + 2 * 3 + len(honest[0]) - OWN_WORDS


def test_sums_are_the_same_bits_whatever_order_the_rows_arrive_in() -> None:
    rows = {g: _row(0.1 * (g + 1) ** 3, 1 / (g + 3), 0.0, 0.0, [0.0]) for g in range(7)}
    backwards = dict(reversed(list(rows.items())))
    assert world_vector(rows, 7, 0) == world_vector(backwards, 7, 0)


def test_a_pickle_is_refused_not_decoded(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(PayloadError, match=r"GPU 3 sent \d+ bytes that are not UTF-8 JSON"):
        decode_json(rank_attacks.armed_pickle(str(marker)), 3, "a test")
    assert not marker.exists()


# ---- no pickle-based channel anywhere in the product ---------------------------------------
PRODUCT = [REPO / "trainer", REPO / "malleus", REPO / "operator"]
PICKLING_COLLECTIVES = {
    "broadcast_object_list",
    "gather_object",
    "all_gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}


def _offences(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
        owner = (
            fn.value.id if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) else ""
        )
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        where = f"{shown}:{node.lineno}"
        if name in PICKLING_COLLECTIVES:
            found.append(f"{where} calls {name} (pickles across ranks)")
        elif owner in ("pickle", "dill", "marshal") and name in ("load", "loads"):
            found.append(f"{where} calls {owner}.{name}")
        elif owner == "torch" and name == "load":
            weights_only = [k for k in node.keywords if k.arg == "weights_only"]
            if not (
                weights_only
                and isinstance(weights_only[0].value, ast.Constant)
                and weights_only[0].value.value is True
            ):
                found.append(f"{where} calls torch.load without weights_only=True")
    return found


def test_no_pickle_crosses_a_process_boundary() -> None:
    offences = [o for root in PRODUCT for p in sorted(root.rglob("*.py")) for o in _offences(p)]
    assert not offences, "\n".join(offences)


def test_the_walk_would_see_one(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle, torch\npickle.loads(b'')\ntorch.load('x')\n"
        "torch.load('y', weights_only=False)\ndist.all_gather_object(a, b)\n"
        "torch.load('z', weights_only=True)\n"
    )
    assert len(_offences(bad)) == 4, _offences(bad)

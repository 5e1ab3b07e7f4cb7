"""Migration between two plans: which pieces move from whom to whom, and moving them.

The planning half is pure (no process group): `plan_transfers` lists every (piece, sender,
receiver) a layout change needs, in one global order that every rank derives from the two plans
alone. A piece goes to each new holder that lacks it, from one of its current holders: a sender
on the receiver's node first, then the sender with the fewest bytes assigned so far, so the
volume is the minimum (`minimal_bytes`, computed independently from the planner's `holdings`)
and spread over the senders. A piece travels with its optimizer state: parameter, both Adam
moments and the step count, `3n + 1` elements, in the masters' dtype: under `precision: bf16`
the float32 master weights and Adam state move and each receiver derives its bf16 copies from
them (trainer/model/precision.py), so a switch changes no bit of the training state.

The executing half (`post` then `Exchange.wait`) packs, per (sender, receiver) pair, the pieces
in canonical order into one flat buffer and posts every pair in one `batch_isend_irecv`, so
nothing waits on anything before everything is posted: no ordering can deadlock.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod

import torch
import torch.distributed as dist
from torch import Tensor

from malleus.job import ModelConfig
from malleus.planner import Plan
from malleus.planner.memory import Unit, holdings
from malleus.trainer.model.decoder import param_specs, pieces
from malleus.trainer.world.errors import first_line
from malleus.trainer.world.world import World

from .layout import PieceRoles
from .optim import AdamState

__all__ = [
    "MIGRATE_TAG",
    "Exchange",
    "MigrationPlan",
    "Transfer",
    "TransferError",
    "minimal_bytes",
    "plan_transfers",
    "post",
    "state_elements",
    "unit_pieces",
]

MIGRATE_TAG = 3  # pipeline traffic uses 1 and 2
MASTER_BYTES = 4  # float32 masters and Adam state (float64 in tests: 8)


def state_elements(numel: int) -> int:
    """Elements a piece of `numel` parameters moves with: parameter, exp_avg, exp_avg_sq, step."""
    return 3 * numel + 1


@dataclass(frozen=True)
class Transfer:
    """One piece, with its optimizer state, from `src` to `dst`."""

    piece: str
    src: int
    dst: int
    shape: tuple[int, ...]
    element_bytes: int = MASTER_BYTES

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return state_elements(self.numel) * self.element_bytes


@dataclass(frozen=True)
class MigrationPlan:
    """Every transfer of one layout change, in the global order (by piece, then receiver)."""

    transfers: tuple[Transfer, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    @functools.cached_property
    def _by_pair(self) -> dict[tuple[int, int], list[Transfer]]:
        out: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
        for t in self.transfers:
            out[t.src, t.dst].append(t)
        return dict(sorted(out.items()))

    def pairs(self) -> list[tuple[int, int]]:
        """(src, dst) pairs that exchange anything, sorted: the order every rank posts them in."""
        return list(self._by_pair)

    def between(self, src: int, dst: int) -> list[Transfer]:
        """The transfers of one pair, in global order (the layout of its buffer)."""
        return self._by_pair.get((src, dst), [])

    def sent_bytes(self) -> dict[int, int]:
        """Bytes each sender sends."""
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            out[t.src] += t.nbytes
        return dict(out)


def plan_transfers(
    old: Mapping[str, PieceRoles],
    new: Mapping[str, PieceRoles],
    cfg: ModelConfig,
    tp: int,
    gpus_per_node: int,
    element_bytes: int = MASTER_BYTES,
) -> MigrationPlan:
    """The transfers from the holders of `old` to those of `new` (Layout.roles of two plans of
    a model cut into `tp` logical shards, state of `element_bytes` per element)."""
    load: dict[int, int] = defaultdict(int)  # bytes assigned to each sender so far
    out: list[Transfer] = []
    for piece in pieces(cfg, tp):
        before = old[piece.name].holders
        shape = piece.shape(tp)
        for dst in sorted(set(new[piece.name].holders) - set(before)):
            node = dst // gpus_per_node
            src = min(before, key=lambda r: (r // gpus_per_node != node, load[r], r))
            t = Transfer(piece.name, src, dst, shape, element_bytes)
            load[src] += t.nbytes
            out.append(t)
    return MigrationPlan(tuple(out))


# ---- the minimal volume, from the planner's holdings -----------------------------------------


def unit_pieces(cfg: ModelConfig, units: set[Unit], tp: int | None = None) -> set[str]:
    """The trainer's pieces behind a rank's planner units (`malleus.planner.cost.holdings`).

    A ("layer", L, s) unit is shard s of every sharded weight of layer L; holding any shard of a
    layer also means holding its (replicated) norms. An ("emb", 0, s) unit is `embed.weight@s`;
    a ("head", 0, s) unit is `head.weight@s` (`embed.weight@s` when tied: one piece, not two)
    plus the final norm. With fewer kv heads than `tp` (needed then) shard s holds the kv piece
    that serves it (`ParamSpec.piece_of`).
    """
    head = "embed.weight" if cfg.tied_embeddings else "head.weight"
    first = [spec for spec in param_specs(cfg) if spec.layer == 0]
    sharded = {
        spec.name.removeprefix("layers.0."): spec for spec in first if spec.split is not None
    }
    norms = {spec.name.removeprefix("layers.0.") for spec in first if spec.split is None}
    out: set[str] = set()
    for kind, layer, shard in units:
        if kind == "layer":
            out.update(
                f"layers.{layer}.{n}@{sp.piece_of(shard, tp) if tp else shard}"
                for n, sp in sharded.items()
            )
            out.update(f"layers.{layer}.{n}" for n in norms)
        elif kind == "emb":
            out.add(f"embed.weight@{shard}")
        elif kind == "head":
            out.update((f"{head}@{shard}", "norm.weight"))
        else:
            raise ValueError(f"unknown unit kind {kind!r}")
    return out


def minimal_bytes(cfg: ModelConfig, old: Plan, new: Plan, element_bytes: int = MASTER_BYTES) -> int:
    """Bytes a change from `old` to `new` must move at least: every piece (with its optimizer
    state) that a rank holds under `new` and did not hold under `old`, once per such rank."""
    tp = new.tp
    size = {p.name: state_elements(prod(p.shape(tp))) * element_bytes for p in pieces(cfg, tp)}
    before = holdings(old)
    total = 0
    for rank, units in holdings(new).items():
        lacking = unit_pieces(cfg, units, tp) - unit_pieces(cfg, before.get(rank, set()), tp)
        total += sum(size[n] for n in lacking)
    return total


# ---- execution -------------------------------------------------------------------------------


class TransferError(RuntimeError):
    """A transfer with `peer` failed (the peer died, or the wait timed out)."""

    def __init__(self, peer: int, what: str, cause: BaseException) -> None:
        self.peer = peer
        super().__init__(f"{what} rank {peer} failed: {first_line(cause)}")


def _pack(
    ts: list[Transfer], params: Mapping[str, Tensor], state: Mapping[str, AdamState]
) -> Tensor:
    parts: list[Tensor] = []
    for t in ts:
        p, st = params[t.piece].detach(), state[t.piece]
        step = torch.full((1,), float(st.step), dtype=p.dtype, device=p.device)
        parts += [p.reshape(-1), st.exp_avg.reshape(-1), st.exp_avg_sq.reshape(-1), step]
    return torch.cat(parts)  # (sum of 3n+1,) in the masters' dtype


def _unpack(ts: list[Transfer], buf: Tensor) -> dict[str, tuple[Tensor, AdamState]]:
    out: dict[str, tuple[Tensor, AdamState]] = {}
    o = 0
    for t in ts:
        n = t.numel
        p, m, v = (buf[o + i * n : o + (i + 1) * n].view(t.shape).clone() for i in range(3))
        out[t.piece] = (p, AdamState(m, v, round(float(buf[o + 3 * n]))))
        o += 3 * n + 1
    return out


class Exchange:
    """The posted transfers of one rank; `wait` completes them and returns what arrived."""

    def __init__(
        self,
        ops: list[tuple[str, int, list[Transfer], Tensor]],
        works: list[object],
        world: World,
    ) -> None:
        self._ops, self._works, self._world = ops, works, world
        self.sent_bytes = sum(b.numel() * b.element_size() for k, _, _, b in ops if k == "send")
        self.received_bytes = sum(b.numel() * b.element_size() for k, _, _, b in ops if k == "recv")

    def wait(self, timeout_s: float) -> dict[str, tuple[Tensor, AdamState]]:
        """Piece name -> (parameter, Adam state) for every piece received. Raises TransferError
        naming the peer when a transfer fails or does not complete within `timeout_s`; waited
        for through the World (`wait_p2p`), so that a peer known dead or stopped by its
        heartbeat ends the wait in seconds, not at the timeout."""
        deadline = time.monotonic() + timeout_s
        for (kind, peer, _, _), work in zip(self._ops, self._works, strict=True):
            try:
                self._world.wait_p2p([work], max(0.0, deadline - time.monotonic()))
            except (RuntimeError, TimeoutError) as e:
                what = "sending to" if kind == "send" else "receiving from"
                raise TransferError(peer, what, e) from e
        out: dict[str, tuple[Tensor, AdamState]] = {}
        for kind, _, ts, buf in self._ops:
            if kind == "recv":
                out.update(_unpack(ts, buf))
        self._ops, self._works = [], []  # the buffers go now
        return out


def post(
    plan: MigrationPlan,
    rank: int,
    params: Mapping[str, Tensor],
    state: Mapping[str, AdamState],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    world: World,
) -> Exchange:
    """Post this rank's sends and receives of `plan`, all at once, in the global pair order;
    `dtype` is the masters' (every rank's pieces and Adam state share it); `world` translates
    the peers' GPU ids to process-group ranks."""
    ops: list[tuple[str, int, list[Transfer], Tensor]] = []
    p2p: list[dist.P2POp] = []
    for src, dst in plan.pairs():
        if rank not in (src, dst):
            continue
        ts = plan.between(src, dst)
        if src == rank:
            buf = _pack(ts, params, state)
            ops.append(("send", dst, ts, buf))
            p2p.append(dist.P2POp(dist.isend, buf, world.pg(dst), tag=MIGRATE_TAG))
        else:
            buf = torch.empty(sum(state_elements(t.numel) for t in ts), dtype=dtype, device=device)
            ops.append(("recv", src, ts, buf))
            p2p.append(dist.P2POp(dist.irecv, buf, world.pg(src), tag=MIGRATE_TAG))
    works = list(dist.batch_isend_irecv(p2p)) if p2p else []
    return Exchange(ops, works, world)

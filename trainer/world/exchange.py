"""What ranks hand each other besides model tensors: bytes that are data, never code.

torch.distributed's `*_object` collectives (`broadcast_object_list`, `gather_object`,
`all_gather_object`) pickle what they send and unpickle what they receive, and unpickling runs
whatever the bytes name: a rank that can put bytes into such a collective (a compromised worker,
or anyone who took a seat through the rendezvous store) runs code in every rank that receives
them. So nothing here unpickles anything: a payload is bytes in a `uint8` tensor, announced by
a length word first so that every receiver allocates only what the size bound allows, and the
callers send JSON (`encode_json`, `decode_json`) or plain tensors. Bytes that are not UTF-8
JSON, and lengths past the bound, are refused with `PayloadError`, naming the GPU they came
from; every rank sees the same lengths, so the honest ranks refuse together.

`rows`: each rank's own row of figures, gathered (not summed): whoever sent a row speaks only
for its own slot (the step's world vector, trainer/engine/trainer.py; the calibration,
trainer/engine/calibrator.py).

GPU ids throughout (the plan's ranks); the translation to process-group ranks is the World's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .world import World

__all__ = [
    "MAX_PAYLOAD_BYTES",
    "PayloadError",
    "all_gather_bytes",
    "broadcast_bytes",
    "decode_json",
    "encode_json",
    "gather_bytes",
    "members",
    "rows",
]

MAX_PAYLOAD_BYTES = 256 << 20
"""The most bytes one exchange makes a rank allocate: all senders' buffers together, each as
long as the longest (a gather pads to one length). A plan is at most 1 MiB (the control
endpoint's body bound); a resume's verdict is under 1 KiB per rank and a checkpoint's report a
few hundred bytes per piece the rank owns, so even 65,536 ranks stay well below: only a lie about
a length reaches it."""


class PayloadError(ValueError):
    """A peer's payload this rank will not decode: past the size bound, or not UTF-8 JSON of
    the expected shape. The message names the GPU it came from and what it was for."""


def members(world: World) -> tuple[int, ...]:
    """The GPU ids of the process group's ranks, in process-group order."""
    current = world.current
    if current is not None:
        return current.members
    return tuple(range(dist.get_world_size()))


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def decode_json(data: bytes, gpu: int, what: str) -> Any:
    """`data` as JSON; PayloadError naming `gpu` and `what` for anything else (a pickle
    included: it is never unpickled, only refused)."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        head = data[:16]
        raise PayloadError(
            f"{what}: GPU {gpu} sent {len(data)} bytes that are not UTF-8 JSON "
            f"(starting {head!r}; {type(e).__name__}); refused, nothing was decoded"
        ) from None


def _check_lengths(lengths: Sequence[int], gpus: Sequence[int], what: str, limit: int) -> int:
    """The longest of `lengths` (one per GPU of `gpus`), refused when negative or when every
    sender's buffer at that length together would pass `limit`."""
    longest = max(lengths, default=0)
    for gpu, n in zip(gpus, lengths, strict=True):
        if n < 0 or n * len(lengths) > limit:
            raise PayloadError(
                f"{what}: GPU {gpu} announced {n} bytes; at most {limit // max(1, len(lengths))} "
                f"per rank ({limit} in all) are taken: refused before allocating"
            )
    return longest


def broadcast_bytes(
    payload: bytes | None,
    *,
    world: World,
    device: torch.device,
    what: str,
    length: int | None = None,
    limit: int = MAX_PAYLOAD_BYTES,
) -> bytes:
    """Collective: the coordinator's `payload` on every rank (the coordinator passes it; the
    others pass None). `length`: the payload's length when every rank already learnt it (the
    step's control words); else a length word goes first."""
    source = world.coordinator()
    src = world.pg(source)
    sending = dist.get_rank() == src
    if sending and payload is None:
        raise ValueError(f"{what}: the coordinator (GPU {source}) has no payload to send")
    data = payload if sending and payload is not None else b""
    if length is None:
        word = torch.tensor([len(data)], dtype=torch.int64, device=device)
        world.wait(dist.broadcast(word, src=src, async_op=True))
        length = int(word.item())
    _check_lengths([length], [source], what, limit)
    if sending and len(data) != length:
        raise ValueError(f"{what}: {len(data)} bytes to send, {length} announced")
    buf = _padded(data, length, device)
    world.wait(dist.broadcast(buf, src=src, async_op=True))
    return data if sending else buf.cpu().numpy().tobytes()


def _lengths(payload: bytes, device: torch.device, world: World) -> list[int]:
    mine = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    world.wait(dist.all_gather(out, mine, async_op=True))
    return [int(t.item()) for t in out]


def _padded(payload: bytes, longest: int, device: torch.device) -> Tensor:
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buf


def all_gather_bytes(
    payload: bytes,
    *,
    world: World,
    device: torch.device,
    what: str,
    limit: int = MAX_PAYLOAD_BYTES,
) -> dict[int, bytes]:
    """Collective: every rank's `payload`, by GPU id, on every rank."""
    gpus = members(world)
    lengths = _lengths(payload, device, world)
    longest = _check_lengths(lengths, gpus, what, limit)
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in gpus]
    world.wait(dist.all_gather(out, _padded(payload, longest, device), async_op=True))
    return {
        g: out[i][:n].cpu().numpy().tobytes()
        for i, (g, n) in enumerate(zip(gpus, lengths, strict=True))
    }


def gather_bytes(
    payload: bytes,
    dst: int,
    *,
    world: World,
    device: torch.device,
    what: str,
    limit: int = MAX_PAYLOAD_BYTES,
) -> dict[int, bytes] | None:
    """Collective: every rank's `payload`, by GPU id, on GPU `dst`; None elsewhere. Every rank
    learns the lengths first, so a length past the bound is refused by all ranks alike."""
    gpus = members(world)
    lengths = _lengths(payload, device, world)
    longest = _check_lengths(lengths, gpus, what, limit)
    here = dist.get_rank() == world.pg(dst)
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in gpus] if here else None
    world.wait(
        dist.gather(_padded(payload, longest, device), out, dst=world.pg(dst), async_op=True)
    )
    if out is None:
        return None
    return {
        g: out[i][:n].cpu().numpy().tobytes()
        for i, (g, n) in enumerate(zip(gpus, lengths, strict=True))
    }


def rows(row: Tensor, world: World) -> dict[int, Tensor]:
    """Collective: every rank's `row` (one shape and dtype on all), by GPU id. A gather, not a
    sum: what a rank sends lands in its own row only, so no rank can add to another's figures;
    whoever reads a slot takes it from the row of the GPU it belongs to."""
    gpus = members(world)
    out = [torch.empty_like(row) for _ in gpus]
    world.wait(dist.all_gather(out, row.contiguous(), async_op=True))
    return dict(zip(gpus, out, strict=True))

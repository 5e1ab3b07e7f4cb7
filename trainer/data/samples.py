"""Training samples as a pure function of (seed, global sample index).

Step s consumes samples s*global_batch .. (s+1)*global_batch-1; micro-batch j of the step (j
counts across all pipelines, pipeline i taking the j's after those of pipelines < i) holds
samples s*global_batch + j*micro_batch + r. Nothing depends on the plan or on which rank asks,
so any two plans see the same data and a resumed job continues where it stopped.

The user's own data (`spec.training.data`, docs/data.md) is one stream of token ids (a
memory-mapped token file, the packed `input_ids` of an hf-dataset folder, or tokenized text)
cut into windows of sequence + 1 tokens that start every `sequence` tokens; each epoch visits
every window once, in an order drawn from (seed, epoch). The files were judged before the
trainers started (`malleus.job.data`); a window holding an id outside the vocabulary is refused
here too, since only a sample of the file was checked.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from malleus.job.data import arrow_chunks, text_files
from malleus.job.spec import DataSpec

__all__ = [
    "CORPUS_PATH",
    "CorpusSource",
    "SampleSource",
    "SyntheticSource",
    "TokenStream",
    "WindowSource",
    "make_source",
    "micro_batch",
    "open_stream",
    "sample_index",
]

CORPUS_PATH = Path(__file__).resolve().parent / "tiny_corpus.txt"
_MASK64 = (1 << 64) - 1
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def _mix(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): a cheap, well-spread, platform-independent hash."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class SampleSource(Protocol):
    def sample(self, index: int) -> Tensor:
        """Tokens of one sample: (T + 1,) int64, inputs [:-1] and targets [1:]."""
        ...


class CorpusSource:
    """Windows of the shipped byte-level corpus (vocabulary 256) at hashed offsets."""

    def __init__(self, sequence: int, seed: int, path: Path = CORPUS_PATH) -> None:
        data = path.read_bytes()
        if len(data) < sequence + 2:
            raise ValueError(f"corpus {path} ({len(data)} bytes) is shorter than a sample")
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
        self.sequence, self.seed = sequence, seed
        self.span = len(data) - sequence - 1

    def sample(self, index: int) -> Tensor:
        start = _mix(self.seed, index) % self.span
        return self.tokens[start : start + self.sequence + 1]


class SyntheticSource:
    """Random short motifs repeated over the window: learnable, so the loss still falls."""

    def __init__(self, sequence: int, vocab: int, seed: int) -> None:
        self.sequence, self.vocab, self.seed = sequence, vocab, seed

    def sample(self, index: int) -> Tensor:
        g = torch.Generator().manual_seed(_mix(self.seed, index) % 2**62)
        period = int(torch.randint(2, 9, (1,), generator=g))
        motif = torch.randint(0, self.vocab, (period,), generator=g)
        return motif.repeat(self.sequence // period + 2)[: self.sequence + 1]


def _permute(index: int, n: int, key: int) -> int:
    """A bijection of range(n) keyed by `key`: a 4-round Feistel network over the smallest
    even-bit power of two >= n, walked until it lands inside (fewer than 4 rounds expected)."""
    if n == 1:
        return 0
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    mask = (1 << half) - 1
    x = index
    while True:
        left, right = x >> half, x & mask
        for round_ in range(4):
            left, right = right, left ^ (_mix(key, (round_ << 40) | right) & mask)
        x = (left << half) | right
        if x < n:
            return x


class TokenStream:
    """Token ids stored as segments (a memory map, arrow buffers, arrays), read by position
    without ever loading the whole stream."""

    def __init__(self, segments: Sequence[np.ndarray], label: str) -> None:
        self.segments = [s for s in segments if len(s)]
        self.starts: list[int] = []
        total = 0
        for segment in self.segments:
            self.starts.append(total)
            total += len(segment)
        self.length, self.label = total, label

    def __len__(self) -> int:
        return self.length

    def read(self, start: int, count: int) -> np.ndarray:
        """Ids [start, start + count) as int64."""
        out = np.empty(count, dtype=np.int64)
        at = 0
        i = bisect.bisect_right(self.starts, start) - 1
        while at < count:
            segment, first = self.segments[i], self.starts[i]
            lo = start + at - first
            take = min(count - at, len(segment) - lo)
            out[at : at + take] = segment[lo : lo + take]
            at += take
            i += 1
        return out


def open_stream(data: DataSpec) -> TokenStream:
    """The token stream `data` names (files already judged by `malleus.job.data`)."""
    path = Path(data.path)
    if data.format == "tokens":
        return TokenStream([np.memmap(path, dtype=_DTYPES[data.dtype], mode="r")], str(path))
    if data.format == "hf-dataset":
        chunks = arrow_chunks(path, data.column)
        return TokenStream([c.to_numpy(zero_copy_only=True) for c in chunks], str(path))
    from .prepare import Encoder

    if data.tokenizer is None:
        raise ValueError("spec.training.data.tokenizer is required for format text")
    ids = list(Encoder(data.tokenizer).encode(text_files(path)))
    return TokenStream([np.concatenate(ids)] if ids else [], str(path))


class WindowSource:
    """Windows of sequence + 1 tokens starting every `sequence` tokens of a stream; epoch e
    visits all of them in the order `_permute(., windows, key(seed, e))`."""

    def __init__(self, stream: TokenStream, sequence: int, vocab: int, seed: int) -> None:
        self.stream, self.sequence, self.vocab, self.seed = stream, sequence, vocab, seed
        self.windows = (len(stream) - 1) // sequence
        if self.windows < 1:
            raise ValueError(
                f"{stream.label} holds {len(stream):,} tokens; one sample needs "
                f"sequence + 1 = {sequence + 1}"
            )

    def window(self, index: int) -> int:
        """Which window sample `index` is."""
        epoch, position = divmod(index, self.windows)
        return _permute(position, self.windows, _mix(self.seed, epoch))

    def sample(self, index: int) -> Tensor:
        start = self.window(index) * self.sequence
        ids = self.stream.read(start, self.sequence + 1)
        top = int(ids.max())
        if top >= self.vocab:
            at = start + int(ids.argmax())
            raise ValueError(
                f"{self.stream.label}: token id {top} at token {at:,} is >= the model's "
                f"vocabulary ({self.vocab})"
            )
        return torch.from_numpy(ids)


def make_source(
    dataset: str, sequence: int, vocab: int, seed: int, data: DataSpec | None = None
) -> SampleSource:
    """The job's samples: its own `data` when given, else the built-in `dataset`."""
    if data is not None:
        return WindowSource(open_stream(data), sequence, vocab, seed)
    if dataset == "tiny-corpus":
        if vocab < 256:
            raise ValueError(f"tiny-corpus is byte-level and needs vocab >= 256, got {vocab}")
        return CorpusSource(sequence, seed)
    if dataset == "synthetic":
        return SyntheticSource(sequence, vocab, seed)
    raise ValueError(f"unknown dataset {dataset!r} (allowed: tiny-corpus, synthetic)")


def sample_index(step: int, micro: int, row: int, global_batch: int, micro_batch: int) -> int:
    """Global index of row `row` of micro-batch `micro` (counted over the whole step)."""
    return step * global_batch + micro * micro_batch + row


def micro_batch(
    source: SampleSource, step: int, micro: int, global_batch: int, micro_batch_size: int
) -> tuple[Tensor, Tensor]:
    """Inputs and targets of one micro-batch, each (b, T) int64."""
    rows = [
        source.sample(sample_index(step, micro, r, global_batch, micro_batch_size))
        for r in range(micro_batch_size)
    ]
    batch = torch.stack(rows)  # (b, T + 1)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

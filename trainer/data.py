"""Training samples as a pure function of (seed, global sample index).

Step s consumes samples s*global_batch .. (s+1)*global_batch-1; micro-batch j of the step (j
counts across all pipelines, pipeline i taking the j's after those of pipelines < i) holds
samples s*global_batch + j*micro_batch + r. Nothing depends on the plan or on which rank asks,
so any two plans see the same data and a resumed job continues where it stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

__all__ = [
    "CORPUS_PATH",
    "CorpusSource",
    "SampleSource",
    "SyntheticSource",
    "make_source",
    "micro_batch",
    "sample_index",
]

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"
_MASK64 = (1 << 64) - 1


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


def make_source(dataset: str, sequence: int, vocab: int, seed: int) -> SampleSource:
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

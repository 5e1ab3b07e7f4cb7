"""Real data files for the data tests: token files, `save_to_disk` folders, a trained tokenizer.

Not collected by pytest (no test_ prefix). Everything is made here, small, in a temporary folder:
the hf-dataset folders by `datasets` itself, the tokenizer by `tokenizers`' own BPE trainer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from malleus.trainer.data.samples import CORPUS_PATH

__all__ = [
    "EOS",
    "corpus_tokens",
    "data_job",
    "make_tokenizer",
    "save_dataset",
    "write_tokens",
]

EOS = "<|endoftext|>"


def corpus_tokens(count: int) -> np.ndarray:
    """The first `count` bytes of the shipped corpus as token ids: learnable, vocabulary 256."""
    return np.frombuffer(CORPUS_PATH.read_bytes()[:count], dtype=np.uint8).astype(np.int64)


def write_tokens(path: Path, ids: np.ndarray | list[int], dtype: str = "uint16") -> Path:
    """The `tokens` format: flat little-endian ids."""
    path.write_bytes(np.asarray(ids).astype("<u2" if dtype == "uint16" else "<u4").tobytes())
    return path


def save_dataset(folder: Path, rows: list[list[int]], *, shards: int = 1, **columns: Any) -> Path:
    """A folder written by `datasets.Dataset.save_to_disk`, `input_ids` plus any other columns."""
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": rows, **columns})
    ds.save_to_disk(str(folder), num_shards=shards)
    return folder


def make_tokenizer(folder: Path, vocab: int = 300) -> Path:
    """A byte-level BPE tokenizer trained on the corpus (tokenizer.json), with an end-of-text
    token named in tokenizer_config.json as Hugging Face model folders do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS_PATH.read_text()[:20000]], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return folder


def data_job(
    data: dict[str, Any] | None,
    *,
    vocab: int = 256,
    sequence: int = 16,
    gpus: int = 2,
    steps: int = 4,
) -> dict[str, Any]:
    """A small MalleusJob (tp 2, global batch 4) reading `spec.training.data`."""
    training: dict[str, Any] = {
        "globalBatchSize": 4,
        "microBatchSize": 1,
        "steps": steps,
        "learningRate": 0.003,
        "warmupSteps": 1,
    }
    if data is not None:
        training["data"] = data
    return {
        "apiVersion": "malleus.io/v1alpha1",
        "kind": "MalleusJob",
        "metadata": {"name": "data-test"},
        "spec": {
            "image": "malleus:test",
            "nodes": 1,
            "gpusPerNode": gpus,
            "model": {
                "layers": 2,
                "hidden": 32,
                "heads": 4,
                "ffn": 64,
                "vocab": vocab,
                "sequence": sequence,
            },
            "training": training,
            "parallelism": {"tp": 2},
        },
    }

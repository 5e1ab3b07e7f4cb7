"""The job's data judged before any trainer starts: the spec alone, then the files themselves.

`data_faults` needs no files and runs wherever a job is resolved (the operator too).
`data_file_faults` opens the files `spec.training.data` names, so it runs only where they are:
`malleus check`, `malleus run` and `malleus train` before starting anything, and every trainer
again at its start (in a pod, the data volume is mounted there and nowhere else: the operator
cannot see it). Checks stay cheap on files of any size: sizes and headers are read, token ids
only on a sample, and a fault says when it was a sample. Standard library only, except the
arrow files of an `hf-dataset`, which need pyarrow (the trainer extra).
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from malleus.errors import Fault

from .contained import contained
from .hf import shown
from .spec import DataSpec, TrainingSpec

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "BYTE_VOCAB",
    "DTYPE_BYTES",
    "SAMPLE_TOKENS",
    "TEXT_SUFFIXES",
    "arrow_chunks",
    "data_faults",
    "data_file_faults",
    "max_token_id",
    "sample_spans",
    "text_files",
    "tokenizer_vocab",
]

BYTE_VOCAB = 256
"""The vocabulary of the shipped byte-level corpus."""
DTYPE_BYTES = {"uint16": 2, "uint32": 4}
SAMPLE_TOKENS = 1 << 20
"""Token ids read to check against the model's vocabulary (spread over the file)."""
_BLOCKS = 64
TEXT_SUFFIXES = (".txt", ".jsonl")
_WHERE = "spec.training.data"


def data_faults(training: TrainingSpec, vocab: int) -> list[Fault]:
    """What the spec alone says is wrong with the data (no file is opened)."""
    if training.data is None and training.dataset == "tiny-corpus" and vocab < BYTE_VOCAB:
        return [
            Fault(
                "spec.training.dataset",
                f"tiny-corpus is byte-level and needs spec.model.vocab >= {BYTE_VOCAB}, got {vocab}",
            )
        ]
    return []


def data_file_faults(training: TrainingSpec, vocab: int, sequence: int) -> list[Fault]:
    """Every fault of the files `spec.training.data` names; empty for the built-in datasets."""
    data = training.data
    if data is None:
        return []
    check = {"tokens": _token_file, "hf-dataset": _hf_dataset, "text": _text}[data.format]
    return check(data, vocab, sequence)


# -- tokens -------------------------------------------------------------------------------------


def _token_file(data: DataSpec, vocab: int, sequence: int) -> list[Fault]:
    path = Path(data.path)
    missing = _missing(path, f"{_WHERE}.path", want_dir=False)
    if missing:
        return missing
    size, width = path.stat().st_size, DTYPE_BYTES[data.dtype]
    if size % width:
        return [
            Fault(
                f"{_WHERE}.dtype",
                f"{path} holds {size:,} bytes, not a whole number of {data.dtype} token ids "
                f"({width} bytes each): is the file {_other_dtype(data.dtype)}?",
            )
        ]
    tokens = size // width
    if tokens < sequence + 1:
        return [_too_short(path, tokens, sequence)]
    found = max_token_id(path, data.dtype, tokens)
    return _vocab_faults(path, found, vocab, tokens)


def _other_dtype(dtype: str) -> str:
    return "uint32" if dtype == "uint16" else "uint16 or not token ids at all"


def sample_spans(tokens: int) -> Iterator[tuple[int, int]]:
    """(start, count) blocks covering `tokens` ids, or `SAMPLE_TOKENS` of them spread evenly."""
    if tokens <= SAMPLE_TOKENS:
        yield 0, tokens
        return
    block = SAMPLE_TOKENS // _BLOCKS
    for i in range(_BLOCKS):  # first and last block included
        yield (tokens - block) * i // (_BLOCKS - 1), block


def max_token_id(path: Path, dtype: str, tokens: int) -> tuple[int, int]:
    """(largest id, its offset) over the sample of a token file that `sample_spans` reads."""
    best = (-1, -1)
    width = DTYPE_BYTES[dtype]
    with path.open("rb") as f:
        for start, count in sample_spans(tokens):
            f.seek(start * width)
            ids = array("H" if width == 2 else "I")
            ids.frombytes(f.read(count * width))
            if sys.byteorder == "big":  # the files are little-endian
                ids.byteswap()
            top = max(ids)
            if top > best[0]:
                best = (top, start + ids.index(top))
    return best


def _vocab_faults(path: Path, found: tuple[int, int], vocab: int, tokens: int) -> list[Fault]:
    top, offset = found
    if top < vocab:
        return []
    checked = min(tokens, SAMPLE_TOKENS)
    scope = (
        "every token checked"
        if checked == tokens
        else f"found in a sample of {checked:,} of its {tokens:,} tokens; there may be more"
    )
    return [
        Fault(
            f"{_WHERE}.path",
            f"{path}: token id {top} at token {offset:,} is >= the model's vocabulary "
            f"({vocab}) ({scope}); was it written by another tokenizer?",
        )
    ]


def _too_short(path: Path, tokens: int, sequence: int) -> Fault:
    return Fault(
        f"{_WHERE}.path",
        f"{path} holds {tokens:,} tokens; one sample needs sequence + 1 = {sequence + 1}",
    )


def _missing(path: Path, where: str, *, want_dir: bool) -> list[Fault]:
    if not path.exists():
        return [Fault(where, f"{shown(path)}: no such {'folder' if want_dir else 'file'}")]
    if want_dir and not path.is_dir():
        return [Fault(where, f"{path} is a file, expected a folder")]
    if not want_dir and path.is_dir():
        return [Fault(where, f"{path} is a folder, expected a file of token ids")]
    return []


# -- hf-dataset ---------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _hf_dataset(data: DataSpec, vocab: int, sequence: int) -> list[Fault]:
    folder = Path(data.path)
    missing = _missing(folder, f"{_WHERE}.path", want_dir=True)
    if missing:
        return missing
    if (folder / "dataset_dict.json").exists():
        splits = ", ".join(sorted(p.name for p in folder.iterdir() if p.is_dir()))
        return [
            Fault(
                f"{_WHERE}.path",
                f"{folder} holds a DatasetDict; point path at one of its splits ({splits})",
            )
        ]
    for name in ("state.json", "dataset_info.json"):
        if not (folder / name).is_file():
            return [
                Fault(
                    f"{_WHERE}.path",
                    f"{folder} has no {name}: not a folder written by datasets' save_to_disk",
                )
            ]
    features = _read_json(folder / "dataset_info.json").get("features") or {}
    feature = features.get(data.column)
    if feature is None:
        return [
            Fault(
                f"{_WHERE}.column",
                f"{folder} has no column {data.column!r}; its columns: "
                f"{', '.join(features) or 'none'}",
            )
        ]
    inner = feature.get("feature") or {}
    if feature.get("_type") not in ("List", "Sequence", "LargeList") or "int" not in str(
        inner.get("dtype", "")
    ):
        return [
            Fault(
                f"{_WHERE}.column",
                f"column {data.column!r} of {folder} is {_describe(feature)}, "
                "expected lists of integer token ids",
            )
        ]
    try:
        chunks = arrow_chunks(folder, data.column)
    except ImportError:
        return [Fault(f"{_WHERE}.format", "reading hf-dataset needs pyarrow: malleus[trainer]")]
    except (OSError, ValueError) as error:
        return [Fault(f"{_WHERE}.path", f"{folder}: cannot read its arrow files: {error}")]
    tokens = sum(len(c) for c in chunks)
    if tokens < sequence + 1:
        return [_too_short(folder, tokens, sequence)]
    return _vocab_faults(folder, _max_in_chunks(chunks, tokens), vocab, tokens)


def _describe(feature: dict[str, Any]) -> str:
    if feature.get("_type") == "Value":
        return str(feature.get("dtype"))
    return str(feature.get("_type", "unknown"))


def arrow_chunks(folder: Path, column: str) -> list[pa.Array]:
    """The flat token ids of `column`, one memory-mapped array per record batch, in row order
    (the files `state.json` lists, in its order): never read whole."""
    import pyarrow as pa

    state = folder / "state.json"
    files = [
        contained(folder, f.get("filename") if isinstance(f, dict) else f, state, "_data_files")
        for f in _data_files(state)
    ]
    chunks = []
    for file in files:
        reader = pa.ipc.open_stream(pa.memory_map(str(file)))
        index = reader.schema.get_field_index(column)
        if index < 0:
            raise ValueError(f"{file.name} has no column {column!r}")
        for batch in reader:
            values = batch.column(index).flatten()  # honours the list offsets; zero-copy
            if len(values):
                chunks.append(values)
    return chunks


def _data_files(state: Path) -> list[Any]:
    """`state.json`'s `_data_files` list; ValueError naming the file when it has none."""
    data = _read_json(state)
    listed = data.get("_data_files") if isinstance(data, dict) else None
    if not isinstance(listed, list):
        raise ValueError(f"{state}: no _data_files list")
    return listed


def _max_in_chunks(chunks: list[pa.Array], tokens: int) -> tuple[int, int]:
    """(largest id, its offset in the packed stream) over a `sample_spans` sample."""
    import pyarrow.compute as pc

    starts, at = [], 0
    for chunk in chunks:
        starts.append(at)
        at += len(chunk)
    best = (-1, -1)
    for start, count in sample_spans(tokens):
        for first, chunk in zip(starts, chunks, strict=True):
            lo, hi = max(start, first), min(start + count, first + len(chunk))
            if lo >= hi:
                continue
            part = chunk.slice(lo - first, hi - lo)
            top = pc.max(part).as_py()
            if top > best[0]:
                best = (top, lo + pc.index(part, top).as_py())
    return best


# -- text ---------------------------------------------------------------------------------------


def text_files(path: Path) -> list[Path]:
    """The .txt / .jsonl files of `path` (itself, or a folder's, sorted by name)."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in TEXT_SUFFIXES and p.is_file())
    return [path]


def tokenizer_vocab(folder: Path) -> int:
    """Ids a tokenizer.json can produce (largest id + 1), read from the JSON itself."""
    spec = _read_json(folder / "tokenizer.json")
    vocab = (spec.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]
    ids += [t["id"] for t in spec.get("added_tokens") or []]
    return max(ids, default=-1) + 1


def _text(data: DataSpec, vocab: int, sequence: int) -> list[Fault]:
    path, faults = Path(data.path), []
    if not path.exists():
        faults.append(Fault(f"{_WHERE}.path", f"{shown(path)}: no such file or folder"))
    elif not (files := text_files(path)):
        faults.append(Fault(f"{_WHERE}.path", f"{path} holds no .txt or .jsonl file"))
    elif bad := [f for f in files if f.suffix not in TEXT_SUFFIXES]:
        faults.append(Fault(f"{_WHERE}.path", f"{bad[0]} is neither .txt nor .jsonl"))
    else:
        faults += [f for f in map(_jsonl_fault, files) if f is not None]
    if data.tokenizer is None:  # the CRD requires it; a job built in code may lack it
        return [*faults, Fault(f"{_WHERE}.tokenizer", "required for format text")]
    folder = Path(data.tokenizer)
    if not folder.exists():
        return [*faults, Fault(f"{_WHERE}.tokenizer", f"{shown(folder)}: no such folder")]
    if not folder.is_dir():
        why = f"{shown(folder)} is a file: name the folder that holds tokenizer.json"
        if folder.name == "tokenizer.json":
            why += f", {folder.parent}"
        return [*faults, Fault(f"{_WHERE}.tokenizer", why)]
    if not (folder / "tokenizer.json").is_file():
        return [*faults, Fault(f"{_WHERE}.tokenizer", f"{folder} holds no tokenizer.json")]
    try:
        ids = tokenizer_vocab(folder)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return [*faults, Fault(f"{_WHERE}.tokenizer", f"{folder}/tokenizer.json: {error}")]
    if ids > vocab:
        faults.append(
            Fault(
                f"{_WHERE}.tokenizer",
                f"the tokenizer in {folder} has {ids:,} token ids, more than the model's "
                f"vocabulary ({vocab:,})",
            )
        )
    return faults


def _jsonl_fault(file: Path) -> Fault | None:
    """A .jsonl file's first line must be an object with a string "text" (the rest is judged
    while tokenizing, with its line number)."""
    if file.suffix != ".jsonl":
        return None
    with file.open(encoding="utf-8") as f:
        first = f.readline()
    try:
        record = json.loads(first)
    except json.JSONDecodeError as error:
        return Fault(f"{_WHERE}.path", f"{file} line 1 is not JSON: {error.msg}")
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        return Fault(f"{_WHERE}.path", f'{file} line 1 has no string field "text"')
    return None

"""Text to token ids with a Hugging Face `tokenizer.json`, and `malleus data prepare`.

Importing it is cheap (the `malleus` command builds its parser from it): numpy and tokenizers
load when something runs.

The `text` data format tokenizes its files when a trainer starts (every rank, in memory): right
for a few megabytes. For more, `malleus data prepare --tokenizer DIR INPUT... -o OUT.bin` writes
the `tokens` format once (streaming, with progress), and the job points at the file.

Documents are a .jsonl file's records (their "text" field) and whole .txt files. Each is encoded
without the tokenizer's added special tokens (a long .txt is encoded in pieces of whole lines,
which a BOS per piece would break) and followed by the end-of-text id when the folder's
tokenizer_config.json names an `eos_token`, so packed windows can tell documents apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from malleus.errors import BadInput, Fault
from malleus.job.data import TEXT_SUFFIXES, text_files, tokenizer_vocab

if TYPE_CHECKING:
    import numpy as np
    from tokenizers import Tokenizer

__all__ = ["Encoder", "add_arguments", "main", "prepare"]

_PIECE_BYTES = 1 << 18  # a long .txt is encoded this many bytes (whole lines) at a time
_BATCH = 8  # pieces per encode_batch call (run on the tokenizer's threads); progress after each
_DTYPES = {"uint16": "<u2", "uint32": "<u4"}  # the tokens format is little-endian


def _eos_id(folder: Path, tokenizer: Tokenizer) -> int | None:
    """The id of tokenizer_config.json's `eos_token`, if the folder names one."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    if isinstance(eos, dict):  # {"content": "</s>", ...} in older configs
        eos = eos.get("content")
    return tokenizer.token_to_id(eos) if isinstance(eos, str) else None


class Encoder:
    """A folder's tokenizer.json and end-of-text id, applied to text files."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        self.tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        self.eos = _eos_id(self.folder, self.tokenizer)
        self.vocab = tokenizer_vocab(self.folder)

    def encode(
        self, files: list[Path], progress: Callable[[int], None] | None = None
    ) -> Iterator[np.ndarray]:
        """Token ids of `files`, in order, as uint32 arrays; `progress(bytes)` after each batch."""
        batch: list[tuple[str, bool]] = []
        done = 0
        for text, ends_document, size in _pieces(files):
            batch.append((text, ends_document))
            done += size
            if len(batch) == _BATCH:
                yield from self._encode(batch)
                batch = []
                if progress is not None:
                    progress(done)
        if batch:
            yield from self._encode(batch)
        if progress is not None:
            progress(done)

    def _encode(self, batch: list[tuple[str, bool]]) -> Iterator[np.ndarray]:
        import numpy as np

        encodings = self.tokenizer.encode_batch([t for t, _ in batch], add_special_tokens=False)
        for (_, ends_document), encoding in zip(batch, encodings, strict=True):
            ids = encoding.ids
            if ends_document and self.eos is not None:
                ids = [*ids, self.eos]
            yield np.asarray(ids, dtype=np.uint32)


def _pieces(files: list[Path]) -> Iterator[tuple[str, bool, int]]:
    """(text, ends a document, bytes read) over the files: .jsonl records, .txt pieces."""
    for file in files:
        with file.open(encoding="utf-8", newline="") as f:  # newline="": bytes as on disk
            if file.suffix == ".jsonl":
                skipped = 0  # blank lines' bytes, counted with the next record
                for number, line in enumerate(f, 1):
                    if line.strip():
                        yield _record(file, number, line), True, skipped + len(line.encode())
                        skipped = 0
                    else:
                        skipped += len(line.encode())
                if skipped:
                    yield "", False, skipped
                continue
            piece: list[str] = []
            size = 0
            for line in f:
                piece.append(line)
                size += len(line.encode())
                if size >= _PIECE_BYTES:
                    yield "".join(piece), False, size
                    piece, size = [], 0
            yield "".join(piece), True, size


def _record(file: Path, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{file} line {number} is not JSON: {error.msg}") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError(f'{file} line {number} has no string field "text"')
    text: str = record["text"]
    return text


def _inputs(paths: list[str]) -> list[Path]:
    files, faults = [], []
    for given in paths:
        path = Path(given)
        found = text_files(path) if path.exists() else []
        bad = [f for f in found if f.suffix not in TEXT_SUFFIXES]
        if not found or bad:
            faults.append(Fault("INPUT", f"{given}: not a .txt / .jsonl file or a folder of them"))
        files += found
    if faults:
        raise BadInput(faults, what="arguments")
    return files


def prepare(
    inputs: list[str],
    tokenizer: str,
    output: str,
    dtype: str | None = None,
    *,
    report: Callable[[str], None] | None = None,
    every_s: float = 2.0,
) -> int:
    """Tokenize `inputs` into the `tokens` format at `output` (written whole or not at all);
    returns the token count. `dtype` None: uint16 when the tokenizer's ids fit, else uint32."""
    files = _inputs(inputs)
    if not (Path(tokenizer) / "tokenizer.json").is_file():
        raise BadInput.one("--tokenizer", f"{tokenizer} holds no tokenizer.json", what="arguments")
    encoder = Encoder(tokenizer)
    chosen = dtype or ("uint16" if encoder.vocab <= 1 << 16 else "uint32")
    if chosen == "uint16" and encoder.vocab > 1 << 16:
        raise BadInput.one(
            "--dtype",
            f"uint16 holds ids below 65536; this tokenizer has {encoder.vocab:,}: use uint32",
            what="arguments",
        )
    total = sum(f.stat().st_size for f in files)
    start = last = time.monotonic()
    tokens = 0

    def progress(done: int) -> None:
        nonlocal last
        now = time.monotonic()
        if report is not None and (now - last >= every_s or done == total):
            last = now
            report(
                f"malleus data prepare: {done / 1e6:,.1f}/{total / 1e6:,.1f} MB, "
                f"{tokens:,} tokens, {now - start:.0f}s"
            )

    out = Path(output)
    partial = out.with_name(out.name + ".partial")
    try:
        with partial.open("wb") as f:
            for ids in encoder.encode(files, progress):
                f.write(ids.astype(_DTYPES[chosen]).tobytes())
                tokens += len(ids)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    if report is not None:
        report(
            f"wrote {tokens:,} {chosen} tokens to {out} (data: {{format: tokens, dtype: {chosen}}})"
        )
    return tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt / .jsonl files or folders")
    parser.add_argument(
        "--tokenizer", required=True, metavar="DIR", help="folder with tokenizer.json"
    )
    parser.add_argument("-o", "--output", required=True, metavar="OUT.bin")
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), help="default: uint16 when the vocabulary fits"
    )


def main(args: argparse.Namespace) -> int:
    """`malleus data prepare`; bad input is `BadInput` (exit 2), a bad record exit 2 too."""
    try:
        prepare(
            args.inputs,
            args.tokenizer,
            args.output,
            args.dtype,
            report=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except ValueError as error:
        if isinstance(error, BadInput):
            raise
        raise BadInput.one("INPUT", str(error), what="arguments") from None
    return 0

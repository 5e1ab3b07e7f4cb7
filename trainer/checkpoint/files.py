"""The files of a checkpoint: written with their sha256, read back only after every check.

What `trainer/checkpoint/directory.py` trusts nothing without: a payload file is hashed as torch.save
writes it and fsync'd; text (the manifest, `latest`) goes through a temporary file, fsync and
rename; the manifest carries its own sha256. On the way back a file is read only from inside
its checkpoint's directory, only with its recorded size and sha256, with `weights_only=True`,
and a piece only with its recorded shape and dtypes and finite values; only regular files are
read (a device, a pipe or a socket planted as `latest`, a manifest or a payload is refused
before it is read), and text files only up to a bound. Every refusal is a
`CheckpointError` naming the file and the piece.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

__all__ = [
    "KINDS",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "MAX_POINTER_BYTES",
    "CheckpointError",
    "checked_piece",
    "describe",
    "digest",
    "fsync_dir",
    "inside",
    "load_file",
    "read_text_bounded",
    "regular",
    "save_hashed",
    "stage_text",
    "write_text_atomic",
]

MANIFEST = "manifest.json"
KINDS = ("params", "exp_avg", "exp_avg_sq")
"""The tensors stored per piece: the parameter and its two Adam moments."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed; the message names the file (and piece) and why."""


class _Hashing:
    """A file wrapper torch.save writes through: the sha256 is taken of the bytes as they go
    to disk, so a checkpoint costs no second read and no in-memory copy of the file."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_hashed(obj: object, path: Path) -> dict[str, Any]:
    """torch.save `obj` to `path`, fsync'd; returns its manifest entry {sha256, bytes}."""
    with open(path, "wb") as f:
        out = _Hashing(f)
        torch.save(obj, out)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": out.sha.hexdigest(), "bytes": out.size}


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable: without it a power cut can undo the rename."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stage_text(path: Path, text: str) -> Path:
    """`text` in a temporary file next to `path`, fsync'd, for a rename onto `path` later."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` (temp file, fsync, rename, fsync of the directory): a reader
    sees the old or the new content, never a torn file, even after a crash."""
    os.replace(stage_text(path, text), path)
    fsync_dir(path.parent)


def digest(manifest: Mapping[str, Any]) -> str:
    """The manifest's own sha256: of its canonical JSON without the `sha256` field."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def describe(tensors: Mapping[str, Tensor]) -> dict[str, Any]:
    """A piece's manifest entry: its shape, each kind's dtype, and whether all are finite."""
    return {
        "shape": list(tensors["params"].shape),
        "dtypes": {k: str(t.dtype).removeprefix("torch.") for k, t in tensors.items()},
        "finite": all(bool(torch.isfinite(t).all()) for t in tensors.values()),
    }


def inside(root: Path, name: object, source: Path) -> Path:
    """`root/name`, refused unless it resolves (symlinks too) to a path inside `root`."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{source}: {name!r} is not a file name")
    path = (root / name).resolve()
    if not path.is_relative_to(root.resolve()) or path == root.resolve():
        raise CheckpointError(f"{source}: {name!r} points outside {root}")
    return path


MAX_POINTER_BYTES = 4096
"""`latest` holds one directory name (`step-NNNNNNNN`): anything longer is not one."""
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest lists every file and piece once (a few hundred bytes each): 64 MiB is far past
any model's, and keeps a planted file from being read into memory whole."""

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
)


def regular(path: Path, st: os.stat_result) -> None:
    """CheckpointError unless `st` (of `path`, symlinks followed) is a regular file: a device
    (`/dev/zero` never ends), a pipe (blocks), a socket or a directory is never read."""
    if stat.S_ISREG(st.st_mode):
        return
    kind = next((what for test, what in _KINDS if test(st.st_mode)), "not a regular file")
    raise CheckpointError(f"{path} is {kind}, not a regular file: refused before reading it")


def read_text_bounded(path: Path, limit: int) -> str:
    """The UTF-8 text of `path`, a regular file of at most `limit` bytes; anything else
    (missing, a special file, larger, not UTF-8) is CheckpointError naming it, raised before
    more than `limit` bytes are read. The file is checked before it is opened (nothing special
    is even opened) and again on the open descriptor (it cannot be swapped in between)."""
    try:
        regular(path, path.stat())
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        regular(path, st)
        if st.st_size > limit:
            raise CheckpointError(f"{path}: {st.st_size} bytes, more than {limit}: refused")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path}: more than {limit} bytes: refused")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None


def load_file(path: Path, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """One payload file: its size and sha256 as recorded, loaded with weights_only, its step
    the manifest's. Any failure names the file."""
    file = inside(path, name, path / MANIFEST)
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{path / MANIFEST} lists no {name}")
    try:
        st = file.stat()
        regular(file, st)  # a pipe would block the hash, a device never end it
        size = st.st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{file}: {size} bytes, the manifest recorded {entry['bytes']}")
        sha = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                sha.update(chunk)
        if sha.hexdigest() != entry["sha256"]:
            raise CheckpointError(
                f"{file}: sha256 {sha.hexdigest()[:12]}..., the manifest recorded "
                f"{str(entry['sha256'])[:12]}... (the file changed after it was written)"
            )
        data = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except CheckpointError:
        raise
    except Exception as e:  # whatever a file does to the loader, it is this file's fault
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{file}: unreadable ({type(e).__name__}: {first})") from None
    if not isinstance(data, dict) or data.get("step") != manifest["step"]:
        found = data.get("step") if isinstance(data, dict) else None
        raise CheckpointError(f"{file}: holds step {found!r}, the manifest says {manifest['step']}")
    return data


def checked_piece(
    file: Path, name: str, data: dict[str, Any], entry: dict[str, Any]
) -> tuple[dict[str, Tensor], int]:
    """A piece's tensors, each with the recorded shape and dtype and finite, and its Adam step."""
    out = {}
    for kind in KINDS:
        where = f"{file}: piece {name} ({kind})"
        t = data.get(kind, {}).get(name) if isinstance(data.get(kind), dict) else None
        if not isinstance(t, Tensor):
            raise CheckpointError(f"{where}: missing")
        if list(t.shape) != entry["shape"]:
            raise CheckpointError(
                f"{where}: shape {tuple(t.shape)}, expected {tuple(entry['shape'])}"
            )
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype != entry["dtypes"].get(kind):
            raise CheckpointError(f"{where}: dtype {dtype}, expected {entry['dtypes'].get(kind)}")
        if not bool(torch.isfinite(t).all()):
            how = (
                "it was saved so" if not entry["finite"] else "the manifest recorded finite values"
            )
            raise CheckpointError(f"{where}: holds NaN or inf ({how})")
        out[kind] = t
    steps = data.get("adam_step")
    adam = steps.get(name) if isinstance(steps, dict) else None
    if not isinstance(adam, int) or adam < 0:
        raise CheckpointError(f"{file}: piece {name}: Adam step {adam!r}")
    return out, adam

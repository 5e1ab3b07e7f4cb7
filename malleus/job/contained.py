"""File names that a file inside a folder lists, kept inside that folder.

A Hugging Face index (`weight_map`) and a saved dataset's `state.json` (`_data_files`) name
the files to read next to them. Whoever wrote the folder chose those names, and a name such as
`../other-job/model.safetensors` or `/etc/passwd` would make a trainer read outside the folder
the job named. So a listed name must be a plain relative path that stays in its folder:
not absolute, no `..` part, no empty or NUL name. Judged on the name alone, not on where a
symlink in the folder leads (a Hugging Face cache's snapshot folders are symlinks into
`../../blobs`, and the folder's writer may place any file in it anyway).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

__all__ = ["contained"]


def contained(folder: Path, name: object, source: Path, entry: str) -> Path:
    """`folder / name` for a `name` that `source` lists under `entry`; ValueError naming the
    file and the entry unless `name` is a relative path that stays inside `folder`."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ValueError(f"{source}: {entry} names {name!r}, not a file name")
    path = PurePosixPath(name)
    if path.is_absolute() or Path(name).is_absolute() or ".." in path.parts:
        raise ValueError(
            f"{source}: {entry} names {name!r}, outside {folder} (only names inside the "
            "folder are read)"
        )
    return folder / name

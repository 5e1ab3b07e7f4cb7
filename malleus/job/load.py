"""Reading a MalleusJob: a file or a mapping -> defaulted, validated, typed.

Every command reads files through `read_text` so that a missing file, a folder, a binary file or
a file that is not YAML is told the same way everywhere, as a `BadInput` naming the file.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError

from malleus.errors import BadInput, Fault

from .schema import KIND, validate_manifest
from .status import MalleusJob

__all__ = ["MAX_INPUT_BYTES", "dump_job", "load_job", "read_documents", "read_text"]

_INDENTATION = re.compile(
    r"mapping values are not allowed here|found character '\\t'|"
    r"expected <block end>|did not find expected key"
)
"""PyYAML's words for what is almost always a misindented line (or a tab)."""

MAX_INPUT_BYTES = 16 * 1024 * 1024
"""Largest job or problem file read (a manifest is a few KiB; anything near this is a mistake)."""


def read_text(path: str | os.PathLike[str], *, what: str = "MalleusJob") -> str:
    """The text of a UTF-8 file; `BadInput` naming the file when it cannot be one."""
    name = os.fspath(path)

    def bad(message: str) -> BadInput:
        return BadInput.one("", message, name, what=what)

    try:
        size = os.stat(name).st_size
        if size > MAX_INPUT_BYTES:
            raise bad(f"the file is {size} bytes; at most {MAX_INPUT_BYTES} are read")
        with open(name, "rb") as handle:
            data = handle.read(MAX_INPUT_BYTES + 1)
    except FileNotFoundError:
        raise bad("no such file") from None
    except IsADirectoryError:
        raise bad("is a folder, not a file") from None
    except PermissionError:
        raise bad("permission denied") from None
    except OSError as error:
        raise bad(f"cannot be read: {error.strerror or error}") from None
    if b"\0" in data:
        raise bad("is a binary file, not text (YAML or JSON expected)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad(f"is not UTF-8 text (byte {error.start})") from None


def read_documents(path: str | os.PathLike[str], *, what: str = "MalleusJob") -> list[Any]:
    """The non-empty YAML (or JSON) documents of a file."""
    text = read_text(path, what=what)
    stream = io.StringIO(text)
    stream.name = os.fspath(path)  # PyYAML names the file in its marks ("<unicode string>" else)
    try:
        return [d for d in yaml.safe_load_all(stream) if d is not None]
    except yaml.YAMLError as error:
        message = f"not valid YAML: {error}"
        mark = getattr(error, "problem_mark", None)
        if mark is not None and 0 <= mark.line < len(lines := text.splitlines()):
            message += f":\n      {lines[mark.line].rstrip()}\n      {' ' * mark.column}^"
        if _INDENTATION.search(str(error)):
            message += (
                "\n    (the line marked is indented differently from the fields around it, or "
                "uses a tab: indent each field under its parent with the same number of spaces)"
            )
        raise BadInput.one("", message, os.fspath(path), what=what) from None
    except RecursionError:
        raise BadInput.one("", "nested too deeply", os.fspath(path), what=what) from None


def _manifest_of(path: str) -> Any:
    documents = read_documents(path)
    jobs = [d for d in documents if isinstance(d, Mapping) and d.get("kind") == KIND]
    if len(jobs) == 1:
        return jobs[0]
    if not jobs and len(documents) == 1:
        return documents[0]  # validation will say what is wrong with it
    raise BadInput.one("", f"expected one {KIND} document, found {len(jobs)}", path)


def load_job(
    source: str | os.PathLike[str] | Mapping[str, Any], *, strict: bool = True
) -> MalleusJob:
    """Load, default and validate a MalleusJob from a YAML file path or a manifest mapping.

    A file may hold several YAML documents (a PVC beside the job, say); exactly one must be a
    MalleusJob. Raises `BadInput` listing every schema and CEL fault; ``strict`` makes unknown
    fields faults (the API server would silently drop them, hiding typos). The semantic checks
    no schema can state are `ResolvedJob.faults()`.
    """
    label: str | None = None
    if isinstance(source, Mapping):
        manifest: Any = source
    else:
        label = os.fspath(source)
        manifest = _manifest_of(label)
    defaulted, faults = validate_manifest(manifest, strict=strict)
    if faults:
        raise BadInput(faults, label)
    try:
        return MalleusJob.model_validate(defaulted)
    except ValidationError as error:  # the schema and the models disagree: report, do not crash
        raise BadInput(
            [
                Fault(".".join(str(part) for part in e["loc"]), e["msg"])
                for e in error.errors(include_url=False)
            ],
            label,
        ) from None


def dump_job(job: MalleusJob) -> dict[str, Any]:
    """The job as a manifest (camelCase, JSON types, unset optional fields left out)."""
    return job.model_dump(mode="json", by_alias=True, exclude_none=True)

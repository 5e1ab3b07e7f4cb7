"""A Kubernetes structural schema applied as the API server applies it, with no cluster.

``malleus run`` / ``check`` / ``train`` take the same manifest as ``kubectl apply``, so they must
accept and reject exactly what the API server does. There is one schema: the CRD in
``crds/malleusjob.yaml``, shipped as package data (``malleus/data/malleusjob.yaml``, kept
identical by a test). `validate_manifest` runs the server's three passes:

1. **prune and default** (no library does Kubernetes' pruning and defaulting): nulls of
   non-nullable fields and unknown fields are dropped (unknown ones are faults when strict, like
   kubectl's field validation), defaults are filled in, recursively;
2. **structural checks** -- types, enums, ranges, lengths, patterns, required fields -- by
   ``jsonschema`` (Draft 4, whose boolean ``exclusiveMinimum`` is OpenAPI v3.0's), plus the
   Kubernetes extensions it does not know (int-or-string, list-type map/set uniqueness,
   date-time), with the API server's wording;
3. **CEL rules** (`cel.evaluate_rules`), skipped after a blocking fault as on the server.

Every fault is collected and reported at once, each with its field path. The parity test in
tests/crd runs the same bad manifests through the real API server.
"""

from __future__ import annotations

import copy
import datetime as dt
import difflib
import functools
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from jsonschema import Draft4Validator, ValidationError

from malleus.errors import Fault

from .cel import evaluate_rules

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "CRD_PATH",
    "KIND",
    "PLURAL",
    "RULES_NOT_CHECKED",
    "VERSION",
    "crd",
    "job_schema",
    "validate_manifest",
]

API_GROUP = "malleus.io"
VERSION = "v1alpha1"
API_VERSION = f"{API_GROUP}/{VERSION}"
KIND = "MalleusJob"
PLURAL = "malleusjobs"

RULES_NOT_CHECKED = (
    "some validation rules were not checked because the object was invalid; "
    "correct the existing errors to complete validation"
)
"""The API server's words for CEL rules skipped after a blocking fault (type, enum, required,
too long, too many)."""

CRD_PATH = Path(__file__).parent.parent / "data" / "malleusjob.yaml"
"""The CRD shipped as package data: a copy of crds/malleusjob.yaml (a test keeps them equal)."""


@functools.cache
def _crd() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(CRD_PATH.read_text(encoding="utf-8"))
    return loaded


@functools.cache
def _schema() -> dict[str, Any]:
    for version in _crd()["spec"]["versions"]:
        if version["name"] == VERSION:
            schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
            return schema
    raise LookupError(f"the packaged CRD has no version {VERSION}")  # pragma: no cover


def crd() -> dict[str, Any]:
    """The MalleusJob CustomResourceDefinition (a fresh copy), as shipped with the package."""
    return copy.deepcopy(_crd())


def job_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``malleus.io/v1alpha1`` MalleusJob (a fresh copy)."""
    return copy.deepcopy(_schema())


# -- helpers ---------------------------------------------------------------------------------


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_of(value: Any) -> str:
    """The JSON type name of a Python value, as the API server names it in messages."""
    if isinstance(value, bool):
        return "boolean"
    if _is_integer(value):
        return "integer"
    for name, kind in (("object", dict), ("array", list), ("string", str), ("number", float)):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def _literal(value: Any) -> str:
    """A value as the API server prints it in messages (JSON-like)."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _path(error: ValidationError) -> str:
    out = ""
    for part in error.absolute_path:
        out = f"{out}[{part}]" if isinstance(part, int) else _join(out, str(part))
    return out


def _rfc3339(value: dt.date) -> str:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return value.isoformat().replace("+00:00", "Z")
    return value.isoformat()


def _is_rfc3339(text: str) -> bool:
    if not re.fullmatch(
        r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})", text
    ):
        return False
    try:
        dt.datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


# -- pass 1: pruning and defaulting ----------------------------------------------------------


def _has_type(value: Any, schema: Mapping[str, Any]) -> bool:
    expected = schema.get("type")
    return (
        expected is None
        or _type_of(value) == expected
        or (expected == "number" and _type_of(value) == "integer")
    )


def _normalize(
    value: Any, schema: Mapping[str, Any], path: str, *, meta: bool, unknown: list[Fault]
) -> Any:
    """Drop nulls and unknown fields (each a fault in ``unknown``), apply defaults.

    ``meta`` marks ObjectMeta, whose fields the schema lists only in part.
    """
    if isinstance(value, (dt.datetime, dt.date)):  # YAML reads unquoted timestamps
        return _rfc3339(value)
    if isinstance(value, dict) and _has_type(value, schema):
        properties: Mapping[str, Any] = schema.get("properties", {})
        result: dict[str, Any] = {}
        for key, item in value.items():
            if item is None and not schema.get("nullable"):
                continue  # the API server prunes nulls of non-nullable fields, then defaults
            if key in properties:
                is_meta = not path and key == "metadata"
                result[key] = _normalize(
                    item, properties[key], _join(path, key), meta=is_meta, unknown=unknown
                )
            elif isinstance(schema.get("additionalProperties"), Mapping):  # a map's values
                sub = schema["additionalProperties"]
                result[key] = _normalize(
                    item, sub, _join(path, str(key)), meta=False, unknown=unknown
                )
            elif meta or schema.get("x-kubernetes-preserve-unknown-fields"):
                result[key] = item
            else:
                unknown.append(_unknown_field(_join(path, str(key)), str(key), properties))
        for key, sub in properties.items():
            if key not in result and "default" in sub:
                default = copy.deepcopy(sub["default"])
                result[key] = _normalize(
                    default, sub, _join(path, key), meta=False, unknown=unknown
                )
        return result
    if isinstance(value, list) and "items" in schema:
        return [
            _normalize(item, schema["items"], f"{path}[{i}]", meta=False, unknown=unknown)
            for i, item in enumerate(value)
        ]
    return value


def _unknown_field(path: str, key: str, known: Mapping[str, Any]) -> Fault:
    """kubectl's words for an unknown field, and the allowed name it most likely meant."""
    message = f'unknown field "{path}"'
    same = [name for name in known if name.lower() == key.lower()]
    close = same or difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    if close:
        message += f"; did you mean {close[0]}?"
    elif known:
        message += f"; allowed here: {', '.join(sorted(known))}"
    return Fault(path, message)


# -- pass 2: structural checks (jsonschema + the Kubernetes extensions) ----------------------


def _int_or_string(_v: Any, flag: Any, instance: Any, _s: Mapping[str, Any]) -> Iterator[Any]:
    if flag and not (isinstance(instance, str) or _is_integer(instance)):
        yield ValidationError(
            "int-or-string", validator="type", validator_value="integer or string"
        )


def _list_type(_v: Any, kind: Any, instance: Any, schema: Mapping[str, Any]) -> Iterator[Any]:
    if not isinstance(instance, list) or kind not in ("map", "set"):
        return
    keys = schema.get("x-kubernetes-list-map-keys", [])
    seen: set[str] = set()
    for i, item in enumerate(instance):
        if kind == "map" and isinstance(item, dict):
            # The API server's wording: the item's keys as compact JSON.
            identity = json.dumps({k: item.get(k) for k in keys}, separators=(",", ":"))
        elif kind == "set":
            identity = json.dumps(item, separators=(",", ":"))
        else:
            continue
        if identity in seen:
            error = ValidationError(f"Duplicate value: {identity}", path=[i])
            error.validator = "x-kubernetes-list-type"  # type: ignore[assignment]
            yield error
        seen.add(identity)


def _date_time(_v: Any, fmt: Any, instance: Any, _s: Mapping[str, Any]) -> Iterator[Any]:
    if fmt == "date-time" and isinstance(instance, str) and not _is_rfc3339(instance):
        yield ValidationError(f"must be an RFC 3339 date-time, not {_literal(instance)}")


_TYPES = Draft4Validator.TYPE_CHECKER.redefine(
    "integer", lambda _checker, value: _is_integer(value)
)
_StructuralValidator = jsonschema.validators.extend(
    Draft4Validator,
    validators={
        "x-kubernetes-int-or-string": _int_or_string,
        "x-kubernetes-list-type": _list_type,
        "format": _date_time,
    },
    type_checker=_TYPES,
)

_BLOCKING = {"type", "enum", "required", "maxLength", "maxItems"}
"""Faults that stop the CEL rules, as on the API server: a wrong type, a value outside an enum,
a missing field, and a string or list over its maximum (the rules' cost bounds rely on those)."""


def _message(error: ValidationError) -> str:
    """The API server's wording for one jsonschema error."""
    kind, bound, schema = error.validator, error.validator_value, error.schema
    value = error.instance
    if kind == "type":
        expected = bound if isinstance(bound, str) else schema.get("type")
        return f"must be of type {expected}, not {_type_of(value)}"
    if kind == "enum":
        allowed = ", ".join(_literal(v) for v in bound)
        return f"Unsupported value: {_literal(value)}: supported values: {allowed}"
    if kind == "minimum":
        exclusive = schema.get("exclusiveMinimum")
        return f"should be greater than {'' if exclusive else 'or equal to '}{bound}"
    if kind == "maximum":
        exclusive = schema.get("exclusiveMaximum")
        return f"should be less than {'' if exclusive else 'or equal to '}{bound}"
    if kind == "minLength":
        return f"should be at least {bound} chars long"
    if kind == "maxLength":
        return f"Too long: may not be more than {bound} bytes"
    if kind == "pattern":
        return f"should match '{bound}'"
    if kind == "minItems":
        return f"should have at least {bound} items"
    if kind == "maxItems":
        return f"Too many: {len(value)}: must have at most {bound} items"
    return str(error.message)


def _structural_faults(value: Any, schema: Mapping[str, Any]) -> tuple[list[Fault], bool]:
    """(faults, blocking) of the structural checks, one fault per problem, in document order."""
    faults: list[Fault] = []
    blocking = False
    mistyped: set[str] = set()
    errors = sorted(
        _StructuralValidator(schema).iter_errors(value),
        key=lambda e: [str(p) for p in e.absolute_path],
    )
    for error in errors:
        path = _path(error)
        if any(path == m or path.startswith((m + ".", m + "[")) for m in mistyped):
            continue  # a value of the wrong type gets one fault, not one per keyword
        if error.validator == "required":
            missing = [k for k in error.validator_value if k not in error.instance]
            for key in missing:
                if Fault(_join(path, key), "Required value") not in faults:
                    faults.append(Fault(_join(path, key), "Required value"))
            blocking = True
            continue
        if error.validator == "type":
            mistyped.add(path)
        faults.append(Fault(path, _message(error)))
        blocking = blocking or error.validator in _BLOCKING
    return faults, blocking


# -- the three passes ------------------------------------------------------------------------


def validate_manifest(
    manifest: Mapping[str, Any], *, strict: bool = True
) -> tuple[dict[str, Any], list[Fault]]:
    """Default and validate a MalleusJob manifest as the API server would.

    Returns the defaulted manifest (unknown fields pruned) and the faults, empty when valid.
    With ``strict`` (like ``kubectl``'s default field validation) an unknown field is a fault;
    without it, it is silently pruned as the API server does.
    """
    if not isinstance(manifest, Mapping):
        return {}, [Fault("", f"a manifest must be a mapping, not {_type_of(manifest)}")]
    schema = _schema()
    faults: list[Fault] = []
    if manifest.get("apiVersion") != API_VERSION:
        faults.append(Fault("apiVersion", f"must be {_literal(API_VERSION)}"))
    if manifest.get("kind") != KIND:
        faults.append(Fault("kind", f"must be {_literal(KIND)}"))
    metadata = manifest.get("metadata")
    if not isinstance(metadata, Mapping) or not metadata.get("name"):
        faults.append(Fault("metadata.name", "Required value: the job needs a name"))
    unknown: list[Fault] = []
    defaulted: dict[str, Any] = _normalize(dict(manifest), schema, "", meta=False, unknown=unknown)
    if strict:
        faults += unknown
    structural, blocking = _structural_faults(defaulted, schema)
    faults += structural
    if blocking:
        faults.append(Fault("", RULES_NOT_CHECKED))
    else:
        faults += evaluate_rules(defaulted, schema)
    return defaulted, faults

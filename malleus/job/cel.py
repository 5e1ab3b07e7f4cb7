"""CEL ``x-kubernetes-validations`` rules, evaluated with cel-python the way the API server does.

The API server types CEL values by the schema, not by the JSON value: a ``number`` field is a
double even when the manifest wrote ``2``, so ``self.factor > 1`` and ``self.factor > 1.0`` mean
the same to it. `to_cel` reproduces that typing.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

import celpy
from celpy import celtypes

from malleus.errors import Fault

__all__ = ["evaluate_rules"]


@functools.cache
def _environment() -> celpy.Environment:
    return celpy.Environment()


@functools.cache
def _program(rule: str) -> celpy.Runner:
    environment = _environment()
    return environment.program(environment.compile(rule))


def to_cel(value: Any, schema: Mapping[str, Any]) -> Any:
    """A Python value as CEL sees it, typed by the schema (a ``number`` is always a double)."""
    if isinstance(value, dict):
        properties: Mapping[str, Any] = schema.get("properties", {})
        return celtypes.MapType(
            {
                celtypes.StringType(key): to_cel(item, properties.get(key, {}))
                for key, item in value.items()
            }
        )
    if isinstance(value, list):
        items = schema.get("items", {})
        return celtypes.ListType([to_cel(item, items) for item in value])
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, (int, float)) and schema.get("type") == "number":
        return celtypes.DoubleType(float(value))
    return celpy.json_to_cel(value)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _evaluate(
    rule: Mapping[str, Any], value: Any, schema: Mapping[str, Any], path: str
) -> list[Fault]:
    message = rule.get("message") or f"failed rule: {rule['rule']}"
    try:
        result = _program(rule["rule"]).evaluate({"self": to_cel(value, schema)})
        if isinstance(result, celpy.CELEvalError):
            raise result
    except celpy.CELEvalError as error:
        # The API server reports a rule that cannot run at the rule's own node.
        return [Fault(path, f"{message} (the rule could not be evaluated: {error.args[0]})")]
    if not bool(result):
        # fieldPath is relative to the rule's object (`.parallelism.tp`); at the root it names a
        # top-level field, without the leading dot the API server drops there too
        return [Fault((path + rule.get("fieldPath", "")).lstrip("."), message)]
    return []


_TRANSITION = re.compile(r"\boldSelf\b")
"""A transition rule: the API server evaluates it on updates only, as this module never does."""


def evaluate_rules(value: Any, schema: Mapping[str, Any], path: str = "") -> list[Fault]:
    """Every ``x-kubernetes-validations`` rule of ``schema`` on the values present, recursively.

    Call only on a value that passed the structural checks: the rules assume types, enums,
    required fields and maxima hold (the API server skips them otherwise, and so do we).
    """
    faults: list[Fault] = []
    for rule in schema.get("x-kubernetes-validations", []):
        if _TRANSITION.search(rule["rule"]):
            continue  # compares an update with the stored object: a manifest has no oldSelf
        faults += _evaluate(rule, value, schema, path)
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                faults += evaluate_rules(value[key], sub, _join(path, key))
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            faults += evaluate_rules(item, schema["items"], f"{path}[{i}]")
    return faults

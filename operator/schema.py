"""The InferenceService schema, read from the CRD in `crds/`, applied the way the API server does.

Three steps, in the API server's order: structural defaults (`default:` at every level,
nested defaults inside a defaulted object included), OpenAPI validation (unknown fields
rejected like `kubectl --validate=strict`), then the CEL rules of `x-kubernetes-validations`
evaluated with `cel-python`, each with `self` bound to the node that carries it.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

CRD_ENV = "KVFERRY_CRD"
"""Environment variable naming the CRD file, for installs that moved `crds/` elsewhere."""

# operator/crds/ links to the top-level crds/ (so the file ships as package data of
# kvferry.operator and an installed wheel finds it too).
_DEFAULT_CRD = Path(__file__).parent / "crds" / "inferenceservices.kvferry.dev.yaml"


def crd_path() -> Path:
    """Path of the InferenceService CRD manifest (the one source of truth)."""
    return Path(os.environ.get(CRD_ENV) or _DEFAULT_CRD)


@functools.cache
def load_crd() -> dict[str, Any]:
    """The CRD manifest as a dict (cached; treat it as read-only)."""
    with open(crd_path(), encoding="utf-8") as f:
        return yaml.safe_load(f)


def object_schema() -> dict[str, Any]:
    """The served version's `openAPIV3Schema` (the whole object: metadata, spec, status)."""
    (version,) = [v for v in load_crd()["spec"]["versions"] if v["storage"]]
    return version["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Return a copy of `value` with every missing field that has a `default` filled in.

    As in Kubernetes, a default is applied only where its parent exists, and a defaulted
    object gets its own nested defaults too (so `default: {}` on an object expands fully).
    """
    value = copy.deepcopy(value)
    _default_in_place(schema, value)
    return value


def _default_in_place(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _default_in_place(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value.keys() - schema.get("properties", {}).keys():
                _default_in_place(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default_in_place(schema["items"], item)


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Turn a structural schema into a JSON Schema that also rejects unknown fields."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in schema:
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        keeps_unknown = schema.get("x-kubernetes-preserve-unknown-fields", False)
        if "additionalProperties" not in schema and not keeps_unknown:
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        out["items"] = _strict(schema["items"])
    if "anyOf" in schema:
        out["anyOf"] = [_strict(s) for s in schema["anyOf"]]
    out.pop("default", None)
    return out


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    return jsonschema.Draft7Validator(_strict(object_schema()))


def _dotted(path: list[Any] | Any) -> str:
    parts = [f"[{p}]" if isinstance(p, int) else f".{p}" for p in path]
    return "".join(parts).lstrip(".") or "<root>"


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """OpenAPI errors of a whole object, each as `field.path: message`."""
    errors = sorted(_validator().iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{_dotted(list(e.absolute_path))}: {e.message}" for e in errors]


@functools.cache
def _program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(obj: dict[str, Any], schema: dict[str, Any] | None = None, path: str = "") -> list[str]:
    """Messages of the `x-kubernetes-validations` rules that `obj` breaks, in schema order."""
    schema = object_schema() if schema is None else schema
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        try:
            result = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(obj)})
        except celpy.CELEvalError as exc:
            result = exc
        if isinstance(result, Exception) or not bool(result):
            where = (path + rule.get("fieldPath", "")).lstrip(".") or "<root>"
            errors.append(f"{where}: {rule.get('message', 'failed rule: ' + rule['rule'])}")
    if isinstance(obj, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                errors += cel_errors(value, sub, f"{path}.{key}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            errors += cel_errors(item, schema["items"], f"{path}[{i}]")
    return errors


def admit(obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Default and validate a whole InferenceService as the API server would.

    Returns the defaulted object and the list of errors (empty when it is admitted). CEL
    rules run only on schema-valid objects, as the API server's do.
    """
    defaulted = apply_defaults(object_schema(), obj)
    errors = schema_errors(defaulted)
    if not errors:
        errors = cel_errors(defaulted)
    return defaulted, errors

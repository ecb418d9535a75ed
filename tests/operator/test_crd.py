"""The CRD is a valid, structural apiextensions.k8s.io/v1 object with the promised API."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import yaml

from kvferry.operator.schema import crd_path, load_crd, object_schema
from kvferry_testing.operator_factories import ROOT


def structural_errors(schema: dict[str, Any], path: str = "") -> list[str]:
    """Violations of Kubernetes' structural-schema rules (every node typed, no $ref, ...)."""
    errors = []
    if "$ref" in schema:
        errors.append(f"{path}: $ref is not allowed")
    typed = "type" in schema or schema.get("x-kubernetes-int-or-string") or schema.get(
        "x-kubernetes-preserve-unknown-fields")
    if not typed:
        errors.append(f"{path}: no type")
    if "anyOf" in schema and not schema.get("x-kubernetes-int-or-string"):
        errors.append(f"{path}: anyOf outside int-or-string")
    if "properties" in schema and "additionalProperties" in schema:
        errors.append(f"{path}: properties and additionalProperties together")
    for key, sub in schema.get("properties", {}).items():
        errors += structural_errors(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            errors += structural_errors(schema[key], f"{path}.{key}")
    return errors


def test_crd_validates_as_apiextensions_v1() -> None:
    assert kubernetes_validate.validate(load_crd(), "1.30", strict=True) == "1.30"


def test_crd_schema_is_structural() -> None:
    assert structural_errors(object_schema()) == []


def test_crd_names_group_version_and_short_name() -> None:
    crd = load_crd()
    assert crd["metadata"]["name"] == "inferenceservices.kvferry.dev"
    assert crd["spec"]["group"] == "kvferry.dev"
    assert crd["spec"]["names"]["kind"] == "InferenceService"
    assert crd["spec"]["names"]["shortNames"] == ["kvis"]  # not KServe's isvc
    (version,) = crd["spec"]["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "URL", "Encoder", "Prefill", "Decode", "Age"]


def test_every_spec_field_is_described_or_obvious() -> None:
    spec = object_schema()["properties"]["spec"]
    for name, field in spec["properties"].items():
        assert field.get("description"), f"spec.{name} has no description"


def test_chart_ships_the_same_crd_file() -> None:
    chart_crd = ROOT / "charts" / "kvferry" / "crds" / crd_path().name
    assert chart_crd.resolve() == crd_path().resolve()
    assert yaml.safe_load(chart_crd.read_text()) == load_crd()

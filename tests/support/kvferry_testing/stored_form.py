"""What a body must look like for the API server to store it unchanged (an independent check).

The API server decodes a body into its Go types and encodes that back, so it drops what Go's
`omitempty` drops (empty lists and maps, `false` for plain booleans, empty strings) and
rewrites quantities in canonical form. A body the operator applies must already be in that
form, or it would differ from what it reads back and be written again on every reconcile.
"""

from __future__ import annotations

from typing import Any

from kvferry.operator.quantity import canonical_quantity

# Boolean fields that are pointers in the Kubernetes Go types, so `false` is kept.
POINTER_BOOLS = {"allowPrivilegeEscalation", "readOnlyRootFilesystem", "runAsNonRoot", "privileged",
                 "automountServiceAccountToken", "optional", "hostUsers"}
# Label selectors a NetworkPolicy holds by pointer (or without omitempty): `{}` is kept, and
# means "everything".
KEPT_EMPTY_MAPS = {"namespaceSelector", "podSelector"}
# Parents whose values are all quantities.
QUANTITY_MAPS = {"requests", "limits"}
QUANTITY_FIELDS = {"sizeLimit", "averageValue"}


def stored_form_problems(value: Any, path: str = "") -> list[str]:
    """Every place where `value` differs from the form the API server would store."""
    problems: list[str] = []
    if isinstance(value, dict):
        if not value and path.rsplit(".", 1)[-1] not in KEPT_EMPTY_MAPS:
            problems.append(f"{path}: empty map (dropped by the API server)")
        for key, sub in value.items():
            where = f"{path}.{key}"
            if key == "stringData":
                problems.append(f"{where}: write-only (stored as data)")
            if sub is False and key not in POINTER_BOOLS:
                problems.append(f"{where}: false (dropped by the API server)")
            if sub == "":
                problems.append(f"{where}: empty string (dropped by the API server)")
            if key in QUANTITY_FIELDS:
                problems += _quantity_problems(sub, where)
            if key in QUANTITY_MAPS and isinstance(sub, dict):
                for name, quantity in sub.items():
                    problems += _quantity_problems(quantity, f"{where}.{name}")
            problems += stored_form_problems(sub, where)
    elif isinstance(value, list):
        if not value:
            problems.append(f"{path}: empty list (dropped by the API server)")
        for i, item in enumerate(value):
            problems += stored_form_problems(item, f"{path}[{i}]")
    return problems


def _quantity_problems(value: Any, where: str) -> list[str]:
    if not isinstance(value, str) or canonical_quantity(value) != value:
        return [f"{where}: {value!r} is stored as {canonical_quantity(value)!r}"]
    return []

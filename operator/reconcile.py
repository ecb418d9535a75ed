"""Level-based reconcile of one InferenceService: render, apply what differs, write status.

Idempotent: with nothing changed it only reads (one GET per child) and writes nothing, so
an operator restart, a repeated event or a resync is harmless. The first reconcile of a
new service creates its children without reading them first (they cannot exist yet, and a
conflict falls back to the compare), so a new service costs one request per child.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvferry.operator import KIND
from kvferry.operator.kube import ApiError, KubeClient
from kvferry.operator.render import Child, render_children
from kvferry.operator.render_router import service_url
from kvferry.operator.spec import InferenceServiceSpec, SpecError, parse_spec
from kvferry.operator.status import Problem, build_status, component_state, status_patch


@dataclass
class Outcome:
    """What one reconcile did (for logs and tests)."""

    created: list[str] = field(default_factory=list)  # "Kind/name"
    patched: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    status: dict[str, Any] | None = None  # the status patch written, None if unchanged


def is_subset(desired: Any, live: Any) -> bool:
    """True when every field of `desired` has the same value in `live`.

    Fields the API server adds (defaults, status, resourceVersion) are ignored; lists must
    match item by item. Integers compare equal to their string form (`1` and `"1"`), as
    int-or-string quantities come back as strings.
    """
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(live, list) and len(desired) == len(live)
                and all(is_subset(d, item) for d, item in zip(desired, live)))
    if isinstance(desired, int) and isinstance(live, str) and not isinstance(desired, bool):
        return str(desired) == live
    return bool(desired == live)


def now_rfc3339() -> str:
    """The current UTC time as Kubernetes writes timestamps."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def find_problems(client: KubeClient, spec: InferenceServiceSpec) -> list[Problem]:
    """Referenced Secrets that do not exist: valid by schema, fatal at run time."""
    refs: list[tuple[str, str, str | None]] = [
        (f"spec.engine.imagePullSecrets[{i}]", name, None)
        for i, name in enumerate(spec.engine.image_pull_secrets)
    ]
    if spec.router.api_key_secret is not None:
        refs.append(("spec.router.apiKeySecret", spec.router.api_key_secret.name,
                     spec.router.api_key_secret.key))
    if spec.redis.url_secret is not None:
        refs.append(("spec.redis.urlSecret", spec.redis.url_secret.name, spec.redis.url_secret.key))
    problems = []
    for where, name, key in refs:
        secret = await client.get("Secret", spec.namespace, name)
        if secret is None:
            problems.append(Problem("SecretNotFound", f"{where}: Secret {name!r} does not exist "
                                    f"in namespace {spec.namespace!r}"))
        elif key is not None and key not in {**secret.get("data", {}), **secret.get("stringData", {})}:
            problems.append(Problem("SecretKeyNotFound", f"{where}: Secret {name!r} has no key {key!r}"))
    return problems


async def apply_child(client: KubeClient, namespace: str, child: Child, outcome: Outcome,
                      expect_missing: bool = False) -> dict[str, Any]:
    """Create the child when missing, server-side apply it when it differs; return it live.

    `expect_missing` skips the first GET and creates straight away (a conflict falls back to
    the compare): one request instead of two per child of a service never reconciled before.
    """
    live = None if expect_missing else await client.get(child.kind, namespace, child.name)
    if live is None:
        try:
            live = await client.create(namespace, child.manifest)
            outcome.created.append(f"{child.kind}/{child.name}")
            return live
        except ApiError as exc:
            if exc.status != 409:
                raise
            # It exists after all (created by someone else, or before the status was
            # written): fall through to a compare.
            live = await client.get(child.kind, namespace, child.name) or {}
    if not child.create_only and not is_subset(child.manifest, live):
        live = await client.apply(namespace, child.manifest)
        outcome.patched.append(f"{child.kind}/{child.name}")
    return live


def is_first_reconcile(body: dict[str, Any]) -> bool:
    """True when the service has no status yet: no reconcile has finished for it."""
    return not (body.get("status") or {}).get("conditions")


async def reconcile(client: KubeClient, body: dict[str, Any]) -> Outcome:
    """Bring the children of one InferenceService in line with its spec, then write status.

    Raises `SpecError` (after writing a Degraded status) when the spec can never work.
    """
    meta = body["metadata"]
    outcome = Outcome()
    try:
        spec = parse_spec(dict(body), default_namespace=meta.get("namespace") or "default")
    except SpecError as exc:
        problem = Problem("InvalidSpec", "; ".join(exc.errors))
        await _write_status(client, body, [], [problem], "", outcome)
        raise
    outcome.problems = await find_problems(client, spec)
    children = render_children(spec)
    kopf.adopt([c.manifest for c in children], owner=body)
    expect_missing = is_first_reconcile(body)
    live = {}
    for child in children:
        live[(child.kind, child.name)] = await apply_child(client, spec.namespace, child, outcome,
                                                           expect_missing)
    components = [*spec.pools, "router"] + (["redis"] if spec.redis.is_managed else [])
    states = [
        component_state(c, live.get(("Deployment", f"{spec.name}-{c}"))) for c in components
    ]
    await _write_status(client, body, states, outcome.problems, service_url(spec), outcome)
    return outcome


async def _write_status(client: KubeClient, body: dict[str, Any], states: list[Any],
                        problems: list[Problem], url: str, outcome: Outcome) -> None:
    old = body.get("status") or {}
    generation = body["metadata"].get("generation")
    new = build_status(states, problems, url, generation, old, now_rfc3339())
    patch = status_patch(old, new)
    if patch is not None:
        meta = body["metadata"]
        await client.patch_status(KIND, meta["namespace"], meta["name"], patch)
        outcome.status = patch

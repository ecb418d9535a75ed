"""Level-based reconcile of one InferenceService: render, prune, apply what differs, write status.

Idempotent: with nothing changed it only reads (one labelled list per child kind and one GET
per generated Secret: the KV transfer key, the managed Redis password) and writes nothing,
so an operator restart, a repeated event or a resync is harmless. The first reconcile of a
new service applies its children without reading them first (server-side apply creates
what is missing), so a new service costs one request per child.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import kopf
from kvferry.operator import KIND
from kvferry.operator.children import (
    HANDOVER_MANAGER,
    LISTED_KINDS,
    ChildKey,
    needs_apply,
    needs_regeneration,
    needs_replicas_handover,
    replicas_handover,
    stale_children,
    with_applied_hash,
)
from kvferry.operator.kube import FIELD_MANAGER, ApiError, KubeClient
from kvferry.operator.labels import MANAGED_BY, SERVICE_LABEL
from kvferry.operator.render import Child, render_children
from kvferry.operator.render_kv_key import kv_transfer_key_secret
from kvferry.operator.render_redis import redis_password_secret
from kvferry.operator.render_router import service_url
from kvferry.operator.spec import InferenceServiceSpec, SpecError, parse_spec
from kvferry.operator.status import Problem, build_status, component_state, status_patch


@dataclass(frozen=True)
class Policy:
    """What the operator's installation allows, beyond what the CRD checks."""

    allow_host_path: bool = False  # hostPath volumes (model sources, extra volumes)


@dataclass
class Outcome:
    """What one reconcile did (for logs, tests, and telling the operator's own events apart)."""

    applied: list[str] = field(default_factory=list)  # "Kind/name", server-side applied
    created: list[str] = field(default_factory=list)  # "Kind/name", created once (Secrets)
    deleted: list[str] = field(default_factory=list)  # "Kind/name", pruned
    problems: list[Problem] = field(default_factory=list)
    status: dict[str, Any] | None = None  # the status patch written, None if unchanged
    written_versions: dict[ChildKey, str] = field(default_factory=dict)  # resourceVersion per write
    deleted_uids: set[str] = field(default_factory=set)


def now_rfc3339() -> str:
    """The current UTC time as Kubernetes writes timestamps."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def policy_problems(spec: InferenceServiceSpec, policy: Policy) -> list[Problem]:
    """Specs the operator's installation refuses: nothing is applied for them."""
    host_paths = spec.host_paths()
    if not host_paths or policy.allow_host_path:
        return []
    return [Problem("HostPathNotAllowed", (
        f"{', '.join(host_paths)}: hostPath volumes are disabled in this operator. Enable them with "
        "`helm upgrade ... --set operator.allowHostPath=true` (`kvferry operator --allow-host-path`), "
        "and label the namespace for a Pod Security level that admits hostPath (privileged)"))]


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


async def read_children(client: KubeClient, spec: InferenceServiceSpec) -> dict[ChildKey, dict[str, Any]]:
    """Every child the operator may have made for this service, found by its labels.

    Secrets are read by name (the operator makes only the KV transfer key and the managed
    Redis password), so the operator never needs to list Secrets.
    """
    selector = {"app.kubernetes.io/managed-by": MANAGED_BY, SERVICE_LABEL: spec.name}
    live: dict[ChildKey, dict[str, Any]] = {}
    for kind in LISTED_KINDS:
        for obj in await client.list_by_labels(kind, spec.namespace, selector):
            live[(kind, obj["metadata"]["name"])] = obj
    for secret_name in (kv_transfer_key_secret(spec.name), redis_password_secret(spec.name)):
        secret = await client.get("Secret", spec.namespace, secret_name)
        if secret is not None:
            live[("Secret", secret_name)] = secret
    return live


async def prune(client: KubeClient, spec: InferenceServiceSpec, owner_uid: str, children: list[Child],
                live: dict[ChildKey, dict[str, Any]], outcome: Outcome) -> None:
    """Delete the children the spec no longer asks for (owned by this service's uid only)."""
    desired = [(c.kind, c.name) for c in children]
    for kind, name in stale_children(live, desired, spec.name, owner_uid):
        uid = live[(kind, name)]["metadata"]["uid"]
        if await client.delete(kind, spec.namespace, name, uid):
            outcome.deleted.append(f"{kind}/{name}")
            outcome.deleted_uids.add(uid)
        del live[(kind, name)]


async def _create_once(client: KubeClient, namespace: str, child: Child,
                       live: dict[str, Any] | None, outcome: Outcome) -> dict[str, Any]:
    # A generated Secret is created once and never rewritten: a new random password or key
    # would lock out the pods using the old one. So it is POSTed (a conflict means it
    # exists), never applied, which would overwrite it; only a rotation asked for replaces it.
    if needs_regeneration(child.manifest, live):
        assert live is not None
        if await client.delete(child.kind, namespace, child.name, live["metadata"]["uid"]):
            outcome.deleted.append(f"{child.kind}/{child.name}")
            outcome.deleted_uids.add(live["metadata"]["uid"])
        live = None
    if live is not None:
        return live
    try:
        created = await client.create(namespace, child.manifest)
    except ApiError as exc:
        if exc.status != 409:
            raise
        return await client.get(child.kind, namespace, child.name) or {}
    outcome.created.append(f"{child.kind}/{child.name}")
    return created


async def _hand_replicas_to_hpa(client: KubeClient, namespace: str, live: dict[str, Any]) -> None:
    # The Kubernetes documentation's recipe for handing a field to a controller: a second
    # field manager co-owns the current count, so when the operator's apply stops carrying
    # `replicas` the count stays (instead of dropping to the default of 1) until the HPA
    # writes it. A conflict means the HPA has written it already.
    try:
        await client.apply(namespace, replicas_handover(live), field_manager=HANDOVER_MANAGER,
                           force=False)
    except ApiError as exc:
        if exc.status != 409:
            raise


async def apply_child(client: KubeClient, namespace: str, child: Child, live: dict[str, Any] | None,
                      outcome: Outcome) -> dict[str, Any]:
    """Server-side apply the child when it is missing or differs; return it as it is now."""
    if child.create_only:
        return await _create_once(client, namespace, child, live, outcome)
    if not needs_apply(child.manifest, live):
        return live or {}
    if needs_replicas_handover(child.manifest, live, FIELD_MANAGER):
        await _hand_replicas_to_hpa(client, namespace, live or {})
    applied = await client.apply(namespace, child.manifest)
    outcome.applied.append(f"{child.kind}/{child.name}")
    version = applied.get("metadata", {}).get("resourceVersion")
    if version:
        outcome.written_versions[(child.kind, child.name)] = version
    return applied


def is_first_reconcile(body: dict[str, Any]) -> bool:
    """True when the service has no status yet: no reconcile has finished for it."""
    return not (body.get("status") or {}).get("conditions")


def desired_children(spec: InferenceServiceSpec, body: dict[str, Any]) -> list[Child]:
    """The rendered children, owned by the service and stamped with their applied hash."""
    children = render_children(spec)
    kopf.adopt([c.manifest for c in children], owner=body)
    return [Child(c.manifest if c.create_only else with_applied_hash(c.manifest), c.create_only)
            for c in children]


async def reconcile(client: KubeClient, body: dict[str, Any], policy: Policy | None = None) -> Outcome:
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
    outcome.problems = policy_problems(spec, policy or Policy())
    if outcome.problems:
        await _write_status(client, body, [], outcome.problems, service_url(spec), outcome)
        return outcome
    outcome.problems = await find_problems(client, spec)
    children = desired_children(spec, body)
    live = {} if is_first_reconcile(body) else await read_children(client, spec)
    await prune(client, spec, meta["uid"], children, live, outcome)
    for child in children:
        key = (child.kind, child.name)
        live[key] = await apply_child(client, spec.namespace, child, live.get(key), outcome)
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

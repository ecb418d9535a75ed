"""kopf handlers: thin wrappers that call `reconcile`; `build_registry()` registers them.

InferenceService create/update/resume events reconcile the service. Changes to the
children (a Deployment's status, any child edited or deleted by hand) reconcile their owner,
so the status follows the pods and drift heals. Events caused by the operator's own writes
are recognised by resourceVersion (or uid, for deletions) and skipped.

The operator watches InferenceServices and the kinds of children it lists
(`children.LISTED_KINDS`), and kopf's cluster scanning (CRDs, namespaces) is off, so it
needs list/watch on nothing else; the chart's RBAC grants exactly what these handlers and
`reconcile` use (e2e/test_rbac.py derives it from the requests the operator sends).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import kopf
from kvferry.operator import GROUP, PLURAL, VERSION
from kvferry.operator.children import LISTED_KINDS
from kvferry.operator.kube import RESOURCES, ApiError, KubeClient
from kvferry.operator.labels import MANAGED_BY, SERVICE_LABEL
from kvferry.operator.reconcile import Outcome, Policy, reconcile
from kvferry.operator.spec import SpecError, parse_spec

MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
RETRY_DELAY_SECONDS = 5.0


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Startup: keep kopf's bookkeeping under kvferry.dev annotations, out of `status`."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    # Warnings (a missing Secret, a refused hostPath) show in `kubectl describe` as Events.
    settings.posting.loggers = True
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    # No watching of CRDs or namespaces: the operator's RBAC grants neither, and the
    # namespaces to serve are given by name.
    settings.scanning.disabled = True
    memo.locks = {}
    memo.own_versions = {}
    memo.own_deletions = set()
    if not hasattr(memo, "policy"):
        memo.policy = Policy()
    warm_up()


def warm_up() -> None:
    """Compile the CRD's validator and CEL rules now, not on the first object's clock."""
    parse_spec({"metadata": {"name": "warm-up"},
                "spec": {"model": {"source": "demo"}, "pools": {"decode": {}}}})


def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """Log in as kopf does by default (service account, then kubeconfig) and share it."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is None:
        raise kopf.LoginError("no service account and no kubeconfig to log in with")
    memo.client = KubeClient(info)
    return info


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Shutdown: close the API connection pool."""
    client = getattr(memo, "client", None)
    if client is not None:
        await client.close()


def _remember_own_writes(memo: kopf.Memo, namespace: str, outcome: Outcome) -> None:
    for (kind, name), version in outcome.written_versions.items():
        memo.own_versions[(kind, namespace, name)] = version
    memo.own_deletions |= outcome.deleted_uids


def _is_own_write(memo: kopf.Memo, kind: str, type: str | None, body: kopf.Body) -> bool:
    """The event reports a write of the operator itself (nothing to reconcile)."""
    if type == "DELETED":
        uid = body.metadata.uid
        if uid in memo.own_deletions:
            memo.own_deletions.discard(uid)
            return True
        return False
    key = (kind, body.metadata.namespace, body.metadata.name)
    return memo.own_versions.get(key) == body.metadata.get("resourceVersion")


def _lock(memo: kopf.Memo, namespace: str, name: str) -> asyncio.Lock:
    """One reconcile at a time per service, whatever triggered it."""
    lock: asyncio.Lock = memo.locks.setdefault((namespace, name), asyncio.Lock())
    return lock


async def _reconcile(memo: kopf.Memo, body: dict[str, Any], logger: Any) -> None:
    """Run one reconcile (the caller holds the service's lock) and log what it did."""
    try:
        outcome = await reconcile(memo.client, body, memo.policy)
    except SpecError as exc:
        raise kopf.PermanentError(str(exc)) from exc
    except (ApiError, aiohttp.ClientError) as exc:
        raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_SECONDS) from exc
    _remember_own_writes(memo, body["metadata"].get("namespace"), outcome)
    for verb, what in (("created", outcome.created), ("applied", outcome.applied),
                       ("deleted", outcome.deleted)):
        if what:
            logger.info("%s %s", verb, ", ".join(what))
    for problem in outcome.problems:
        logger.warning("%s: %s", problem.reason, problem.message)


async def on_service(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """InferenceService created, changed, or found at startup: reconcile it."""
    async with _lock(memo, body.metadata.namespace, body.metadata.name):
        await _reconcile(memo, dict(body), logger)


async def on_child(type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger,
                   resource: kopf.Resource, **_: Any) -> None:
    """A child changed or vanished: reconcile its owner (status, put back what was edited)."""
    owner_name = body.metadata.labels.get(SERVICE_LABEL)
    if type not in ("MODIFIED", "DELETED") or not owner_name:
        return  # initial listings are covered by the owners' resume
    namespace = body.metadata.namespace
    async with _lock(memo, namespace, owner_name):
        # Checked under the lock: a reconcile that has just finished may have made this write.
        # The owner is read under the lock too, so it carries that reconcile's status.
        if _is_own_write(memo, resource.kind or "", type, body):
            return
        try:
            owner = await memo.client.get("InferenceService", namespace, owner_name)
            if owner is None or owner["metadata"].get("deletionTimestamp"):
                return  # the owner is going away; garbage collection takes the children
            await _reconcile(memo, owner, logger)
        except (kopf.PermanentError, kopf.TemporaryError, ApiError, aiohttp.ClientError) as exc:
            logger.warning("reconcile of %s after a child event failed: %s", owner_name, exc)


def build_registry(policy: Policy | None = None) -> kopf.OperatorRegistry:
    """A fresh registry with every handler of the operator."""
    registry = kopf.OperatorRegistry()

    def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
        memo.policy = policy or Policy()
        configure(settings=settings, memo=memo, **kwargs)

    kopf.on.startup(registry=registry, id="configure")(startup)
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(cleanup)
    for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on(GROUP, VERSION, PLURAL, registry=registry, id="reconcile")(on_service)
    for kind in LISTED_KINDS:
        api_version, plural = RESOURCES[kind]
        group, _, version = api_version.rpartition("/")
        kopf.on.event(group, version, plural, labels=MANAGED, registry=registry,
                      id=f"child-{plural}")(on_child)
    return registry

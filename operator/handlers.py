"""kopf handlers: thin wrappers that call `reconcile`; `build_registry()` registers them.

InferenceService create/update/resume events reconcile the service. Changes to the
children (a Deployment's status, any child deleted by hand) reconcile their owner, so the
status follows the pods and drift heals.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import kopf

from kvferry.operator import GROUP, PLURAL, VERSION
from kvferry.operator.kube import RESOURCES, ApiError, KubeClient
from kvferry.operator.labels import MANAGED_BY, SERVICE_LABEL
from kvferry.operator.reconcile import reconcile
from kvferry.operator.spec import SpecError, parse_spec

MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
RETRY_DELAY_SECONDS = 5.0


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Startup: keep kopf's bookkeeping under kvferry.dev annotations, out of `status`."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    memo.locks = {}
    warm_up()


def warm_up() -> None:
    """Compile the CRD's validator and CEL rules now, not on the first object's clock."""
    parse_spec({"metadata": {"name": "warm-up"}, "spec": {"model": {"source": "demo"}, "pools": {"decode": {}}}})


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


async def _reconcile_locked(memo: kopf.Memo, body: dict[str, Any], logger: Any) -> None:
    key = (body["metadata"].get("namespace"), body["metadata"]["name"])
    lock = memo.locks.setdefault(key, asyncio.Lock())
    async with lock:
        try:
            outcome = await reconcile(memo.client, body)
        except SpecError as exc:
            raise kopf.PermanentError(str(exc)) from exc
        except (ApiError, aiohttp.ClientError) as exc:
            raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_SECONDS) from exc
    if outcome.created or outcome.patched:
        logger.info("created %s; patched %s", outcome.created or "nothing", outcome.patched or "nothing")
    for problem in outcome.problems:
        logger.warning("%s: %s", problem.reason, problem.message)


async def on_service(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """InferenceService created, changed, or found at startup: reconcile it."""
    await _reconcile_locked(memo, dict(body), logger)


async def on_child(type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger,
                   **_: Any) -> None:
    """A child changed or vanished: reconcile its owner (status, and re-create if deleted)."""
    owner_name = body.metadata.labels.get(SERVICE_LABEL)
    if type not in ("MODIFIED", "DELETED") or not owner_name:
        return  # initial listings are covered by the owners' resume
    owner = await memo.client.get("InferenceService", body.metadata.namespace, owner_name)
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return  # the owner is going away; garbage collection takes the children
    try:
        await _reconcile_locked(memo, owner, logger)
    except (kopf.PermanentError, kopf.TemporaryError) as exc:
        logger.warning("reconcile of %s after a child event failed: %s", owner_name, exc)


def _only_deleted(type: str | None, **_: Any) -> bool:
    return type == "DELETED"


def build_registry() -> kopf.OperatorRegistry:
    """A fresh registry with every handler of the operator."""
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    kopf.on.login(registry=registry)(login)
    kopf.on.cleanup(registry=registry)(cleanup)
    for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on(GROUP, VERSION, PLURAL, registry=registry, id="reconcile")(on_service)
    kopf.on.event("apps", "v1", "deployments", labels=MANAGED, registry=registry,
                  id="child-deployment")(on_child)
    for kind, (api_version, plural) in RESOURCES.items():
        if kind in ("Deployment", "InferenceService"):
            continue
        group, _, version = api_version.rpartition("/")
        kopf.on.event(group, version, plural, labels=MANAGED, when=_only_deleted,
                      registry=registry, id=f"child-{plural}")(on_child)
    return registry

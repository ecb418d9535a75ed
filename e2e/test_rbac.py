"""The chart's RBAC equals what the operator's code paths use, derived from what it sends.

The real operator process runs through every code path that touches the API (create a
service with every kind of child, a child edited by hand, a spec change that prunes each
prunable kind, a warning posted as an Event); every request it sends is turned into the
(API group, resource, verb) an RBAC authorizer checks, and that set must equal the rules
the chart renders: a ClusterRole by default, a Role per namespace with watchNamespaces.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvferry.operator.kube import APPLY_CONTENT_TYPE, object_path
from kvferry_testing.kube_emulator import Sent, new_service, operator_requests, stored, wait_for

ROOT = Path(__file__).resolve().parents[1]
NS = "default"
Permission = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)

SPEC = {
    "model": {"source": "demo"},
    "engine": {"imagePullSecrets": ["regcred"]},  # missing: a warning, posted as an Event
    "pools": {"prefill": {"autoscaling": {"maxReplicas": 2}}, "decode": {}},
    "ingress": {"host": "llm.example.com"},
}


def permissions(sent: Sent) -> tuple[set[Permission], str | None]:
    """What an RBAC authorizer checks for one request, and the namespace (None: cluster scope).

    Discovery (/api, /apis, /version) is open to every authenticated user and yields nothing.
    A server-side apply needs `create` too, as it creates a missing object.
    """
    parts = sent.path.strip("/").split("/")
    if parts[0] not in ("api", "apis") or len(parts) < 3:  # /version, /api, /apis, /apis/GROUP
        return set(), None
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    namespace = None
    if len(rest) >= 2 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    if not rest:
        return set(), None
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    named = len(rest) > 1
    verbs = {
        "GET": ["watch"] if sent.params.get("watch") == "true" else ["get"] if named else ["list"],
        "POST": ["create"],
        "PUT": ["update"],
        "PATCH": ["patch", "create"] if sent.content_type.startswith(APPLY_CONTENT_TYPE) else ["patch"],
        "DELETE": ["delete"] if named else ["deletecollection"],
    }[sent.method]
    return {(group, resource, verb) for verb in verbs}, namespace


def granted(rules: list[dict[str, Any]]) -> set[Permission]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def chart_docs(*values: str) -> list[dict[str, Any]]:
    local = ROOT / ".cache" / "bin" / "helm"
    helm = str(local) if local.exists() else shutil.which("helm")
    assert helm, "no helm binary: run `bash .ci/install-helm.sh` (puts one in .cache/bin)"
    done = subprocess.run([helm, "template", "kv", str(ROOT / "charts" / "kvferry"), "--namespace", "kvferry-system",
                           *values], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def observed(k: Any, name: str) -> int | None:
    return ((stored(k, "InferenceService", name) or {}).get("status") or {}).get("observedGeneration")


async def every_code_path(k: Any, client: Any) -> None:
    """Create, heal a hand edit, rotate the KV transfer key, and prune every prunable kind."""
    await client.create(NS, new_service("full", SPEC))
    await wait_for(lambda: observed(k, "full") == 1, 20, "first reconcile")
    key = stored(k, "Secret", "full-kv-transfer-key")["data"]
    await client._call("PATCH", object_path("InferenceService", NS, "full"), {
        "metadata": {"annotations": {"rotation.kvferry.dev/kv-transfer-key": "1"}}},
        "application/merge-patch+json")
    await wait_for(lambda: (stored(k, "Secret", "full-kv-transfer-key") or {}).get("data")
                   not in (None, key), 20, "the KV transfer key replaced")
    await client._call("PATCH", object_path("Service", NS, "full-decode"), {"spec": {"ports": [{"port": 1}]}},
                       "application/merge-patch+json")
    await wait_for(lambda: stored(k, "Service", "full-decode")["spec"]["ports"][0]["port"] == 8000, 20,
                   "the edited Service put back")
    await client._call("PATCH", object_path("InferenceService", NS, "full"), {
        "metadata": {"generation": 2},
        "spec": {"pools": {"prefill": None}, "ingress": None, "redis": {"url": "redis://shared:6379/0"}},
    }, "application/merge-patch+json")
    await wait_for(lambda: observed(k, "full") == 2, 20, "second reconcile")
    await wait_for(lambda: stored(k, "Secret", "full-redis-auth") is None, 20, "the managed Redis pruned")
    await wait_for(lambda: any(s.path.endswith("/events") for s in operator_requests(k)), 20,
                   "the SecretNotFound warning posted as an Event")


@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_chart_rbac_is_what_the_operator_uses(cluster, run_async, mode: str) -> None:
    async def scenario() -> list[Sent]:
        args = () if mode == "cluster-wide" else ("--namespace", NS)
        async with cluster() as (k, client, start_operator), start_operator(*args):
            await every_code_path(k, client)
            return operator_requests(k)

    used: set[Permission] = set()
    namespaces: set[str | None] = set()
    for sent in run_async(scenario()):
        needed, namespace = permissions(sent)
        used |= needed
        if needed:
            namespaces.add(namespace)
    if mode == "cluster-wide":
        (role,) = [d for d in chart_docs() if d["kind"] == "ClusterRole"]
    else:
        docs = chart_docs("--set", f"operator.watchNamespaces={{{NS}}}")
        assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
        (role,) = [d for d in docs if d["kind"] == "Role"]
        assert role["metadata"]["namespace"] == NS
        assert namespaces == {NS}  # nothing cluster-scoped: a Role is enough
    assert used == granted(role["rules"])


def test_the_derivation_reads_requests_as_an_authorizer_does() -> None:
    def sent(method: str, path: str, content_type: str = "", **params: str) -> Sent:
        return Sent(method, path, params, content_type, None)

    assert permissions(sent("GET", "/apis/apps/v1/deployments", watch="true")) == (
        {("apps", "deployments", "watch")}, None)
    assert permissions(sent("GET", "/api/v1/namespaces/a/secrets/x")) == ({("", "secrets", "get")}, "a")
    assert permissions(sent("PATCH", "/apis/apps/v1/namespaces/a/deployments/x", APPLY_CONTENT_TYPE)) == (
        {("apps", "deployments", "patch"), ("apps", "deployments", "create")}, "a")
    assert permissions(sent("PATCH", "/apis/kvferry.dev/v1alpha1/namespaces/a/inferenceservices/x/status",
                            "application/merge-patch+json")) == (
        {("kvferry.dev", "inferenceservices/status", "patch")}, "a")
    assert permissions(sent("GET", "/apis/kvferry.dev/v1alpha1")) == (set(), None)
    assert permissions(sent("GET", "/version")) == (set(), None)

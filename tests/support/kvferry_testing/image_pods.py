"""The pods the operator renders for a service, read back as what a container runtime needs.

A pod's environment is assembled the way the kubelet does it: the image's ENV, then the
container's `envFrom` (the service's ConfigMap), then its `env`, with `$(VAR)` in the
arguments expanded from the result. What only a cluster provides (a Secret's value, the
pod's IP) is supplied by the caller.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kvferry.operator.render import render_children
from kvferry.operator.spec import parse_spec

from kvferry_testing.image_files import dockerfile_env


def rendered(service: Path) -> dict[str, dict[str, Any]]:
    """`Kind/name` -> manifest of every child the operator renders for a service manifest."""
    children = render_children(parse_spec(yaml.safe_load(service.read_text())))
    return {f"{c.kind}/{c.name}": c.manifest for c in children}


@dataclass(frozen=True)
class Pod:
    """One Deployment's pod template, with its one container."""

    name: str  # the Deployment's name, e.g. demo-decode
    spec: dict[str, Any]  # the pod template's spec
    container: dict[str, Any]  # its first (only) container

    @property
    def run_as_user(self) -> int:
        return int(self.spec["securityContext"]["runAsUser"])

    def writable_mounts(self) -> list[str]:
        """Mount paths of the container's writable volumes (emptyDirs and claims not read-only)."""
        mounts = self.container.get("volumeMounts", [])
        return [m["mountPath"] for m in mounts if not m.get("readOnly")]

    def literal_env(self) -> dict[str, str]:
        """The container's `env` entries with a literal value (no Secret or field reference)."""
        return {e["name"]: e["value"] for e in self.container.get("env", []) if "value" in e}

    def environment(self, children: dict[str, dict[str, Any]],
                    supplied: dict[str, str]) -> dict[str, str]:
        """The process environment in the container: image ENV < envFrom < env.

        `supplied` gives the values of `valueFrom` entries (Secrets, the downward API).
        """
        env = dict(dockerfile_env())
        for source in self.container.get("envFrom", []):
            config_map = children[f"ConfigMap/{source['configMapRef']['name']}"]
            env.update(config_map["data"])
        for entry in self.container.get("env", []):
            if "value" in entry:
                env[entry["name"]] = entry["value"]
            elif entry["name"] in supplied:
                env[entry["name"]] = supplied[entry["name"]]
            else:
                raise AssertionError(f"{self.name}: no value given for {entry['name']} ({entry})")
        return env

    def args(self, env: dict[str, str]) -> list[str]:
        """The container's arguments with `$(VAR)` expanded as the kubelet does."""
        return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a)
                for a in self.container["args"]]


def pods(children: dict[str, dict[str, Any]]) -> dict[str, Pod]:
    """Every kvferry pod (engine pools and router) of the rendered children, by Deployment name.

    The managed Redis runs its own image, not kvferry's, and is left out.
    """
    out = {}
    for key, manifest in children.items():
        if not key.startswith("Deployment/"):
            continue
        spec = manifest["spec"]["template"]["spec"]
        container = spec["containers"][0]
        if container.get("args", [None])[0] == "kvferry":
            out[manifest["metadata"]["name"]] = Pod(manifest["metadata"]["name"], spec, container)
    return out


def under(path: str, roots: list[str]) -> bool:
    """True when `path` is one of `roots` or inside one."""
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)

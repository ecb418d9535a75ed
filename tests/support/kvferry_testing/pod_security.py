"""The `restricted` Pod Security Standard (Kubernetes 1.30), checked on a pod spec.

Written from the standard's published table of controls, independently of the operator's
rendering code: the Baseline controls, then the Restricted ones. Two rules of this project
come on top: a read-only root filesystem, and a size limit on every emptyDir.
"""

from __future__ import annotations

from typing import Any

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                           "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{field}[{c.get('name')}]", c)
            for field in ("initContainers", "containers", "ephemeralContainers") for c in pod.get(field, [])]


def _baseline(pod: dict[str, Any]) -> list[str]:
    found = [f"spec.{f}" for f in ("hostNetwork", "hostPID", "hostIPC") if pod.get(f)]
    pod_ctx = pod.get("securityContext", {})
    found += [f"spec.volumes[{v['name']}]: hostPath" for v in pod.get("volumes", []) if "hostPath" in v]
    found += [f"spec.securityContext.sysctls: {s['name']}" for s in pod_ctx.get("sysctls", [])
              if s["name"] not in SAFE_SYSCTLS]
    for where, ctx in [("spec", pod_ctx)] + [(w, c.get("securityContext", {})) for w, c in _containers(pod)]:
        if (ctx.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"{where}: hostProcess")
        if (ctx.get("seccompProfile") or {}).get("type") == "Unconfined":
            found.append(f"{where}: seccompProfile Unconfined")
        if (ctx.get("appArmorProfile") or {}).get("type") == "Unconfined":
            found.append(f"{where}: appArmorProfile Unconfined")
        selinux = ctx.get("seLinuxOptions") or {}
        if selinux.get("type") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            found.append(f"{where}: seLinuxOptions")
    for where, c in _containers(pod):
        ctx = c.get("securityContext", {})
        if ctx.get("privileged"):
            found.append(f"{where}: privileged")
        if ctx.get("procMount", "Default") != "Default":
            found.append(f"{where}: procMount")
        added = set((ctx.get("capabilities") or {}).get("add", [])) - BASELINE_CAPABILITIES
        found += [f"{where}: adds capability {cap}" for cap in sorted(added)]
        found += [f"{where}: hostPort {p['hostPort']}" for p in c.get("ports", []) if p.get("hostPort")]
    return found


def _restricted(pod: dict[str, Any]) -> list[str]:
    found = []
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            found.append(f"spec.volumes[{v['name']}]: type {sorted(kinds - RESTRICTED_VOLUME_TYPES)}")
    pod_ctx = pod.get("securityContext", {})
    if pod_ctx.get("runAsUser") == 0:
        found.append("spec.securityContext: runAsUser 0")
    pod_seccomp = (pod_ctx.get("seccompProfile") or {}).get("type")
    for where, c in _containers(pod):
        ctx = c.get("securityContext", {})
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}: allowPrivilegeEscalation is not false")
        non_root = ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot"))
        if non_root is not True:
            found.append(f"{where}: runAsNonRoot is not true")
        if ctx.get("runAsUser") == 0:
            found.append(f"{where}: runAsUser 0")
        seccomp = (ctx.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{where}: seccompProfile is {seccomp}, not RuntimeDefault or Localhost")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            found.append(f"{where}: capabilities do not drop ALL")
        found += [f"{where}: adds capability {cap}" for cap in caps.get("add", []) if cap != "NET_BIND_SERVICE"]
    return found


def _project(pod: dict[str, Any]) -> list[str]:
    found = [f"{where}: root filesystem is writable" for where, c in _containers(pod)
             if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True]
    found += [f"spec.volumes[{v['name']}]: emptyDir without sizeLimit" for v in pod.get("volumes", [])
              if "emptyDir" in v and not (v["emptyDir"] or {}).get("sizeLimit")]
    return found


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Every way a pod spec breaks the `restricted` level or the project's filesystem rules."""
    return _baseline(pod) + _restricted(pod) + _project(pod)

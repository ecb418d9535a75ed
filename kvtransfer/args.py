"""`kvferry serve`'s KV-transfer flags and the config they build, per role.

`prefill` and `decode` pods always run a connector; `both` (colocated) runs one when asked
(`--kv-transfer`, or a side-channel port in the pod environment), and then accepts either
kind of `kv_transfer_params`. The operator renders the environment variables; a flag wins
over its variable.

The KV host (`--kv-host`) is the one address the side channel and UCX's listeners bind, and
the one peers are told to dial (see `choose_kv_host`): the pod IP on a cluster, loopback
under `kvferry up`. An address this machine does not hold is refused at start.

Transfers need the service's key (`--kv-transfer-key-file`, else $KVFERRY_KV_TRANSFER_KEY):
a pod without one starts no connector and answers kv_transfer_params with a 400 naming
both, unless `--kv-transfer-insecure` runs it without signatures.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvferry.kvtransfer.auth import KEY_ENV, MIN_KEY_BYTES, TransferKey, key_from_environment
from kvferry.kvtransfer.config import KVTransferConfig
from kvferry.kvtransfer.interfaces import InterfaceAddress, ucx_net_devices

logger = logging.getLogger(__name__)

# Listen addresses that mean "every interface".
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# The KV host of a pod that listens on every interface and has no POD_IP.
FALLBACK_KV_HOST = "127.0.0.1"


def add_kv_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV transfer (prefill/decode disaggregation)")
    group.add_argument("--kv-transfer", action="store_true",
                       help="with --role both: run the KV connector too (prefill and decode "
                            "roles always do)")
    group.add_argument("--kv-host", default=None, metavar="ADDR",
                       help="the address of this machine that the KV transfer listeners (side "
                            "channel, NIXL/UCX) bind and that peers dial (default: --host when "
                            "it is one address, else $POD_IP, the pod IP on Kubernetes, else "
                            f"{FALLBACK_KV_HOST}: then pods on other machines cannot pull)")
    group.add_argument("--nixl-port", type=int, default=None, metavar="PORT",
                       help="side channel port (default $KVFERRY_NIXL_PORT, else a free port)")
    group.add_argument("--kv-lease-seconds", type=float, default=None, metavar="S",
                       help="seconds a prefill's blocks are held for a pull without a "
                            "heartbeat (default $KVFERRY_KV_LEASE_SECONDS or 30)")
    group.add_argument("--kv-failure-policy", choices=("recompute", "fail"), default=None,
                       help="when a pull fails: compute the prompt here, or fail the request "
                            "(default $KVFERRY_KV_FAILURE_POLICY or recompute)")
    group.add_argument("--kv-pull-timeout", type=float, default=30.0, metavar="S",
                       help="seconds a started pull may take before it fails")
    group.add_argument("--kv-read-threads", type=int, default=KVTransferConfig.read_threads,
                       metavar="N",
                       help="READs a large pull (16 MiB or more) is split into, posted at once "
                            "from as many threads (1: one READ; default %(default)s)")
    group.add_argument("--kv-transfer-key-file", default=None, metavar="FILE",
                       help="the service's KV transfer key (a mounted Secret; at least "
                            f"{MIN_KEY_BYTES} bytes), shared by all its pods: it signs the "
                            "params a prefill pod returns and every side-channel call "
                            f"(default ${KEY_ENV})")
    group.add_argument("--kv-transfer-insecure", action="store_true",
                       help="run KV transfers without a key: params are neither signed nor "
                            "checked and the side channel serves anyone who reaches it "
                            "(a trusted network only; a warning is logged)")


def read_transfer_key(args: argparse.Namespace, environ: Mapping[str, str]) -> TransferKey | None:
    """--kv-transfer-key-file, else $KVFERRY_KV_TRANSFER_KEY, else None.

    Raises ValueError (OSError for an unreadable file) naming the source, never the key.
    """
    if args.kv_transfer_key_file is not None:
        with open(args.kv_transfer_key_file, encoding="utf-8") as f:
            text = f.read()
        return TransferKey.from_text(text, f"--kv-transfer-key-file {args.kv_transfer_key_file}")
    return key_from_environment(environ)


@dataclass(frozen=True)
class KVHost:
    """The KV host of a pod and where it came from (named in errors and the start log)."""

    address: str  # an IP address of this machine, e.g. "10.0.0.7", "127.0.0.1"
    source: str  # "--kv-host", "--host", "$POD_IP" or "the default"


def choose_kv_host(kv_host: str | None, host: str, pod_ip: str | None) -> KVHost:
    """The address the KV transfer listeners bind and advertise.

    `--kv-host` when given; else `--host` when it is one address (a pod serving on loopback
    keeps its KV listeners there too, whatever $POD_IP says); else $POD_IP, the pod IP the
    downward API gives (the operator renders `--host 0.0.0.0` and POD_IP); else 127.0.0.1,
    what the pod registry advertises then too.

    Names resolve to their first address; ValueError names the source of a wildcard, or of
    a value that is neither an IP address nor a name this machine resolves.
    """
    if kv_host is not None:
        return KVHost(_one_address(kv_host, "--kv-host"), "--kv-host")
    if host not in WILDCARD_HOSTS:
        return KVHost(_one_address(host, "--host"), "--host")
    if pod_ip:
        return KVHost(_one_address(pod_ip, "$POD_IP"), "$POD_IP")
    return KVHost(FALLBACK_KV_HOST, "the default")


def _one_address(value: str, source: str) -> str:
    try:
        address = ipaddress.ip_address(value.split("%", 1)[0])
    except ValueError:
        try:
            infos = socket.getaddrinfo(value, None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            raise ValueError(f"{source} {value!r} is neither an IP address nor a name this "
                             f"machine resolves") from None
        address = ipaddress.ip_address(str(infos[0][4][0]).split("%", 1)[0])
    if address.is_unspecified:
        raise ValueError(f"{source} {value!r} is a wildcard: the KV transfer listeners bind one "
                         f"address of this machine; give --kv-host the one peers dial")
    return value if "%" in value else str(address)


def kv_transfer_config(
    args: argparse.Namespace,
    nixl_port: int | None,
    lease_s: float | None,
    failure_policy: str | None,
    pod_ip: str | None,
    transfer_key: TransferKey | None = None,
    interfaces: Sequence[InterfaceAddress] | None = None,
) -> KVTransferConfig | None:
    """The connector's config for this pod, or None when it runs without one.

    `nixl_port`, `lease_s`, `failure_policy`, `pod_ip`: from the validated pod environment;
    `transfer_key`: from `read_transfer_key`; `interfaces`: this machine's addresses (None
    reads them). ValueError when the KV host is not an address of this machine.
    """
    port = args.nixl_port if args.nixl_port is not None else nixl_port
    if args.role == "both" and not args.kv_transfer:
        if port is None:
            return None
    if transfer_key is not None and args.kv_transfer_insecure:
        raise ValueError(f"--kv-transfer-insecure and a KV transfer key (--kv-transfer-key-file "
                         f"or ${KEY_ENV}) exclude each other: drop one")
    kv_host = choose_kv_host(args.kv_host, args.host, pod_ip)
    try:
        devices = ucx_net_devices(kv_host.address, interfaces)
    except ValueError as e:
        raise ValueError(f"{kv_host.source} {e}; the KV transfer listeners must bind one of "
                         f"them: give it as --kv-host") from None
    _log_kv_host(kv_host, devices)
    return KVTransferConfig(
        model_id=args.served_model_name or args.model,
        side_channel_host=kv_host.address,
        side_channel_port=port or 0,
        ucx_net_devices=devices,
        lease_s=args.kv_lease_seconds or lease_s or 30.0,
        pull_timeout_s=args.kv_pull_timeout,
        read_threads=args.kv_read_threads,
        failure_policy=args.kv_failure_policy or failure_policy or "recompute",  # type: ignore[arg-type]
        transfer_key=transfer_key,
        insecure=args.kv_transfer_insecure,
        role=args.role,
    )


def _log_kv_host(kv_host: KVHost, devices: str) -> None:
    logger.info("KV transfer listeners on %s (from %s), UCX network devices %s",
                kv_host.address, kv_host.source, devices)
    if kv_host.source == "the default":
        logger.warning("--host is a wildcard and $POD_IP is unset: the KV transfer listeners "
                       "bind %s, so pods on other machines cannot pull from this one; give "
                       "--kv-host the address they reach this machine at", kv_host.address)

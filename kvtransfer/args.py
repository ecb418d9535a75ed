"""`kvferry serve`'s KV-transfer flags and the config they build, per role.

`prefill` and `decode` pods always run a connector; `both` (colocated) runs one when asked
(`--kv-transfer`, or a side-channel port in the pod environment), and then accepts either
kind of `kv_transfer_params`. The operator renders the environment variables; a flag wins
over its variable.

Transfers need the service's key (`--kv-transfer-key-file`, else $KVFERRY_KV_TRANSFER_KEY):
a pod without one starts no connector and answers kv_transfer_params with a 400 naming
both, unless `--kv-transfer-insecure` runs it without signatures.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from kvferry.kvtransfer.auth import KEY_ENV, MIN_KEY_BYTES, TransferKey, key_from_environment
from kvferry.kvtransfer.config import KVTransferConfig


def add_kv_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV transfer (prefill/decode disaggregation)")
    group.add_argument("--kv-transfer", action="store_true",
                       help="with --role both: run the KV connector too (prefill and decode "
                            "roles always do)")
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


def kv_transfer_config(
    args: argparse.Namespace,
    nixl_port: int | None,
    lease_s: float | None,
    failure_policy: str | None,
    pod_ip: str | None,
    transfer_key: TransferKey | None = None,
) -> KVTransferConfig | None:
    """The connector's config for this pod, or None when it runs without one.

    `nixl_port`, `lease_s`, `failure_policy`, `pod_ip`: from the validated pod environment;
    `transfer_key`: from `read_transfer_key`.
    """
    port = args.nixl_port if args.nixl_port is not None else nixl_port
    if args.role == "both" and not args.kv_transfer and port is None:
        return None
    if transfer_key is not None and args.kv_transfer_insecure:
        raise ValueError(f"--kv-transfer-insecure and a KV transfer key (--kv-transfer-key-file "
                         f"or ${KEY_ENV}) exclude each other: drop one")
    bind_all = args.host in ("0.0.0.0", "::", "")
    return KVTransferConfig(
        model_id=args.served_model_name or args.model,
        side_channel_host="0.0.0.0" if bind_all else args.host,
        side_channel_port=port or 0,
        # Peers dial the pod IP when the server listens on every interface.
        advertise_host=pod_ip if bind_all and pod_ip else None,
        lease_s=args.kv_lease_seconds or lease_s or 30.0,
        pull_timeout_s=args.kv_pull_timeout,
        read_threads=args.kv_read_threads,
        failure_policy=args.kv_failure_policy or failure_policy or "recompute",  # type: ignore[arg-type]
        transfer_key=transfer_key,
        insecure=args.kv_transfer_insecure,
        role=args.role,
    )

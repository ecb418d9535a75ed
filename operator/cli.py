"""`kvferry operator`: run the kopf operator that reconciles InferenceService objects."""

from __future__ import annotations

import argparse
import asyncio
import logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `kvferry operator`."""
    parser.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                        help="watch this namespace (repeatable; exact names: the operator does "
                             "not list namespaces); all namespaces when omitted")
    parser.add_argument("--allow-host-path", action="store_true",
                        help="accept hostPath model sources and volumes (off by default: the "
                             "`restricted` Pod Security level forbids them)")
    parser.add_argument("--peering", metavar="NAME", default=None,
                        help="coordinate with other replicas through this kopf peering object "
                             "(default: standalone, one replica)")
    parser.add_argument("--liveness", metavar="URL", default=None,
                        help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz "
                             "(default: none)")
    parser.add_argument("--verbose", "-v", action="store_true", help="log every handler call")
    parser.add_argument("--debug", action="store_true", help="log API traffic too")


def run(args: argparse.Namespace) -> int:
    """Run the operator until SIGINT/SIGTERM; returns the exit status."""
    import kopf
    from kvferry.operator.handlers import build_registry
    from kvferry.operator.reconcile import Policy

    patterns = [ns for ns in args.namespace if any(c in ns for c in "*?![]")]
    if patterns:
        raise SystemExit(f"--namespace takes exact names, not patterns: {', '.join(patterns)}")
    kopf.configure(debug=args.debug, verbose=args.verbose or args.debug, log_prefix=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("celpy").setLevel(logging.WARNING)  # it traces every evaluation step
    asyncio.run(kopf.operator(
        registry=build_registry(Policy(allow_host_path=args.allow_host_path)),
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(),
    ))
    return 0

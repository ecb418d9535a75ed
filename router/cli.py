"""`kvferry router`: the ingress of one InferenceService.

The operator renders `kvferry router --service NAME --redis URL --host H --port P
[--api-key-file F]` with the service's ConfigMap (KVFERRY_ROUTING_<POOL>, ...),
KVFERRY_REDIS_URL or REDIS_PASSWORD and KVFERRY_KV_TRANSFER_KEY in the environment; all of it
is accepted here.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvferry.kvtransfer.args import read_transfer_key
from kvferry.kvtransfer.auth import KEY_ENV, MIN_KEY_BYTES
from kvferry.router.config import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_AUDIO_BODY_BYTES,
    DEFAULT_MAX_POD_CONNECTIONS,
    DEFAULT_POD_GRACE_S,
    HopTimeouts,
    RouterSettings,
    policies_from_env,
    read_api_keys,
)

from kvferry.http_limits import add_http_limit_arguments, http_limits_from_args
from kvferry.protocol.registry import redis_url_from_environment

# Sets --max-embeds-body-bytes where a command line cannot be changed (a service's router
# or pools take it in their `env`).
EMBEDS_LIMIT_ENV = "KVFERRY_MAX_EMBEDS_BODY_BYTES"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--service", default=os.environ.get("KVFERRY_SERVICE") or None,
                        help="the InferenceService whose pods to route to "
                             "(default $KVFERRY_SERVICE)")
    parser.add_argument("--redis", default=None, metavar="URL",
                        help="Redis holding the pod registry (default $KVFERRY_REDIS_URL)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key-file", default=None, metavar="FILE",
                        help="accepted API keys, one per line (a mounted Secret; default: "
                             "none)")
    parser.add_argument("--api-key", action="append", default=None,
                        help="an accepted API key (repeatable; default $KVFERRY_API_KEY)")
    parser.add_argument("--kv-transfer-key-file", default=None, metavar="FILE",
                        help="the service's KV transfer key (at least "
                             f"{MIN_KEY_BYTES} bytes; default ${KEY_ENV}): pod records and KV "
                             "events in Redis that its pods did not sign with it are ignored")
    # A string default goes through `type`, so a bad $KVFERRY_PREFILL_THRESHOLD is a usage
    # error.
    parser.add_argument("--prefill-threshold", type=int, metavar="TOKENS",
                        default=os.environ.get("KVFERRY_PREFILL_THRESHOLD") or "256",
                        help="skip the prefill hop when fewer prompt tokens than this are not "
                             "cached on the decode pod the decode policy picks (by the router's "
                             "prefix index, whatever the policy); for an encoder-decoder model, "
                             "when its decoder prompt is shorter (default "
                             "$KVFERRY_PREFILL_THRESHOLD, the service's "
                             "spec.router.prefillThresholdTokens, or 256)")
    parser.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, metavar="N",
                        help="answer 413 to a request body larger than N bytes, before "
                             "reading it")
    # A string default goes through `type`, so a bad $KVFERRY_MAX_EMBEDS_BODY_BYTES is a
    # usage error.
    parser.add_argument("--max-embeds-body-bytes", type=int, metavar="N",
                        default=os.environ.get(EMBEDS_LIMIT_ENV) or str(32 * 1024 * 1024),
                        help="the larger limit of a /v1/completions body that carries "
                             f"prompt_embeds (default ${EMBEDS_LIMIT_ENV} or 32 MiB; the "
                             "pods take --max-embeds-body-bytes too)")
    parser.add_argument("--max-audio-body-bytes", type=int, metavar="N",
                        default=DEFAULT_MAX_AUDIO_BODY_BYTES,
                        help="answer 413 to a /v1/audio/transcriptions body (the form with "
                             "its audio file) larger than N bytes (default 25 MiB, as the "
                             "pods' --max-audio-body-bytes)")
    parser.add_argument("--connect-timeout", type=float, default=2.0, metavar="S",
                        help="longest wait for a connection to a pod")
    parser.add_argument("--prefill-timeout", type=float, default=120.0, metavar="S",
                        help="longest wait for a prefill pod's answer")
    parser.add_argument("--decode-timeout", type=float, default=120.0, metavar="S",
                        help="longest wait for the next chunk of a decode answer")
    parser.add_argument("--encode-timeout", type=float, default=120.0, metavar="S",
                        help="longest wait for an encoder pod's answer (encoder-decoder "
                             "models)")
    parser.add_argument("--pod-grace", type=float, default=DEFAULT_POD_GRACE_S, metavar="S",
                        help="keep routing to a pod this long after its registry record went "
                             "missing (a late refresh is not a dead pod; a pod that refuses "
                             "a connection, or says it is leaving, is dropped at once) "
                             f"(default {DEFAULT_POD_GRACE_S:g})")
    parser.add_argument("--max-pod-connections", type=int, default=DEFAULT_MAX_POD_CONNECTIONS,
                        metavar="N",
                        help="the most connections open to one pod; requests beyond wait for "
                             "one to come free, within --decode-timeout (or --prefill-timeout "
                             f"for a prefill hop) (default {DEFAULT_MAX_POD_CONNECTIONS})")
    parser.add_argument("--tokenizer", default=None,
                        metavar="DIR",
                        help="the engines' tokenizer (their checkpoint directory, or demo): "
                             "text prompts are tokenized here for prefix-aware routing "
                             "instead of by a pod's /tokenize (default "
                             "$KVFERRY_ROUTER_TOKENIZER; unset: ask a pod)")
    # A string default goes through `type`, so a bad $KVFERRY_DRAIN_SECONDS is a usage error.
    parser.add_argument("--drain-timeout", type=float, metavar="S",
                        default=os.environ.get("KVFERRY_DRAIN_SECONDS")
                        or str(DEFAULT_DRAIN_TIMEOUT_S),
                        help="on SIGTERM, seconds to let in-flight requests finish (default "
                             "$KVFERRY_DRAIN_SECONDS, the engine pods' drain, or 30)")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="log level of the HTTP server's own lines")
    add_http_limit_arguments(parser)


def settings_from_args(args: argparse.Namespace, environ: dict[str, str]) -> RouterSettings:
    """ValueError or OSError name what is wrong."""
    if not args.service:
        raise ValueError("--service (or $KVFERRY_SERVICE) is required")
    redis_url = args.redis or redis_url_from_environment(environ)
    if not redis_url:
        raise ValueError("--redis (or $KVFERRY_REDIS_URL) is required")
    keys: set[str] = set(args.api_key or ())
    if args.api_key_file is not None:
        keys |= read_api_keys(args.api_key_file)
    if not keys and environ.get("KVFERRY_API_KEY"):
        keys.add(environ["KVFERRY_API_KEY"])
    return RouterSettings(
        service=args.service, redis_url=redis_url, host=args.host, port=args.port,
        api_keys=frozenset(keys), policies=policies_from_env(environ),
        prefill_threshold_tokens=args.prefill_threshold, max_body_bytes=args.max_body_bytes,
        max_embeds_body_bytes=args.max_embeds_body_bytes,
        max_audio_body_bytes=args.max_audio_body_bytes,
        timeouts=HopTimeouts(args.connect_timeout, args.prefill_timeout, args.decode_timeout,
                             args.encode_timeout),
        uvicorn_log_level=args.uvicorn_log_level, drain_timeout_s=args.drain_timeout,
        tokenizer=args.tokenizer or environ.get("KVFERRY_ROUTER_TOKENIZER") or None,
        http_limits=http_limits_from_args(args),
        registry_key=read_transfer_key(args, environ),
        pod_grace_s=args.pod_grace, max_pod_connections=args.max_pod_connections,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per proxied request would cost more than the proxying itself.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from kvferry.router.flow import load_tokenizer

    try:
        settings = settings_from_args(args, dict(os.environ))
        tokenizer = load_tokenizer(settings.tokenizer) if settings.tokenizer else None
    except (OSError, ValueError) as exc:
        print(f"kvferry router: error: {exc}", file=sys.stderr)
        return 2
    if settings.registry_key is None:
        logging.getLogger(__name__).warning(
            "no KV transfer key: the router takes any pod record and KV event written to "
            "Redis, signed or not; give it the pods' key with --kv-transfer-key-file FILE or "
            "$%s", KEY_ENV)
    from kvferry.router.app import serve

    return serve(settings, tokenizer)

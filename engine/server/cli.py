"""`kvferry serve`: one engine pod, an OpenAI-compatible server over an engine-core process.

The operator renders this command line for every engine pod (operator/render_pools.py), plus
environment variables from the pod spec and the service's ConfigMap; every one of them is
accepted here, so the two cannot drift apart without a failing test.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvferry.engine.arg_utils import add_engine_arguments, engine_config_from_args
from kvferry.engine.server.state import (
    DEFAULT_MAX_AUDIO_BODY_BYTES,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_EMBEDS_BODY_BYTES,
    DEFAULT_MAX_STOP_BYTES,
    DEFAULT_MAX_STOP_STRINGS,
    TOOL_CALL_PARSERS,
)
from kvferry.kvtransfer.args import (
    add_kv_transfer_arguments,
    kv_transfer_config,
    read_transfer_key,
)
from kvferry.kvtransfer.auth import KEY_ENV, TransferKey

from kvferry.http_limits import add_http_limit_arguments, http_limits_from_args
from kvferry.protocol.registry import redis_url_from_environment

if TYPE_CHECKING:
    from kvferry.engine.server.registry import RegistrationSettings
    from kvferry.kvtransfer.config import KVTransferConfig

ROLES = ("both", "prefill", "decode", "encoder")
KV_FAILURE_POLICIES = ("recompute", "fail")
MODEL_TYPES = ("decoder-only", "encoder-decoder")
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env_role = os.environ.get("KVFERRY_ROLE") or "both"
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--role", default=env_role, choices=ROLES,
                        help="this pod's part in disaggregated serving (default $KVFERRY_ROLE "
                             "or both)")
    server.add_argument("--redis", default=None, metavar="URL",
                        help="Redis of the service (pod registry, prefix index); roles other "
                             "than both use it (default $KVFERRY_REDIS_URL)")
    server.add_argument("--service", default=None, metavar="NAME",
                        help="the InferenceService this pod registers under in Redis "
                             "(default $KVFERRY_SERVICE or 'default')")
    keys = server.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None,
                      help="require 'Authorization: Bearer KEY' on the API "
                           "(default $KVFERRY_API_KEY)")
    keys.add_argument("--api-key-file", default=None, metavar="FILE",
                      help="read the API key from FILE (a mounted Secret; default: none)")
    server.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template (a file or the template text) "
                             "(default: the tokenizer's)")
    server.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                        help="the model's tool-call format, parsed out of its output for "
                             "tool_choice 'auto' (hermes: <tool_call>{...}</tool_call>); "
                             "without it 'auto' is refused (default: none)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's spelling: accepted with --tool-call-parser, which is "
                             "what enables tool_choice 'auto' (default: off)")
    server.add_argument("--max-num-waiting", type=int, default=None, metavar="N",
                        help="answer 429 while N or more requests wait for the engine "
                             "(default: no limit)")
    server.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        metavar="N", help="answer 413 to a request body larger than N bytes, "
                                          "before reading it (default 8 MiB, as the router)")
    # A string default goes through `type`, so a bad $KVFERRY_MAX_EMBEDS_BODY_BYTES is a
    # usage error.
    server.add_argument("--max-embeds-body-bytes", type=int, metavar="N",
                        default=(os.environ.get("KVFERRY_MAX_EMBEDS_BODY_BYTES")
                                 or str(DEFAULT_MAX_EMBEDS_BODY_BYTES)),
                        help="with --enable-prompt-embeds: the larger limit of a "
                             "/v1/completions body that carries prompt_embeds (default "
                             "$KVFERRY_MAX_EMBEDS_BODY_BYTES or 32 MiB)")
    server.add_argument("--max-audio-body-bytes", type=int, default=DEFAULT_MAX_AUDIO_BODY_BYTES,
                        metavar="N", help="answer 413 to a /v1/audio/transcriptions body (the "
                                          "form with its audio file) larger than N bytes "
                                          "(default 25 MiB, as OpenAI)")
    server.add_argument("--max-stop-strings", type=int, default=DEFAULT_MAX_STOP_STRINGS,
                        metavar="N", help="answer 400 to a request with more than N stop "
                                          f"strings (default {DEFAULT_MAX_STOP_STRINGS})")
    server.add_argument("--max-stop-bytes", type=int, default=DEFAULT_MAX_STOP_BYTES,
                        metavar="N", help="answer 400 to a request whose stop strings hold "
                                          "more than N bytes of UTF-8 in all (default "
                                          f"{DEFAULT_MAX_STOP_BYTES})")
    # A string default goes through `type`, so a bad $KVFERRY_DRAIN_SECONDS is a usage error.
    server.add_argument("--drain-timeout", type=float,
                        default=os.environ.get("KVFERRY_DRAIN_SECONDS") or str(DEFAULT_DRAIN_TIMEOUT_S),
                        metavar="S", help="on SIGTERM, seconds to let in-flight requests finish "
                                          "(default $KVFERRY_DRAIN_SECONDS or 30)")
    server.add_argument("--log-prompts", action="store_true",
                        help="put prompt text in the request log lines")
    server.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="log level of the HTTP server's own lines")
    add_http_limit_arguments(parser)
    parallel = parser.add_argument_group("parallelism and inputs")
    parallel.add_argument("--tensor-parallel-size", type=int, default=1,
                          help="tensor-parallel ranks each stage's layers are split over (heads, "
                               "MLP columns, vocabulary), worker processes of one GPU each on a "
                               "GPU machine (Llama-family models; --role both only for now)")
    parallel.add_argument("--pipeline-parallel-size", type=int, default=1,
                          help="pipeline stages: the layers are split over this many worker "
                               "processes, one GPU each on a GPU machine (--role both only "
                               "for now; default 1: the engine process runs the model)")
    parallel.add_argument("--enable-prompt-embeds", action="store_true",
                          help="accept prompt_embeds (base64 of torch.save tensors) in "
                               "/v1/completions in place of a prompt")
    add_kv_transfer_arguments(parser)
    add_engine_arguments(parser)


@dataclass(frozen=True)
class PodEnvironment:
    """The environment the operator gives an engine pod, validated."""

    service: str | None  # KVFERRY_SERVICE: the InferenceService this pod belongs to
    model_type: str  # KVFERRY_MODEL_TYPE
    nixl_port: int | None  # KVFERRY_NIXL_PORT: the KV transfer side channel
    kv_lease_seconds: int | None  # KVFERRY_KV_LEASE_SECONDS
    kv_failure_policy: str | None  # KVFERRY_KV_FAILURE_POLICY
    pod_ip: str | None  # POD_IP
    redis_url: str | None  # KVFERRY_REDIS_URL (an external Redis given by Secret)


def pod_environment(environ: Mapping[str, str]) -> PodEnvironment:
    """Reads the operator's variables; ValueError names a variable whose value is wrong."""
    model_type = environ.get("KVFERRY_MODEL_TYPE") or "decoder-only"
    if model_type not in MODEL_TYPES:
        raise ValueError(f"KVFERRY_MODEL_TYPE must be one of {', '.join(MODEL_TYPES)}, "
                         f"got {model_type!r}")
    policy = environ.get("KVFERRY_KV_FAILURE_POLICY") or None
    if policy is not None and policy not in KV_FAILURE_POLICIES:
        raise ValueError(f"KVFERRY_KV_FAILURE_POLICY must be one of "
                         f"{', '.join(KV_FAILURE_POLICIES)}, got {policy!r}")
    return PodEnvironment(
        service=environ.get("KVFERRY_SERVICE") or None,
        model_type=model_type,
        nixl_port=_int_env(environ, "KVFERRY_NIXL_PORT", 1, 65535),
        kv_lease_seconds=_int_env(environ, "KVFERRY_KV_LEASE_SECONDS", 1, 86400),
        kv_failure_policy=policy,
        pod_ip=environ.get("POD_IP") or None,
        redis_url=redis_url_from_environment(environ),
    )


def _int_env(environ: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    raw = environ.get(name)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def check_supported(args: argparse.Namespace) -> str | None:
    """Why this command line cannot run yet, or None."""
    if args.tensor_parallel_size < 1:
        return f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}"
    if args.pipeline_parallel_size < 1:
        return f"--pipeline-parallel-size must be >= 1, got {args.pipeline_parallel_size}"
    parallel = args.pipeline_parallel_size * args.tensor_parallel_size > 1
    if parallel and args.async_scheduling:
        return ("--async-scheduling with --pipeline-parallel-size or --tensor-parallel-size "
                "> 1 is not available yet")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        return ("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call "
                f"format: {', '.join(TOOL_CALL_PARSERS)})")
    if args.max_body_bytes < 1024:
        return f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}"
    if args.max_embeds_body_bytes < 1024:
        return f"--max-embeds-body-bytes must be >= 1024, got {args.max_embeds_body_bytes}"
    if args.max_audio_body_bytes < 1024:
        return f"--max-audio-body-bytes must be >= 1024, got {args.max_audio_body_bytes}"
    if args.max_stop_strings < 1:
        return f"--max-stop-strings must be >= 1, got {args.max_stop_strings}"
    if args.max_stop_bytes < 1:
        return f"--max-stop-bytes must be >= 1, got {args.max_stop_bytes}"
    if args.max_num_waiting is not None and args.max_num_waiting < 1:
        return f"--max-num-waiting must be >= 1, got {args.max_num_waiting}"
    if not args.drain_timeout >= 0:
        return f"--drain-timeout must be >= 0, got {args.drain_timeout}"
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    return None


def read_api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """--api-key, else the stripped contents of --api-key-file, else $KVFERRY_API_KEY."""
    if args.api_key is not None:
        return args.api_key or None
    if args.api_key_file is not None:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.read().strip()
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        return key
    return environ.get("KVFERRY_API_KEY") or None


def _registration(args: argparse.Namespace, env: PodEnvironment,
                  key: TransferKey | None) -> RegistrationSettings | None:
    """Where to announce this pod: `--redis` (else $KVFERRY_REDIS_URL), under $KVFERRY_SERVICE;
    the record and KV events are signed with `key`, the service's KV transfer key."""
    from kvferry.engine.server.registry import registration_settings

    redis_url = args.redis or env.redis_url
    if redis_url is None:
        return None
    return registration_settings(redis_url, args.service or env.service, args.role, args.host,
                                 args.port, env.pod_ip, key)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = check_supported(args)
    if problem is not None:
        print(f"kvferry serve: {problem}", file=sys.stderr)
        return 2
    from kvferry.engine.server.api_server import ServerSettings, serve

    # The engine core (a child process, which inherits this) shares the machine's cores with
    # the HTTP front end: idle OpenMP workers must sleep, not spin, between its parallel
    # regions, or they take the front end's CPU. A value the user set wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    try:
        env = pod_environment(os.environ)
        config = engine_config_from_args(args)
        transfer_key = read_transfer_key(args, os.environ)
        config.kv_transfer = kv_transfer_config(
            args, env.nixl_port, env.kv_lease_seconds, env.kv_failure_policy,
            env.pod_ip, transfer_key,
        )
        settings = ServerSettings(
            host=args.host, port=args.port, api_key=read_api_key(args, os.environ),
            chat_template=args.chat_template, tool_call_parser=args.tool_call_parser,
            max_num_waiting=args.max_num_waiting,
            max_body_bytes=args.max_body_bytes, max_stop_strings=args.max_stop_strings,
            max_stop_bytes=args.max_stop_bytes, drain_timeout_s=args.drain_timeout, log_prompts=args.log_prompts,
            max_embeds_body_bytes=(args.max_embeds_body_bytes if args.enable_prompt_embeds
                                   else None),
            max_audio_body_bytes=args.max_audio_body_bytes,
            uvicorn_log_level=args.uvicorn_log_level,
            registration=_registration(args, env, transfer_key),
            http_limits=http_limits_from_args(args),
        )
    except (OSError, ValueError) as exc:
        print(f"kvferry serve: error: {exc}", file=sys.stderr)
        return 2
    _warn_about_transfer_security(config.kv_transfer)
    return serve(config, settings)


def _warn_about_transfer_security(config: KVTransferConfig | None) -> None:
    """A pod that transfers KV without a key says so at start, once."""
    log = logging.getLogger(__name__)
    if config is None or config.transfer_key is not None:
        return
    if config.insecure:
        log.warning("--kv-transfer-insecure: KV transfer params are neither signed nor checked "
                    "and the side channel serves anyone who reaches it; run this only on a "
                    "network where every client is trusted")
    else:
        log.warning("no KV transfer key: this %s pod starts no KV connector and refuses "
                    "requests with kv_transfer_params; give every pod of the service the same "
                    "key with --kv-transfer-key-file FILE or $%s", config.role, KEY_ENV)

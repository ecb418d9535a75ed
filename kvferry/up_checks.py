"""What `kvferry up` settles before it starts any process, each a clear error when it cannot.

The Redis URL and the router's API key that a cluster keeps in Secrets, the router's port,
the model (a checkpoint the engine can load, downloaded first when it is a hub id) and the
KV transfer key of the run. A run that would fail on one of them fails here, at once, with
one message, instead of as processes that crash and restart.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from kvferry.protocol.registry import REDIS_URL_ENV, redis_url_from_environment

if TYPE_CHECKING:
    from kvferry.operator.spec import InferenceServiceSpec

logger = logging.getLogger("kvferry.up")

# Where a local run finds the router's API key that a cluster keeps in
# `spec.router.apiKeySecret` (the router reads it from there too).
API_KEY_ENV = "KVFERRY_API_KEY"


class NoRedisURL(ValueError):
    """The spec keeps its Redis URL in a Secret, which a local run cannot read."""


def external_redis_url(spec: InferenceServiceSpec, environ: dict[str, str]) -> str | None:
    """The URL of the Redis the spec names (None: `kvferry up` runs one).

    A cluster hands the pods `spec.redis.urlSecret` from the Secret; here nothing can read
    it, so the same URL comes from $KVFERRY_REDIS_URL instead.
    """
    ref = spec.redis.url_secret
    if ref is None:
        return spec.redis.url
    url = redis_url_from_environment(environ)
    if not url:
        raise NoRedisURL(
            f"spec.redis.urlSecret names key {ref.key!r} of Secret {ref.name!r}, which a local "
            f"run cannot read: set {REDIS_URL_ENV} to that Redis URL, or give the URL as "
            "spec.redis.url")
    return url


class NoAPIKey(ValueError):
    """The spec keeps the router's API key in a Secret, which a local run cannot read."""


def check_api_key(spec: InferenceServiceSpec, environ: dict[str, str]) -> None:
    """Refuses to run a keyed service without its key.

    Without the check the router would come up with no key at all, open to anyone, while
    the manifest asks for one.
    """
    ref = spec.router.api_key_secret
    if ref is None or environ.get(API_KEY_ENV, "").strip():
        return
    raise NoAPIKey(
        f"spec.router.apiKeySecret names key {ref.key!r} of Secret {ref.name!r}, which a local "
        f"run cannot read: set {API_KEY_ENV} to that API key, or drop spec.router.apiKeySecret "
        "to serve without a key")


class PortInUse(OSError):
    """The router's address is taken by another process."""


def check_port_free(host: str, port: int) -> None:
    """Binds `host:port` once, so that a taken port fails now, not as a router crash loop.

    Whatever holds the port could even answer the readiness probe in the router's place.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PortInUse(f"cannot listen on {host}:{port}: {exc}") from exc
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            raise PortInUse(f"cannot listen on {host}:{port} ({exc.strerror}): another process "
                            "holds it; stop it or choose another --port") from exc


def local_model_arg(source_scheme: str, source_path: str) -> str:
    """`--model` for a local run: a demo, a hub id, or the host directory itself."""
    if source_scheme == "demo":
        return source_path or "demo"
    if source_scheme in ("hf", "hostpath"):
        return source_path if source_scheme == "hf" else "/" + source_path.lstrip("/")
    raise ValueError(f"model source scheme {source_scheme!r} needs a cluster; run locally with "
                     "hostpath:///DIR or hf://ORG/NAME")


class ModelSourceError(ValueError):
    """The spec's model is one the engine pods cannot load."""


# What every model source error ends with: what the source may name.
MODEL_SOURCE_FIX = ("spec.model.source must name a checkpoint the engine can load: "
                    "hostpath:///DIR for an HF checkpoint directory on this machine (config.json "
                    "of a supported architecture, *.safetensors, tokenizer.json), hf://ORG/NAME "
                    "where the hub is reachable, or demo")


def check_model_source(spec: InferenceServiceSpec) -> str:
    """The `--model` of the local pods, once the checkpoint is found loadable.

    The pods would fail on the same checks one after the other, each after seconds of
    start-up; here they fail once, before anything starts. A hub model is downloaded here,
    once, and the pods load the downloaded directory.
    """
    from kvferry.engine.models.checkpoint import CheckpointError, check_checkpoint
    from kvferry.engine.models.source import download_from_hub

    scheme = spec.model.source_scheme
    model = local_model_arg(scheme, spec.model.source_path)
    if scheme == "demo":
        return model  # generated by the pods on first use, always loadable
    try:
        if scheme == "hf":
            logger.info("fetching %s from the hub (or its local cache)", spec.model.source)
            model = str(download_from_hub(model))
        arch = check_checkpoint(Path(model), has_own_tokenizer=given_tokenizer(spec) is None)
    except (CheckpointError, ValueError) as exc:
        reason = str(exc).rstrip(".")
        raise ModelSourceError(f"spec.model.source {spec.model.source}: {reason}. "
                               f"{MODEL_SOURCE_FIX}") from None
    check_model_type(spec, arch.architecture, arch.is_encoder_decoder)
    return model


def check_model_type(spec: InferenceServiceSpec, architecture: str,
                     is_encoder_decoder: bool) -> None:
    """Refuses a checkpoint whose kind is not `spec.model.type`: an encoder pool would run
    no encoder (or the pods of an encoder-decoder model would go without the pool's work
    counted as such)."""
    kind = "encoder-decoder" if is_encoder_decoder else "decoder-only"
    if kind == spec.model.type:
        return
    fix = ("set spec.model.type: encoder-decoder" if is_encoder_decoder else
           "set spec.model.type: decoder-only" + (" and drop spec.pools.encoder"
                                                  if "encoder" in spec.pools else ""))
    raise ModelSourceError(f"spec.model.source {spec.model.source} is {architecture}, "
                           f"{'an' if is_encoder_decoder else 'a'} {kind} model, and "
                           f"spec.model.type says {spec.model.type}: {fix}")


def given_tokenizer(spec: InferenceServiceSpec) -> str | None:
    """The `--tokenizer` the spec's extra engine flags give the pods, if any."""
    args = list(spec.engine.extra_args)
    for index, arg in enumerate(args):
        if arg.startswith("--tokenizer="):
            return arg.split("=", 1)[1]
        if arg == "--tokenizer" and index + 1 < len(args):
            return args[index + 1]
    return None


def transfer_key_text(environ: dict[str, str]) -> str:
    """The run's KV transfer key: $KVFERRY_KV_TRANSFER_KEY (checked), else a random one."""
    from kvferry.kvtransfer.auth import generate_key_text, key_from_environment

    given = key_from_environment(environ)
    return given.text if given is not None else generate_key_text()

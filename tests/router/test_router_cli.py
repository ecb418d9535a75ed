"""The operator/router contract: every `kvferry router` command line and environment the
operator renders for the router pod parses and validates with the real `kvferry router`."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from kvferry.kvtransfer.auth import KEY_ENV, TransferKey
from kvferry.operator.render import render_children
from kvferry.operator.render_pools import model_arg
from kvferry.operator.spec import parse_spec
from kvferry.router.cli import settings_from_args
from kvferry.router.config import read_api_keys
from kvferry_testing.operator_factories import EXAMPLES, load_example, random_spec, service

from kvferry.cli import build_parser

# The service's KV transfer key Secret, as the router reads it from its environment.
STAND_IN_TRANSFER_KEY = "a-stand-in-for-the-services-kv-transfer-key"


def router_container(manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The router container and its environment (ConfigMap plus env, secrets stood in)."""
    children = render_children(parse_spec(manifest))
    config_maps = {c.name: c.manifest["data"] for c in children if c.kind == "ConfigMap"}
    (container,) = [c for child in children if child.kind == "Deployment"
                    for c in child.manifest["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "router"]
    env: dict[str, str] = {}
    for ref in container.get("envFrom", ()):
        env.update(config_maps.get(ref.get("configMapRef", {}).get("name"), {}))
    stand_ins = {"KVFERRY_REDIS_URL": "redis://:pw@redis:6379/0", KEY_ENV: STAND_IN_TRANSFER_KEY}
    for var in container.get("env", ()):
        env[var["name"]] = var.get("value", stand_ins.get(var["name"], "secret"))
    return container, env


def check_rendered(manifest: dict[str, Any], tmp_path: Path) -> None:
    spec = parse_spec(manifest)
    container, env = router_container(manifest)
    args = container["args"]
    assert args[:2] == ["kvferry", "router"], args
    parsed = build_parser(args[1:]).parse_args(args[1:])
    assert parsed.command == "router"
    if parsed.api_key_file is not None:
        # The mounted Secret, stood in by a local file with the same contents shape.
        key_file = tmp_path / "key"
        key_file.write_text("a-key\n")
        assert parsed.api_key_file.endswith("/" + spec.router.api_key_secret.key)
        parsed.api_key_file = str(key_file)
    settings = settings_from_args(parsed, env)
    assert settings.service == spec.name
    # It checks the pods' registry records with the key the pods sign them with.
    assert settings.registry_key == TransferKey(STAND_IN_TRANSFER_KEY.encode())
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    for pool, policy in spec.router.routing.items():
        assert settings.policies[pool] == policy
    # Weights on a claim are mounted in the router too: it tokenizes with their tokenizer.
    if spec.model.source_scheme == "pvc":
        assert settings.tokenizer == model_arg(spec)
        assert settings.tokenizer.startswith(
            next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "model"))
    else:
        assert settings.tokenizer is None


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_renders_a_router_command_line_it_accepts(path: Path,
                                                                tmp_path: Path) -> None:
    check_rendered(load_example(path), tmp_path)


@pytest.mark.parametrize("seed", range(40))
def test_random_specs_render_router_command_lines_it_accepts(seed: int, tmp_path: Path) -> None:
    check_rendered(service(random_spec(random.Random(seed)), name=f"svc{seed}"), tmp_path)


def test_unknown_policy_names_the_variable() -> None:
    args = build_parser(["router"]).parse_args(["router", "--service", "s", "--redis", "redis://x"])
    with pytest.raises(ValueError, match="KVFERRY_ROUTING_DECODE"):
        settings_from_args(args, {"KVFERRY_ROUTING_DECODE": "random"})


def test_redis_and_service_come_from_the_environment_too() -> None:
    args = build_parser(["router"]).parse_args(["router", "--service", "s"])
    assert settings_from_args(args, {"KVFERRY_REDIS_URL": "redis://r:6379/0"}).redis_url == "redis://r:6379/0"
    with pytest.raises(ValueError, match="--redis"):
        settings_from_args(args, {})


def test_the_deprecated_redis_url_variable_is_still_read_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    args = build_parser(["router"]).parse_args(["router", "--service", "s"])
    with caplog.at_level("WARNING"):
        settings = settings_from_args(args, {"REDIS_URL": "redis://old:6379/0"})
    assert settings.redis_url == "redis://old:6379/0"
    assert caplog.messages == ["$REDIS_URL is deprecated and will stop being read: set "
                               "$KVFERRY_REDIS_URL instead"]
    caplog.clear()
    both = {"REDIS_URL": "redis://old:6379/0", "KVFERRY_REDIS_URL": "redis://new:6379/0"}
    assert settings_from_args(args, both).redis_url == "redis://new:6379/0"
    assert caplog.messages == []


def test_the_tokenizer_comes_from_the_flag_or_the_environment() -> None:
    env = {"KVFERRY_REDIS_URL": "redis://r:6379/0", "KVFERRY_ROUTER_TOKENIZER": "/models/llama"}
    parser = build_parser(["router"])
    plain = parser.parse_args(["router", "--service", "s"])
    assert settings_from_args(plain, env).tokenizer == "/models/llama"
    assert settings_from_args(plain, {"KVFERRY_REDIS_URL": "redis://r:6379/0"}).tokenizer is None
    flagged = parser.parse_args(["router", "--service", "s", "--tokenizer", "demo"])
    assert settings_from_args(flagged, env).tokenizer == "demo"


def test_api_key_file_holds_one_or_several_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("one\n\n  two  \n")
    assert read_api_keys(str(path)) == frozenset({"one", "two"})
    path.write_text("\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_api_keys(str(path))


def test_the_drain_timeout_comes_from_the_flag_or_the_pods_drain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"KVFERRY_REDIS_URL": "redis://r:6379/0"}
    plain = ["router", "--service", "s"]
    assert settings_from_args(build_parser(plain).parse_args(plain), env).drain_timeout_s == 30
    monkeypatch.setenv("KVFERRY_DRAIN_SECONDS", "75")
    assert settings_from_args(build_parser(plain).parse_args(plain), env).drain_timeout_s == 75
    flagged = [*plain, "--drain-timeout", "5"]
    assert settings_from_args(build_parser(flagged).parse_args(flagged), env).drain_timeout_s == 5
    negative = [*plain, "--drain-timeout", "-1"]
    with pytest.raises(ValueError, match="--drain-timeout"):
        settings_from_args(build_parser(negative).parse_args(negative), env)


def test_the_prefill_threshold_comes_from_the_flag_or_the_services_config_map(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's ConfigMap (spec.router.prefillThresholdTokens) reaches the router as
    the variable the router reads."""
    from kvferry.operator.render import render_config_map
    from kvferry.operator.spec import parse_spec

    manifest = {"apiVersion": "kvferry.dev/v1alpha1", "kind": "InferenceService",
                "metadata": {"name": "s", "namespace": "default"},
                "spec": {"model": {"source": "demo"}, "pools": {"decode": {}},
                         "router": {"prefillThresholdTokens": 40}}}
    data = render_config_map(parse_spec(manifest))["data"]
    env = {"KVFERRY_REDIS_URL": "redis://r:6379/0"}
    plain = ["router", "--service", "s"]
    assert settings_from_args(build_parser(plain).parse_args(plain),
                              env).prefill_threshold_tokens == 256
    for name, value in data.items():
        monkeypatch.setenv(name, value)
    assert settings_from_args(build_parser(plain).parse_args(plain),
                              env).prefill_threshold_tokens == 40
    flagged = [*plain, "--prefill-threshold", "8"]
    assert settings_from_args(build_parser(flagged).parse_args(flagged),
                              env).prefill_threshold_tokens == 8


def test_the_transfer_key_comes_from_the_flag_or_the_environment(tmp_path: Path) -> None:
    parser = build_parser(["router"])
    env = {"KVFERRY_REDIS_URL": "redis://r:6379/0"}
    plain = parser.parse_args(["router", "--service", "s"])
    assert settings_from_args(plain, env).registry_key is None
    from_env = settings_from_args(plain, {**env, KEY_ENV: STAND_IN_TRANSFER_KEY})
    assert from_env.registry_key == TransferKey(STAND_IN_TRANSFER_KEY.encode())
    assert STAND_IN_TRANSFER_KEY not in repr(from_env)
    key_file = tmp_path / "key"
    key_file.write_text("a-key-from-a-mounted-file-0123456789abcdef\n")
    flagged = parser.parse_args(["router", "--service", "s", "--kv-transfer-key-file",
                                 str(key_file)])
    # The file wins over the variable, as for the pods.
    assert settings_from_args(flagged, {**env, KEY_ENV: STAND_IN_TRANSFER_KEY}).registry_key \
        == TransferKey(b"a-key-from-a-mounted-file-0123456789abcdef")
    key_file.write_text("short\n")
    with pytest.raises(ValueError, match=f"--kv-transfer-key-file {key_file}: a KV transfer "
                                         "key needs at least 32 bytes, this one has 5"):
        settings_from_args(flagged, env)


def test_the_embeds_body_limit_comes_from_the_flag_or_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"REDIS_URL": "redis://r:6379/0"}
    plain = ["router", "--service", "s"]

    def limit(argv: list[str]) -> int:
        return settings_from_args(build_parser(argv).parse_args(argv), env).max_embeds_body_bytes

    assert limit(plain) == 32 * 1024 * 1024
    monkeypatch.setenv("KVFERRY_MAX_EMBEDS_BODY_BYTES", "1000000")
    assert limit(plain) == 1_000_000
    assert limit([*plain, "--max-embeds-body-bytes", "2000000"]) == 2_000_000
    with pytest.raises(ValueError, match="--max-embeds-body-bytes must be >= 1024"):
        limit([*plain, "--max-embeds-body-bytes", "10"])
    monkeypatch.setenv("KVFERRY_MAX_EMBEDS_BODY_BYTES", "lots")
    with pytest.raises(SystemExit):  # a usage error, as a bad flag
        limit(plain)


def test_the_audio_body_limit_and_the_encode_timeout_come_from_their_flags() -> None:
    env = {"KVFERRY_REDIS_URL": "redis://r:6379/0"}
    plain = ["router", "--service", "s"]

    def settings(*flags: str) -> Any:
        argv = [*plain, *flags]
        return settings_from_args(build_parser(argv).parse_args(argv), env)

    default = settings()
    # The pods' own default (--max-audio-body-bytes of `kvferry serve`), OpenAI's 25 MiB.
    assert default.max_audio_body_bytes == 25 * 1024 * 1024
    assert default.timeouts.encode_s == 120.0
    given = settings("--max-audio-body-bytes", "1000000", "--encode-timeout", "7.5")
    assert (given.max_audio_body_bytes, given.timeouts.encode_s) == (1_000_000, 7.5)
    with pytest.raises(ValueError, match="--max-audio-body-bytes must be >= 1024"):
        settings("--max-audio-body-bytes", "10")
    with pytest.raises(ValueError, match="HopTimeouts.encode_s must be > 0"):
        settings("--encode-timeout", "0")

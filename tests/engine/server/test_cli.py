"""The operator/engine contract: every `kvferry serve` command line and environment the
operator renders for an engine pod parses with the real `kvferry serve` parser."""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvferry.engine.arg_utils import engine_config_from_args
from kvferry.engine.server.cli import check_supported, pod_environment, read_api_key
from kvferry.kvtransfer.args import kv_transfer_config, read_transfer_key
from kvferry.kvtransfer.auth import KEY_ENV
from kvferry.kvtransfer.interfaces import InterfaceAddress
from kvferry.operator.render import render_children
from kvferry.operator.spec import parse_spec
from kvferry_testing.keys import TEST_KEY, TEST_KEY_TEXT
from kvferry_testing.operator_factories import EXAMPLES, load_example, random_spec, service

from kvferry.cli import build_parser

# Per-step token budgets `kvferry serve` defaults to by role (README, --help).
ROLE_BATCHED_TOKENS = {"both": 2048, "prefill": 8192, "decode": 512}
# The pod IP `pod_env` stands in for the downward API's, and a pod's interfaces holding it.
POD_IP = "10.0.0.7"
POD_INTERFACES = [InterfaceAddress("lo", "127.0.0.1", True),
                  InterfaceAddress("eth0", POD_IP, False)]


def engine_containers(manifest: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """(engine container, its ConfigMap's data) of every engine Deployment."""
    children = render_children(parse_spec(manifest))
    config_maps = {c.name: c.manifest["data"] for c in children if c.kind == "ConfigMap"}
    out = []
    for child in children:
        if child.kind != "Deployment":
            continue
        for container in child.manifest["spec"]["template"]["spec"]["containers"]:
            if container["name"] == "engine":
                # The operator's own ConfigMap, beside any envFrom the spec passes through.
                (data,) = [
                    config_maps[ref["configMapRef"]["name"]]
                    for ref in container["envFrom"]
                    if ref.get("configMapRef", {}).get("name") in config_maps
                ]
                out.append((container, data))
    return out


def parse_serve(args: list[str]) -> argparse.Namespace:
    assert args[:2] == ["kvferry", "serve"], args
    argv = args[1:]
    return build_parser(argv).parse_args(argv)


def pod_env(container: dict[str, Any], config_map: dict[str, str]) -> dict[str, str]:
    """The container's environment, secret and field references given stand-in values."""
    env = dict(config_map)
    for var in container["env"]:
        env[var["name"]] = var.get("value", POD_IP if var["name"] == "POD_IP" else "secret")
    return env


def check_rendered(manifest: dict[str, Any]) -> int:
    spec = parse_spec(manifest)
    pods = engine_containers(manifest)
    assert len(pods) == len(spec.pools)
    for container, config_map in pods:
        args = parse_serve(container["args"])
        assert args.command == "serve"
        assert args.role in ("both", "prefill", "decode", "encoder")
        assert args.port == 8000 and args.host == "0.0.0.0"
        assert args.served_model_name == spec.model.served_name
        assert args.block_size == spec.engine.block_size
        assert args.tensor_parallel_size == spec.engine.tensor_parallel_size
        assert args.max_model_len == spec.model.max_model_len
        assert args.enable_prompt_embeds == spec.engine.enable_prompt_embeds
        assert args.enable_prefix_caching  # on unless --no-enable-prefix-caching
        config = engine_config_from_args(args)  # the engine's own validation accepts them
        # The spec's budget when it sets one, else the role's default.
        assert config.scheduler.max_num_batched_tokens == (
            spec.engine.max_num_batched_tokens or ROLE_BATCHED_TOKENS.get(args.role, 2048))
        environment = pod_environment(pod_env(container, config_map))
        assert environment.model_type == spec.model.type
        assert environment.service == spec.name
        assert check_supported(args) is None, container["args"]
        # Every pool runs a connector (the ConfigMap names the side-channel port), parallel
        # pods too, and its KV listeners bind the pod IP, on the pod IP's interface only.
        transfer = kv_transfer_config(args, environment.nixl_port, None, None,
                                      environment.pod_ip, interfaces=POD_INTERFACES)
        assert transfer is not None
        assert (transfer.side_channel_host, transfer.ucx_net_devices) == (POD_IP, "eth0")
    return len(pods)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_renders_command_lines_serve_accepts(path: Path) -> None:
    assert check_rendered(load_example(path)) >= 1


@pytest.mark.parametrize("seed", range(40))
def test_random_specs_render_command_lines_serve_accepts(seed: int) -> None:
    assert check_rendered(service(random_spec(random.Random(seed)), name=f"svc{seed}")) >= 1


def test_a_flag_serve_does_not_know_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_serve(["kvferry", "serve", "--model", "demo", "--no-such-flag"])


def test_role_defaults_to_the_pod_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_ROLE", "decode")
    assert parse_serve(["kvferry", "serve", "--model", "demo"]).role == "decode"
    monkeypatch.delenv("KVFERRY_ROLE")
    assert parse_serve(["kvferry", "serve", "--model", "demo"]).role == "both"


def test_every_role_runs() -> None:
    # (--role encoder with a decoder-only model is refused once the model is known: by
    # the engine core, tests/engine/server/test_encoder_pool.py.)
    base = ["kvferry", "serve", "--model", "demo"]
    for role in ("both", "prefill", "decode", "encoder"):
        assert check_supported(parse_serve([*base, "--role", role])) is None
    assert "--max-num-waiting" in check_supported(parse_serve([*base, "--max-num-waiting", "0"]))


def test_pipeline_and_tensor_parallelism_run_with_every_role() -> None:
    base = ["kvferry", "serve", "--model", "demo"]
    args = parse_serve([*base, "--pipeline-parallel-size", "2"])
    assert check_supported(args) is None
    assert engine_config_from_args(args).parallel.pipeline_parallel_size == 2
    args = parse_serve([*base, "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"])
    assert check_supported(args) is None
    assert engine_config_from_args(args).parallel.world_size == 4
    assert check_supported(parse_serve([*base, "--tensor-parallel-size", "0"])) == (
        "--tensor-parallel-size must be >= 1, got 0")
    assert check_supported(parse_serve([*base, "--tensor-parallel-size", "2",
                                        "--role", "prefill"])) is None
    assert check_supported(parse_serve([*base, "--pipeline-parallel-size", "0"])) == (
        "--pipeline-parallel-size must be >= 1, got 0")
    assert check_supported(parse_serve([*base, "--pipeline-parallel-size", "2",
                                        "--role", "decode"])) is None
    refused = check_supported(parse_serve([*base, "--pipeline-parallel-size", "2",
                                           "--async-scheduling"]))
    assert refused is not None and "--async-scheduling" in refused


@pytest.mark.parametrize(("env", "message"), [
    ({"KVFERRY_MODEL_TYPE": "seq2seq"}, "KVFERRY_MODEL_TYPE"),
    ({"KVFERRY_NIXL_PORT": "port"}, "KVFERRY_NIXL_PORT must be an integer"),
    ({"KVFERRY_NIXL_PORT": "70000"}, "[1, 65535]"),
    ({"KVFERRY_KV_FAILURE_POLICY": "retry"}, "KVFERRY_KV_FAILURE_POLICY"),
])
def test_wrong_pod_environment_names_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        pod_environment(env)


def test_api_key_sources(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    base = ["kvferry", "serve", "--model", "demo"]
    assert read_api_key(parse_serve([*base, "--api-key", "k1"]), {}) == "k1"
    assert read_api_key(parse_serve([*base, "--api-key-file", str(key_file)]), {}) == "s3cret"
    assert read_api_key(parse_serve(base), {"KVFERRY_API_KEY": "k2"}) == "k2"
    assert read_api_key(parse_serve(base), {}) is None
    with pytest.raises(SystemExit):  # one source at a time
        parse_serve([*base, "--api-key", "a", "--api-key-file", str(key_file)])


def test_the_drain_timeout_comes_from_the_services_config_map(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = load_example(EXAMPLES[0])
    manifest.setdefault("spec", {}).setdefault("engine", {})["drainSeconds"] = 45
    container, config_map = engine_containers(manifest)[0]
    assert config_map["KVFERRY_DRAIN_SECONDS"] == "45"
    for name, value in pod_env(container, config_map).items():
        monkeypatch.setenv(name, value)
    assert parse_serve(container["args"]).drain_timeout == 45.0
    monkeypatch.setenv("KVFERRY_DRAIN_SECONDS", "soon")
    with pytest.raises(SystemExit):
        parse_serve(container["args"])
    assert "invalid float value: 'soon'" in capsys.readouterr().err


def test_kv_transfer_config_per_role() -> None:
    base = ["kvferry", "serve", "--model", "demo"]
    both = parse_serve(base)
    assert kv_transfer_config(both, None, None, None, None) is None
    # The operator's side-channel port turns the connector on for a colocated pod too.
    assert kv_transfer_config(both, 5600, None, None, None).side_channel_port == 5600
    prefill = parse_serve([*base, "--role", "prefill", "--host", "0.0.0.0"])
    config = kv_transfer_config(prefill, 5600, 12, "fail", POD_IP, interfaces=POD_INTERFACES)
    # Listening on every interface, the pod's KV listeners bind and advertise its pod IP.
    assert (config.side_channel_host, config.advertise_host) == (POD_IP, None)
    assert (config.lease_s, config.failure_policy, config.model_id) == (12, "fail", "demo")
    decode = parse_serve([*base, "--role", "decode", "--kv-lease-seconds", "3",
                          "--kv-failure-policy", "recompute"])
    config = kv_transfer_config(decode, None, 12, "fail", None)
    assert (config.side_channel_port, config.lease_s, config.failure_policy) == (0, 3, "recompute")
    assert config.read_threads == 2
    single = parse_serve([*base, "--role", "decode", "--kv-read-threads", "1"])
    assert kv_transfer_config(single, None, None, None, None).read_threads == 1
    with pytest.raises(ValueError, match="read_threads"):
        kv_transfer_config(parse_serve([*base, "--role", "decode", "--kv-read-threads", "0"]),
                           None, None, None, None)


def batched_tokens(argv: list[str]) -> int:
    return engine_config_from_args(parse_serve(argv)).scheduler.max_num_batched_tokens


def test_role_defaults_apply_per_role_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["kvferry", "serve", "--model", "demo"]
    monkeypatch.delenv("KVFERRY_ROLE", raising=False)
    assert batched_tokens(base) == 2048
    assert batched_tokens([*base, "--role", "both"]) == 2048
    assert batched_tokens([*base, "--role", "prefill"]) == 8192
    assert batched_tokens([*base, "--role", "decode"]) == 512
    for role in ("both", "prefill", "decode"):
        assert batched_tokens([*base, "--role", role, "--max-num-batched-tokens", "1000"]) == 1000
        # Given before the role, too.
        assert batched_tokens([*base, "--max-num-batched-tokens", "3000", "--role", role]) == 3000
    # The role from the pod environment brings its defaults with it.
    monkeypatch.setenv("KVFERRY_ROLE", "decode")
    assert batched_tokens(base) == 512
    assert batched_tokens([*base, "--role", "prefill"]) == 8192


def test_help_lists_the_role_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_serve(["kvferry", "serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default by --role: both 2048, prefill 8192, decode 512" in text


def test_rendered_pools_take_their_role_defaults_unless_the_spec_sets_a_budget() -> None:
    manifest = load_example(next(p for p in EXAMPLES if p.stem == "demo"))
    roles = {parse_serve(c["args"]).role: batched_tokens(c["args"])
             for c, _ in engine_containers(manifest)}
    assert roles == {"prefill": 8192, "decode": 512}
    manifest["spec"]["engine"]["maxNumBatchedTokens"] = 4096
    roles = {parse_serve(c["args"]).role: batched_tokens(c["args"])
             for c, _ in engine_containers(manifest)}
    assert roles == {"prefill": 4096, "decode": 4096}


# ---------------------------------------------------------------------------- transfer key
def test_the_transfer_key_comes_from_the_file_else_the_environment(tmp_path: Path) -> None:
    base = ["kvferry", "serve", "--model", "demo", "--role", "decode"]
    key_file = tmp_path / "key"
    key_file.write_text(TEST_KEY_TEXT + "\n")
    from_file = read_transfer_key(parse_serve([*base, "--kv-transfer-key-file", str(key_file)]),
                                  {KEY_ENV: "an-other-key-from-the-environment-0123456789"})
    assert from_file == TEST_KEY
    assert read_transfer_key(parse_serve(base), {KEY_ENV: TEST_KEY_TEXT}) == TEST_KEY
    assert read_transfer_key(parse_serve(base), {}) is None
    config = kv_transfer_config(parse_serve(base), None, None, None, None, TEST_KEY)
    assert (config.transfer_key, config.role, config.insecure) == (TEST_KEY, "decode", False)


@pytest.mark.parametrize(("content", "message"), [
    ("", "holds no KV transfer key (it is empty)"),
    ("too-short\n", "a KV transfer key needs at least 32 bytes, this one has 9"),
])
def test_a_bad_key_file_is_a_usage_error_that_never_shows_the_key(
    tmp_path: Path, content: str, message: str
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(content)
    done = subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", "--model", "demo",
                           "--role", "decode", "--kv-transfer-key-file", str(key_file)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("kvferry serve: error:")]
    assert line.startswith(f"kvferry serve: error: --kv-transfer-key-file {key_file}")
    assert message in line
    assert not content.strip() or content.strip() not in done.stderr


def test_a_key_and_insecure_together_are_refused() -> None:
    args = parse_serve(["kvferry", "serve", "--model", "demo", "--role", "prefill",
                        "--kv-transfer-insecure"])
    with pytest.raises(ValueError, match="--kv-transfer-insecure and a KV transfer key"):
        kv_transfer_config(args, None, None, None, None, TEST_KEY)
    assert kv_transfer_config(args, None, None, None, None).insecure


def test_stop_string_limits_default_to_64_strings_and_16_kib() -> None:
    base = ["kvferry", "serve", "--model", "demo"]
    args = parse_serve(base)
    assert (args.max_stop_strings, args.max_stop_bytes) == (64, 16384)
    args = parse_serve([*base, "--max-stop-strings", "4", "--max-stop-bytes", "100"])
    assert (args.max_stop_strings, args.max_stop_bytes) == (4, 100)
    assert check_supported(parse_serve([*base, "--max-stop-strings", "0"])) == (
        "--max-stop-strings must be >= 1, got 0")


def test_the_audio_body_limit_defaults_to_openais_25_mib() -> None:
    base = ["kvferry", "serve", "--model", "demo"]
    assert parse_serve(base).max_audio_body_bytes == 25 * 1024 * 1024
    assert parse_serve([*base, "--max-audio-body-bytes", "4096"]).max_audio_body_bytes == 4096
    assert check_supported(parse_serve([*base, "--max-audio-body-bytes", "10"])) == (
        "--max-audio-body-bytes must be >= 1024, got 10")


def test_the_embeds_body_limit_applies_only_with_prompt_embeds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["kvferry", "serve", "--model", "demo"]
    assert parse_serve(base).max_embeds_body_bytes == 32 * 1024 * 1024
    monkeypatch.setenv("KVFERRY_MAX_EMBEDS_BODY_BYTES", "2000000")
    assert parse_serve(base).max_embeds_body_bytes == 2_000_000
    assert parse_serve([*base, "--max-embeds-body-bytes", "3000"]).max_embeds_body_bytes == 3000
    assert check_supported(parse_serve([*base, "--max-embeds-body-bytes", "10"])) == (
        "--max-embeds-body-bytes must be >= 1024, got 10")
    # The engine config carries the flag to the core.
    assert engine_config_from_args(parse_serve([*base, "--enable-prompt-embeds"])) \
        .model.enable_prompt_embeds
    assert not engine_config_from_args(parse_serve(base)).model.enable_prompt_embeds


def test_async_scheduling_is_off_unless_asked_for() -> None:
    base = ["kvferry", "serve", "--model", "demo"]
    assert not engine_config_from_args(parse_serve(base)).scheduler.async_scheduling
    assert engine_config_from_args(parse_serve([*base, "--async-scheduling"])) \
        .scheduler.async_scheduling


def test_the_redis_url_comes_from_kvferry_redis_url_or_the_deprecated_name(
        caplog: pytest.LogCaptureFixture) -> None:
    assert pod_environment({"KVFERRY_REDIS_URL": "redis://new:6379/0"}).redis_url == \
        "redis://new:6379/0"
    assert caplog.messages == []
    with caplog.at_level("WARNING"):
        assert pod_environment({"REDIS_URL": "redis://old:6379/0"}).redis_url == \
            "redis://old:6379/0"
    assert caplog.messages == ["$REDIS_URL is deprecated and will stop being read: set "
                               "$KVFERRY_REDIS_URL instead"]
    assert pod_environment({}).redis_url is None


def test_a_kv_host_this_machine_does_not_hold_is_a_usage_error_at_start() -> None:
    done = subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", "--model", "demo",
                           "--role", "prefill", "--kv-host", "192.0.2.254"],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, KEY_ENV: TEST_KEY_TEXT})
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("kvferry serve: error:")]
    assert line.startswith("kvferry serve: error: --kv-host 192.0.2.254 is not an address of "
                           "this machine, which holds 127.0.0.1 (lo)"), line
    assert line.endswith("; the KV transfer listeners must bind one of them: give it as "
                         "--kv-host"), line
    # Refused before an engine process was started.
    assert "engine-core" not in done.stderr, done.stderr

"""The KV host of `kvferry serve`: which address the KV transfer listeners bind, from
--kv-host, --host and $POD_IP, and the clear errors when it cannot be this machine's."""

from __future__ import annotations

import argparse
import ipaddress
import logging

import pytest
from kvferry.kvtransfer.args import KVHost, choose_kv_host, kv_transfer_config
from kvferry.kvtransfer.interfaces import InterfaceAddress

from kvferry.cli import build_parser

POD_IP = "10.0.0.7"
INTERFACES = [InterfaceAddress("lo", "127.0.0.1", True), InterfaceAddress("lo", "::1", True),
              InterfaceAddress("eth0", POD_IP, False), InterfaceAddress("eth0", "fd00::7", False)]


def serve_args(*flags: str) -> argparse.Namespace:
    argv = ["serve", "--model", "demo", "--role", "prefill", *flags]
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize(("kv_host", "host", "pod_ip", "chosen"), [
    # Kubernetes: the operator renders --host 0.0.0.0 and gives POD_IP.
    (None, "0.0.0.0", POD_IP, KVHost(POD_IP, "$POD_IP")),
    (None, "::", "fd00::7", KVHost("fd00::7", "$POD_IP")),
    # A pod serving on one address keeps its KV listeners there, whatever POD_IP says
    # (`kvferry up` runs its pods on loopback).
    (None, "127.0.0.1", POD_IP, KVHost("127.0.0.1", "--host")),
    (None, "10.0.0.9", POD_IP, KVHost("10.0.0.9", "--host")),
    (None, "127.0.0.1", None, KVHost("127.0.0.1", "--host")),
    # Every interface and no pod IP: loopback, as the pod registry advertises then.
    (None, "0.0.0.0", None, KVHost("127.0.0.1", "the default")),
    (None, "", "", KVHost("127.0.0.1", "the default")),
    # --kv-host wins over both.
    ("10.0.0.8", "0.0.0.0", POD_IP, KVHost("10.0.0.8", "--kv-host")),
    ("127.0.0.1", "0.0.0.0", POD_IP, KVHost("127.0.0.1", "--kv-host")),
    ("FD00::0007", "127.0.0.1", None, KVHost("fd00::7", "--kv-host")),
])
def test_the_kv_host_comes_from_kv_host_then_a_specific_host_then_the_pod_ip(
    kv_host: str | None, host: str, pod_ip: str | None, chosen: KVHost
) -> None:
    assert choose_kv_host(kv_host, host, pod_ip) == chosen


def test_a_host_name_resolves_to_its_address() -> None:
    chosen = choose_kv_host(None, "localhost", POD_IP)
    assert chosen.source == "--host" and ipaddress.ip_address(chosen.address).is_loopback


@pytest.mark.parametrize(("kv_host", "pod_ip", "message"), [
    ("0.0.0.0", None, ("--kv-host '0.0.0.0' is a wildcard: the KV transfer listeners bind one "
                      "address of this machine; give --kv-host the one peers dial")),
    ("::", None, "--kv-host '::' is a wildcard"),
    ("no-such-host.invalid", None,
     ("--kv-host 'no-such-host.invalid' is neither an IP address nor a name this machine "
     "resolves")),
    (None, "0.0.0.0", "$POD_IP '0.0.0.0' is a wildcard"),
    (None, "pod ip", "$POD_IP 'pod ip' is neither an IP address nor a name"),
])
def test_a_wildcard_or_unresolvable_kv_host_is_refused_naming_its_source(
    kv_host: str | None, pod_ip: str | None, message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        choose_kv_host(kv_host, "0.0.0.0", pod_ip)
    assert str(refused.value).startswith(message), refused.value


def test_the_config_binds_the_kv_host_and_confines_ucx_to_its_interface() -> None:
    config = kv_transfer_config(serve_args("--host", "0.0.0.0"), None, None, None, POD_IP,
                                interfaces=INTERFACES)
    assert config is not None
    assert (config.side_channel_host, config.advertise_host) == (POD_IP, None)
    assert config.ucx_net_devices == "eth0"
    config = kv_transfer_config(serve_args(), None, None, None, POD_IP, interfaces=INTERFACES)
    assert config is not None
    assert (config.side_channel_host, config.ucx_net_devices) == ("127.0.0.1", "lo")
    config = kv_transfer_config(serve_args("--kv-host", "fd00::7"), None, None, None, None,
                                interfaces=INTERFACES)
    assert config is not None
    assert (config.side_channel_host, config.ucx_net_devices) == ("fd00::7", "eth0")


def test_a_kv_host_this_machine_does_not_hold_is_an_error_naming_its_source() -> None:
    with pytest.raises(ValueError) as refused:
        kv_transfer_config(serve_args("--kv-host", "10.9.9.9"), None, None, None, None,
                           interfaces=INTERFACES[:3])
    assert str(refused.value) == (
        "--kv-host 10.9.9.9 is not an address of this machine, which holds 127.0.0.1 (lo), "
        "::1 (lo), 10.0.0.7 (eth0); the KV transfer listeners must bind one of them: give it "
        "as --kv-host")
    with pytest.raises(ValueError, match=r"^\$POD_IP 10.0.0.8 is not an address"):
        kv_transfer_config(serve_args("--host", "0.0.0.0"), None, None, None, "10.0.0.8",
                           interfaces=INTERFACES)


def test_a_pod_without_a_connector_does_not_check_the_kv_host() -> None:
    argv = ["serve", "--model", "demo", "--role", "both", "--kv-host", "10.9.9.9"]
    assert kv_transfer_config(build_parser(argv).parse_args(argv), None, None, None, None,
                              interfaces=INTERFACES) is None


def test_listening_on_every_interface_without_a_pod_ip_warns_that_peers_cannot_pull(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="kvferry.kvtransfer.args"):
        config = kv_transfer_config(serve_args("--host", "0.0.0.0"), None, None, None, None,
                                    interfaces=INTERFACES)
    assert config is not None and config.side_channel_host == "127.0.0.1"
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", ("KV transfer listeners on 127.0.0.1 (from the default), UCX network devices "
                 "lo")),
        ("WARNING", ("--host is a wildcard and $POD_IP is unset: the KV transfer listeners bind "
                    "127.0.0.1, so pods on other machines cannot pull from this one; give "
                    "--kv-host the address they reach this machine at")),
    ]


def test_help_gives_the_kv_host_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser(["serve", "--help"]).parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("--kv-host ADDR the address of this machine that the KV transfer listeners (side "
            "channel, NIXL/UCX) bind and that peers dial (default: --host when it is one "
            "address, else $POD_IP, the pod IP on Kubernetes, else 127.0.0.1: then pods on "
            "other machines cannot pull)") in text


def test_the_registry_and_the_side_channel_advertise_the_same_pod_ip() -> None:
    from kvferry.engine.server.registry import registration_settings

    args = serve_args("--host", "0.0.0.0")
    config = kv_transfer_config(args, None, None, None, POD_IP, interfaces=INTERFACES)
    settings = registration_settings("redis://127.0.0.1:6379", "svc", "prefill", args.host,
                                     8000, POD_IP)
    assert config is not None
    assert settings.url == f"http://{config.side_channel_host}:8000"

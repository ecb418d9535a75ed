"""`kvferry operator` options: exact namespaces (no listing), the hostPath switch."""

from __future__ import annotations

import argparse

import pytest

from kvferry.operator.cli import add_arguments, run


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_namespace_patterns_are_refused_before_starting() -> None:
    with pytest.raises(SystemExit, match="exact names, not patterns: team-\\*"):
        run(parse("--namespace", "team-a", "--namespace", "team-*"))


def test_host_paths_are_off_unless_asked_for() -> None:
    assert parse().allow_host_path is False
    assert parse("--allow-host-path").allow_host_path is True

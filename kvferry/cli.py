"""The `kvferry` command line.

Each subcommand lives next to the code it runs and is imported only when chosen, so
`kvferry operator` never imports torch and `kvferry --help` is instant. A subcommand
module provides `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvferry import __version__

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kvferry.engine.frontend.generate_cli", "generate text offline from a prompt"),
    "up": ("kvferry.up", "run an InferenceService on this machine (Redis, pods, router)"),
    "operator": ("kvferry.operator.cli", "run the Kubernetes operator (kopf)"),
    "router": ("kvferry.router.cli", "run the router of an InferenceService (one OpenAI endpoint)"),
    "serve": ("kvferry.engine.server.cli", "serve a model over an OpenAI-compatible HTTP API"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvferry", description="Disaggregated LLM inference on Kubernetes."
    )
    parser.add_argument("--version", action="version", version=f"kvferry {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(sub)
            show_defaults(sub)
    return parser


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Appends `(default: X)` to the help of every option whose help does not say its default.

    Flags (on or off) and options without a default are left as they are: their help says
    what happens without them.
    """
    for action in parser._actions:
        default = action.default
        if (not action.option_strings or action.help == argparse.SUPPRESS
                or default is None or default is argparse.SUPPRESS or isinstance(default, bool)
                or "default" in (action.help or "")):
            continue
        action.help = f"{action.help or ''} (default: %(default)s)".lstrip()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    module_name, _ = SUBCOMMANDS[args.command]
    return int(importlib.import_module(module_name).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

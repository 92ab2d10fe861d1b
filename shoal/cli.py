"""The `shoal` command: serve Fish Speech DualAR text-to-speech models, synthesize, quantize,
benchmark.

Each subcommand lives in its own module, imported only when used, so `shoal serve` never imports
benchmark code and `shoal bench` never imports the web stack."""

from __future__ import annotations

import argparse
import importlib
import sys

from shoal import __version__

# name -> (module, one-line help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("shoal.server.cli", "start the HTTP/WebSocket API server"),
    "keys": ("shoal.server.keys_cli", "create, list and revoke API keys"),
    "synth": ("shoal.synth", "synthesize text to an audio file"),
    "demo-checkpoint": ("shoal.demo", "write a small random-weight S2-layout checkpoint + codec"),
    "quantize": ("shoal.quant.cli", "write an FP8 block-scaled checkpoint"),
    "bench": ("shoal.bench.cli", "benchmarks: engine, codec, kernels, serve"),
    "gate": ("shoal.bench.gate", "correctness and performance gates"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="shoal", description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="`shoal COMMAND --help` lists a command's options.",
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv:
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        # argparse prints the version, the help, or "invalid choice" with the known commands,
        # and exits (0 for --version/--help, 2 for an unknown command or option).
        parser.parse_args(argv[:1])
        parser.error(f"unknown command {argv[0]!r}")
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    command_parser = argparse.ArgumentParser(prog=f"shoal {name}", description=COMMANDS[name][1])
    module.add_arguments(command_parser)
    args = command_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

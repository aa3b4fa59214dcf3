"""The `kimi-k3-moe` command: one subcommand per module, imported on use."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> module exposing HELP, add_arguments(parser) and run(args) -> exit code
COMMANDS = {
    "doctor": "kimi_k3_moe.doctor",
    "demo": "kimi_k3_moe.demo",
    "gsm8k": "kimi_k3_moe.gsm8k.command",
    "convert": "kimi_k3_moe.convert",
    "bench": "kimi_k3_moe.bench.command",
    "tune": "kimi_k3_moe.tune.command",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimi-k3-moe", description="Kimi-K3 routed-expert MoE kernels")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return args._module.run(args)


if __name__ == "__main__":
    sys.exit(main())

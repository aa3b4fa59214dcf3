"""The `kimi-k3-moe` command: one subcommand per module, imported on use.

Every error a user can cause ends as one line on stderr,
`kimi-k3-moe <command>: error: ...`, with exit status 2 (usage and data
errors: bad arguments, settings, configs, checkpoints); `--debug` shows the
traceback instead. Commands may return 1 for "ran, and the answer is no"
(a failed check, a model that cannot be served).
"""
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
USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse's usage errors as one line (argparse prints the usage block first)."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_in(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not {what}")
        return value
    return parse


positive_int = _int_in(1, "a positive integer (>= 1)")
non_negative_int = _int_in(0, "a non-negative integer (>= 0)")


def count_list(text: str, option: str) -> list[int]:
    """'1,4,16' given to `option`: a comma list of integers >= 1 (token counts, tiers), else ValueError."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected a comma list of integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{option} {text!r}: every value must be >= 1")
    return values


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):  # NaN and inf too
        raise argparse.ArgumentTypeError(f"{text} is not a positive finite number")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kimi-k3-moe", description="Kimi-K3 routed-expert MoE kernels")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an error")
        module.add_arguments(command)
        command.set_defaults(_module=module, _parser=command)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    from kimi_k3_moe.kernels.base import BackendUnavailable
    from kimi_k3_moe.self_check import SelfCheckFailed

    # every error class of this package is one of these (ConfigError, CheckpointError, ... are ValueErrors)
    return ValueError, OSError, BackendUnavailable, SelfCheckFailed


def main(argv: list[str] | None = None) -> int:
    from kimi_k3_moe.weights.checkpoint import one_line  # here: importing cli stays free of torch

    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # argparse would report them as the top command's, without the subcommand's name
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    prog = f"kimi-k3-moe {args.command}"
    try:
        return args._module.run(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        if isinstance(exc, _user_errors()):
            print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
            return USAGE_ERROR
        print(f"{prog}: error: internal error {type(exc).__name__}: {one_line(exc)} "
              "(rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

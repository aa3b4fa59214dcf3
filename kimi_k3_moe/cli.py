"""The `kimi-k3-moe` command: one subcommand per module, imported on use.

Every error a user can cause ends as one line on stderr,
`kimi-k3-moe <command>: error: ...`, with exit status 2 (usage and data
errors: bad arguments, settings, configs, checkpoints); `--debug` shows the
traceback instead. Commands may return 1 for "ran, and the answer is no"
(a failed check, a model that cannot be served). SIGINT, SIGTERM and SIGHUP
all reach a command as KeyboardInterrupt (`Terminated` for the last two), so a
job's cleanup (the GSM8K report's last save) runs for each; the exit status is
128 + the signal's number.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import signal
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
INT_MAX = 2**31 - 1  # what a count may reach: it ends up in torch sizes and int32 kernel arguments


class _Parser(argparse.ArgumentParser):
    """argparse's usage errors as one line (argparse prints the usage block first)."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_in(minimum: int, what: str, maximum: int = INT_MAX):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not {what}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"{value} is above {maximum}, the most this option can hold")
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
    if not values or min(values) < 1 or max(values) > INT_MAX:
        raise ValueError(f"{option} {text!r}: every value must be in [1, {INT_MAX}]")
    return values


FLOAT32_MAX = 3.4028234663852886e38  # what the kernels' float32 arithmetic can hold


def positive_float(text: str, maximum: float = FLOAT32_MAX) -> float:
    """A number > 0 and <= `maximum` (finite: NaN and inf are refused), else ArgumentTypeError."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= maximum:  # NaN fails every comparison
        raise argparse.ArgumentTypeError(f"{text} is not a positive finite number <= {maximum:g}")
    return value


class Terminated(KeyboardInterrupt):
    """SIGTERM (a CI cancel, `timeout`, `docker stop`) or SIGHUP (the terminal closed), delivered like
    Ctrl-C so the same cleanup runs."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def exit_status(interrupt: KeyboardInterrupt) -> int:
    """128 + the signal's number: 130 for Ctrl-C, 143 for SIGTERM."""
    return 128 + getattr(interrupt, "signum", signal.SIGINT)


def _terminate(signum, frame):
    raise Terminated(signum)


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def _catch_stop_signals() -> list[int]:
    """SIGTERM and SIGHUP as `Terminated`, where Python lets us (the main thread) and nobody set another
    handler; the ones it took (main puts their defaults back on its way out)."""
    taken = []
    for signum in STOP_SIGNALS:
        try:
            if signal.getsignal(signum) == signal.SIG_DFL:
                signal.signal(signum, _terminate)
                taken.append(signum)
        except ValueError:  # not the main thread (an embedding caller): leave signals alone
            break
    return taken


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


def _user_error_line(exc: BaseException) -> str | None:
    """The one line for an operator's fault, None for what looks like a bug. An I/O error no reader
    mapped (each should) still says its path and cause, e.g. safetensors' write error, no OSError."""
    from kimi_k3_moe import io_errors
    from kimi_k3_moe.weights.checkpoint import one_line

    if io_errors.is_io_error(exc) and not isinstance(exc, io_errors.IOFault):
        where = getattr(exc, "filename", None)
        return io_errors.describe(exc, where, "cannot use") if where else io_errors.cause(exc)
    return one_line(exc) if isinstance(exc, _user_errors()) else None


def main(argv: list[str] | None = None) -> int:
    taken = _catch_stop_signals()
    try:
        return _main(argv)
    finally:
        for signum in taken:
            signal.signal(signum, signal.SIG_DFL)


def _main(argv: list[str] | None) -> int:
    from kimi_k3_moe.weights.checkpoint import one_line  # here: importing cli stays free of torch

    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # argparse would report them as the top command's, without the subcommand's name
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    prog = f"kimi-k3-moe {args.command}"
    try:
        return args._module.run(args)
    except KeyboardInterrupt as exc:
        by = f" ({signal.Signals(exc.signum).name})" if isinstance(exc, Terminated) else ""
        print(f"{prog}: interrupted{by}", file=sys.stderr)
        return exit_status(exc)
    except Exception as exc:
        if args.debug:
            raise
        line = _user_error_line(exc)
        if line is not None:
            print(f"{prog}: error: {line}", file=sys.stderr)
            return USAGE_ERROR
        print(f"{prog}: error: internal error {type(exc).__name__}: {one_line(exc)} "
              "(rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

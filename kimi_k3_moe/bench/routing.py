"""Which experts a bench's tokens pick: the `--routing` choice (no torch import: the CLI parses it)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

ROUTINGS = "uniform | skewed[:SIGMA] | file:PATH"


@dataclass(frozen=True)
class Routing:
    """How a bench picks each token's experts. uniform: every expert equally likely; skewed: unit Gaussian
    router logits plus a fixed per-expert popularity, a logit bias drawn once from N(0, sigma) (real
    routers favour some experts over every batch; sigma 1 at TP8: 369 distinct experts at 256 tokens
    against ~885 uniform); file: top-k ids recorded from a real router (.pt or .npy, [tokens, k]), the
    first T rows for T tokens."""

    kind: str = "uniform"
    sigma: float = 1.0
    path: str | None = None

    def __str__(self) -> str:
        return {"uniform": "uniform", "skewed": f"skewed:{self.sigma:g}"}.get(self.kind, f"file:{self.path}")


def parse_routing(text: str) -> Routing:
    kind, _, arg = text.partition(":")
    if kind == "uniform" and not arg:
        return Routing()
    if kind == "skewed":
        try:
            sigma = float(arg) if arg else 1.0
        except ValueError:
            sigma = -1.0
        if not 0 < sigma < 100:
            raise ValueError(f"--routing {text!r}: SIGMA must be a number in (0, 100)")
        return Routing("skewed", sigma)
    if kind == "file" and arg:
        if not os.path.isfile(arg):
            raise ValueError(f"--routing {text!r}: no such file")
        return Routing("file", path=arg)
    raise ValueError(f"--routing {text!r}: expected {ROUTINGS}")


def routing_arg(text: str) -> Routing:
    """`--routing` as an argparse type: a bad value is argparse's one-line usage error."""
    try:
        return parse_routing(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def routings_arg(text: str) -> tuple[Routing, ...]:
    """A comma list of routings (`tune --routing uniform,skewed`), each at most once."""
    try:
        routings = tuple(parse_routing(part.strip()) for part in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    names = [str(r) for r in routings]
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--routing {text!r}: a routing given twice")
    return routings

"""The pass/fail gate of vLLM's and SGLang's accuracy CI.

--threshold T          pass iff accuracy >= T            (SGLang's CI; vLLM's gsm8k job
                                                          with T = baseline - tolerance)
--baseline B --rtol R  pass iff accuracy >= B * (1 - R)  (vLLM's lm-eval gate, R = 0.08)

The gate reads one accuracy of the chosen protocol, flexible by default: vLLM's
and SGLang's GSM8K jobs score the last number of the reply.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

DEFAULT_RTOL = 0.08
METRICS = ("flexible", "strict")
# accuracy is a ratio of counts; don't let 0.95 * 0.92 = 0.8740000000000001 fail 437/500
_SLACK = 1e-9


@dataclass(frozen=True)
class Gate:
    metric: str
    bar: float
    rule: str
    baseline: float | None = None
    threshold: float | None = None
    rtol: float | None = None

    def passes(self, accuracy: float) -> bool:
        return accuracy + _SLACK >= self.bar

    def to_json(self) -> dict:
        return asdict(self)


def _fraction(name: str, value: float, upper_open: bool = False) -> float:
    if not (0.0 <= value < 1.0 if upper_open else 0.0 <= value <= 1.0):
        raise ValueError(f"{name} {value} is outside [0, 1{')' if upper_open else ']'}")
    return value


def make_gate(baseline: float | None, threshold: float | None, rtol: float | None,
              metric: str = "flexible") -> Gate | None:
    """The gate the flags describe, None for no gate; ValueError for a bad combination."""
    if metric not in METRICS:
        raise ValueError(f"--gate-on {metric!r}: choose one of {', '.join(METRICS)}")
    if threshold is not None and (baseline is not None or rtol is not None):
        given = " and ".join(f for f, v in (("--baseline", baseline), ("--rtol", rtol)) if v is not None)
        raise ValueError(f"--threshold and {given} are two different gates: give --threshold T "
                         "or --baseline B [--rtol R], not both")
    if rtol is not None and baseline is None:
        raise ValueError("--rtol is relative to --baseline: give --baseline too")
    if baseline is not None:
        _fraction("--baseline", baseline)
    if threshold is not None:
        bar = _fraction("--threshold", threshold)
        return Gate(metric, bar, f"{metric} accuracy >= {threshold:g}", None, threshold, None)
    if baseline is None:
        return None
    rtol = DEFAULT_RTOL if rtol is None else _fraction("--rtol", rtol, upper_open=True)
    bar = baseline * (1.0 - rtol)
    return Gate(metric, bar, f"{metric} accuracy >= {baseline:g} * (1 - {rtol:g}) = {bar:.4f}",
                baseline, None, rtol)

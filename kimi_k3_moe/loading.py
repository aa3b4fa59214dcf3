"""The one load loop: plan -> for each candidate, prepare, self-check, accept or refuse with the reason.

`RoutedExperts` (and through it both engine adapters), `doctor` and the
benchmarks load through `load_backend`, so a refusal reads the same wherever
it happens. The experts are converted to each candidate's `WeightFormat` here
(once per format, `weights.requant.to_format`), never inside a backend.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kimi_k3_moe import settings
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.kernels.base import BackendUnavailable, MoEBackend
from kimi_k3_moe.self_check import SelfCheckFailed, run_self_check
from kimi_k3_moe.weights.requant import to_format
from kimi_k3_moe.weights.validate import validate_experts

logger = logging.getLogger("kimi_k3_moe")


class SelfCheckCache:
    """Self-check results of one process (or one test): 92 layers of one shape check once.

    Keyed by backend, activation quantization, activation, layer shape and device.
    The engine adapters own one each and pass it to every layer they load.
    """

    def __init__(self) -> None:
        self._errors: dict[tuple, float] = {}

    def check(self, backend: MoEBackend, experts: Any, activation: ActivationSpec) -> float:
        key = (backend.describe(), backend.act_quant, activation, experts.hidden_size,
               experts.intermediate_size, str(experts.device))
        if key not in self._errors:
            self._errors[key] = run_self_check(backend, experts, activation)
            logger.info("kimi-k3-moe: self-check of %s passed (relative L2 %.2e)",
                        backend.describe(), self._errors[key])
        return self._errors[key]

    def clear(self) -> None:
        self._errors.clear()


@dataclass
class Loaded:
    backend: MoEBackend
    choice: Any                # dispatch.BackendChoice
    prepared: Any = None       # None when loaded without experts (doctor)
    refusals: list[str] = field(default_factory=list)


def prepare_for(backend: MoEBackend, experts: Any) -> Any:
    """`experts` (MXFP4, int4, or the backend's own form) converted to the backend's format and laid out."""
    return backend.prepare(to_format(experts, backend.format, backend.describe()))


def load_backend(plan: list, experts: Any = None, activation: ActivationSpec | None = None, *,
                 self_check: str = "fallback", checks: SelfCheckCache | None = None,
                 layer_name: str = "") -> Loaded:
    """The first choice of `plan` that runs here, passes its self-check and prepares `experts`.

    Without `experts` (doctor) only whether each choice can be built and runs
    here is asked, and a choice that cannot be built is a refusal too; with
    them, a configuration error stops the load. In "strict" self-check mode a
    failed self-check raises, in "fallback" it is logged and the next choice tried.
    """
    if self_check not in settings.SELF_CHECK_MODES:  # a typo ("of") would have meant "fallback"
        raise ValueError(f"self_check={self_check!r}; choose one of {', '.join(settings.SELF_CHECK_MODES)}")
    if experts is not None:
        validate_experts(experts, layer=layer_name)  # before any kernel, the self-check's included
    checks = checks if checks is not None else SelfCheckCache()
    refusable = (BackendUnavailable, SelfCheckFailed) + ((ValueError,) if experts is None else ())
    refusals: list[str] = []
    converted: dict = {}
    for choice in plan:
        try:
            backend = choice.make()
            ok, why = backend.available()
            if not ok:
                raise BackendUnavailable(why)
            if experts is None:
                return Loaded(backend, choice, None, refusals)
            if backend.format not in converted:
                converted[backend.format] = to_format(experts, backend.format, backend.describe())
            source = converted[backend.format]
            if self_check != "off" and backend.spec.self_checked:
                checks.check(backend, source, activation)
            prepared = backend.prepare(source)
        except refusable as exc:
            refusals.append(f"{choice} ({choice.reason}): {exc}" if choice.reason else f"{choice}: {exc}")
            if isinstance(exc, SelfCheckFailed):
                if self_check == "strict":
                    raise
                logger.error("kimi-k3-moe: REFUSING backend %s for %s: %s; falling back",
                             choice, layer_name or "MoE layer", exc)
            continue
        return Loaded(backend, choice, prepared, refusals)
    what = "run here" if experts is None else "serve this layer"
    raise BackendUnavailable(f"no backend can {what}: " + "; ".join(refusals))


def resolve(plan: list) -> tuple[MoEBackend, Any, list[str]]:
    """The first backend of `plan` that can run here, and why each earlier one could not (no weights)."""
    loaded = load_backend(plan)
    return loaded.backend, loaded.choice, loaded.refusals

"""The engine-agnostic core of the plugins' MoE method.

vLLM and SGLang adapters own parameter registration and their engines'
calling conventions; this object owns the rest: picking a backend for the
platform, self-checking it on a slice of the real weights, converting the
layer's experts, and running them.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.dispatch import BackendChoice, Platform, detect_platform, plan_backends
from kimi_k3_moe.kernels.base import BackendUnavailable, ExpertWeights, MoEBackend
from kimi_k3_moe.self_check import SelfCheckFailed, run_self_check, self_check_mode
from kimi_k3_moe.weights.validate import validate_experts

logger = logging.getLogger("kimi_k3_moe")

# (backend, activation quantization, activation, shape, device) -> error, so 92 layers check once.
_CHECKED: dict[tuple, float] = {}


class RoutedExperts:
    """One MoE layer's routed experts on the backend chosen for this machine."""

    def __init__(self, activation: ActivationSpec, *, platform: Platform | None = None,
                 plan: list[BackendChoice] | None = None, self_check: str | None = None,
                 layer_name: str = ""):
        if not isinstance(activation, ActivationSpec):
            raise TypeError(f"activation must be an ActivationSpec, got {type(activation).__name__}")
        self.activation = activation
        self.platform = platform or detect_platform()
        self.plan = plan if plan is not None else plan_backends(self.platform)
        self.self_check = self_check or self_check_mode()
        self.layer_name = layer_name
        self.backend: MoEBackend | None = None
        self.choice: BackendChoice | None = None
        self.prepared: Any = None

    def load(self, experts: ExpertWeights) -> MoEBackend:
        """Pick the first backend that runs here and passes the self-check; convert the experts."""
        validate_experts(experts, layer=self.layer_name)  # before any kernel, the self-check's included
        refusals = []
        for choice in self.plan:
            try:
                backend = choice.make()
                ok, why = backend.available()
                if not ok:
                    raise BackendUnavailable(why)
                self._check(backend, experts)
            except (BackendUnavailable, SelfCheckFailed) as exc:
                refusals.append(f"{choice}: {exc}")
                if isinstance(exc, SelfCheckFailed):
                    if self.self_check == "strict":
                        raise
                    logger.error("kimi-k3-moe: REFUSING backend %s for %s: %s; falling back",
                                 choice, self.layer_name or "MoE layer", exc)
                continue
            self.prepared = backend.prepare(experts)
            self.backend, self.choice = backend, choice
            return backend
        raise BackendUnavailable("no backend can serve this layer: " + "; ".join(refusals))

    def _check(self, backend: MoEBackend, experts: ExpertWeights) -> None:
        if self.self_check == "off" or backend.name == "torch":
            return  # the torch backend is the reference's own arithmetic
        key = (backend.describe(), getattr(backend, "act_quant", None), self.activation, experts.hidden_size,
               experts.intermediate_size, str(experts.device))
        if key not in _CHECKED:
            _CHECKED[key] = run_self_check(backend, experts, self.activation)
            logger.info("kimi-k3-moe: self-check of %s passed (relative L2 %.2e)",
                        backend.describe(), _CHECKED[key])

    def holds_source(self, experts: ExpertWeights) -> bool:
        """Whether the prepared form still reads `experts`' own storage.

        When it does, the engine's parameters are the prepared weights and stay;
        when it does not (int4, a kernel's own layout) the engine may release
        them so the layer does not hold two copies.
        """
        if self.backend is None:
            raise RuntimeError("RoutedExperts.holds_source called before load()")
        mine = {t.untyped_storage().data_ptr() for t in _tensors_in(self.prepared)}
        return any(t.untyped_storage().data_ptr() in mine for t in experts.tensors())

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: torch.Tensor | None = None) -> torch.Tensor:
        if self.backend is None:
            raise RuntimeError("RoutedExperts.forward called before load()")
        return self.backend.forward(self.prepared, hidden, topk_weights, topk_ids,
                                    self.activation, expert_map)

    __call__ = forward


def _tensors_in(obj: Any, depth: int = 4) -> list[torch.Tensor]:
    """Tensors reachable from a backend's prepared form (dataclasses, containers, attributes)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return []
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        items = [getattr(obj, name) for name in getattr(obj, "__slots__", ())]
    return [t for item in items for t in _tensors_in(item, depth - 1)]

"""The engine-agnostic core of the plugins' MoE method.

vLLM and SGLang adapters own their engines' calling conventions (the
method classes in `plugin_entrypoints/_vllm_method.py` and `_sglang_method.py`); this object owns the rest: picking a
backend for the platform, self-checking it on a slice of the real weights,
converting the layer's experts, and running them (`loading.load_backend`).
"""
from __future__ import annotations

from typing import Any

import torch

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.dispatch import BackendChoice, plan_backends
from kimi_k3_moe.kernels.base import MoEBackend
from kimi_k3_moe.loading import SelfCheckCache, load_backend
from kimi_k3_moe.platform import Platform, detect_platform
from kimi_k3_moe.self_check import self_check_mode


class RoutedExperts:
    """One MoE layer's routed experts on the backend chosen for this machine."""

    def __init__(self, activation: ActivationSpec, *, platform: Platform | None = None,
                 plan: list[BackendChoice] | None = None, self_check: str | None = None,
                 checks: SelfCheckCache | None = None, layer_name: str = ""):
        """`checks` holds the self-checks already run (the engine adapter's, shared by its layers);
        without one this layer checks for itself."""
        if not isinstance(activation, ActivationSpec):
            raise TypeError(f"activation must be an ActivationSpec, got {type(activation).__name__}")
        self.activation = activation
        self.platform = platform or detect_platform()
        self.plan = plan if plan is not None else plan_backends(self.platform)
        self.self_check = self_check or self_check_mode()
        self.checks = checks if checks is not None else SelfCheckCache()
        self.layer_name = layer_name
        self.backend: MoEBackend | None = None
        self.choice: BackendChoice | None = None
        self.prepared: Any = None

    def load(self, experts) -> MoEBackend:
        """Pick the first backend that runs here and passes the self-check; convert the experts."""
        loaded = load_backend(self.plan, experts, self.activation, self_check=self.self_check,
                              checks=self.checks, layer_name=self.layer_name)
        self.backend, self.choice, self.prepared = loaded.backend, loaded.choice, loaded.prepared
        return self.backend

    @property
    def graph_safe(self) -> bool:
        """Whether the serving backend may run inside a CUDA graph capture."""
        if self.backend is None:
            raise RuntimeError("RoutedExperts.graph_safe asked before load()")
        return self.backend.spec.graph_safe

    def holds_source(self, experts) -> bool:
        """Whether the prepared form still reads `experts`' own storage.

        When it does, the engine's parameters are the prepared weights and stay;
        when it does not (int4, a kernel's own layout) the engine may release
        them so the layer does not hold two copies.
        """
        if self.backend is None:
            raise RuntimeError("RoutedExperts.holds_source called before load()")
        mine = {t.untyped_storage().data_ptr() for t in self.prepared.tensors()}
        return any(t.untyped_storage().data_ptr() in mine for t in experts.tensors())

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: torch.Tensor | None = None) -> torch.Tensor:
        if self.backend is None:
            raise RuntimeError("RoutedExperts.forward called before load()")
        return self.backend.forward(self.prepared, hidden, topk_weights, topk_ids,
                                    self.activation, expert_map)

    __call__ = forward

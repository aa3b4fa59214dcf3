"""Kernel backends behind one interface (see `base.MoEBackend`).

Backends are found by name and imported only when asked for, so importing
this package never imports triton or flydsl.
"""
from __future__ import annotations

import importlib

from kimi_k3_moe.kernels.base import BackendUnavailable, ExpertWeights, MoEBackend

# name -> module holding `make_backend(**options)`
BACKEND_MODULES = {
    "torch": "kimi_k3_moe.kernels.torch",
    "triton": "kimi_k3_moe.kernels.triton",
    "flydsl": "kimi_k3_moe.kernels.flydsl",
}

__all__ = ["BACKEND_MODULES", "BackendUnavailable", "ExpertWeights", "MoEBackend", "get_backend"]


def get_backend(name: str, **options) -> MoEBackend:
    """The backend called `name`, configured with `options` (e.g. weight_format)."""
    if name not in BACKEND_MODULES:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKEND_MODULES)}")
    try:
        module = importlib.import_module(BACKEND_MODULES[name])
        factory = module.make_backend
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailable(f"backend {name!r} is not installed here: {exc}") from exc
    return factory(**options)

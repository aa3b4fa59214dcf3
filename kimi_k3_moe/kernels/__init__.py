"""Kernel backends behind one interface (see `base.MoEBackend`), each declared by a `spec.BackendSpec`.

`SPECS` is the order dispatch prefers them in. A spec is cheap to import; the
backend's module (and its compiler) is imported when the backend is made, so
importing this package never imports triton or flydsl.
"""
from __future__ import annotations

from kimi_k3_moe.act_quant import resolve_act_dtype
from kimi_k3_moe.kernels.base import BackendUnavailable, MoEBackend
from kimi_k3_moe.kernels.flydsl import SPEC as FLYDSL
from kimi_k3_moe.kernels.spec import BackendSpec
from kimi_k3_moe.kernels.torch import SPEC as TORCH
from kimi_k3_moe.kernels.triton import SPEC as TRITON

# fastest first; the torch backend, which runs anywhere, last
SPECS: tuple[BackendSpec, ...] = (FLYDSL, TRITON, TORCH)

__all__ = ["BackendSpec", "BackendUnavailable", "MoEBackend", "SPECS", "get_backend", "get_spec"]


def get_spec(name: str) -> BackendSpec:
    for spec in SPECS:
        if spec.name == name:
            return spec
    raise ValueError(f"unknown backend {name!r}; known: {sorted(s.name for s in SPECS)}")


def get_backend(name: str, **options) -> MoEBackend:
    """The backend called `name`, configured with `options` (e.g. weight_format).

    `act_dtype` ("bf16" | "fp8" | "fp4") defaults to $KIMI_K3_MOE_ACT_DTYPE, else bf16
    (read here, once); a backend that cannot run it on its arch raises `UnsupportedActDtype`.
    """
    options["act_dtype"] = resolve_act_dtype(options.pop("act_dtype", None))
    return get_spec(name).make(**options)

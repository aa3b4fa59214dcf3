"""Kernel backends behind one interface (see `base.MoEBackend`).

Backends are found by name and imported only when asked for, so importing
this package never imports triton or flydsl.

A backend package may declare quantized activations with two module-level hooks
(plain functions; importing the package must stay cheap):
  supported_act_dtypes(arch) -> tuple of "bf16" | "fp8" | "fp4" its kernels run on
      `arch` ("gfx950", "sm_90", ..., None for no GPU); its make_backend then takes
      `act_dtype=` and refuses the others itself.
  act_quant_for(arch, act_dtype) -> act_quant.ActQuant (optional): the exact scheme,
      when it is not ActQuant.for_dtype(act_dtype) (per-1x32 e8m0 scales).
A package without the first hook runs bf16 activations only.
"""
from __future__ import annotations

import importlib

from kimi_k3_moe.act_quant import BF16, ActQuant, UnsupportedActDtype, resolve_act_dtype
from kimi_k3_moe.kernels.base import BackendUnavailable, ExpertWeights, MoEBackend

# name -> module holding `make_backend(**options)`
BACKEND_MODULES = {
    "torch": "kimi_k3_moe.kernels.torch",
    "triton": "kimi_k3_moe.kernels.triton",
    "flydsl": "kimi_k3_moe.kernels.flydsl",
}

__all__ = ["BACKEND_MODULES", "BackendUnavailable", "ExpertWeights", "MoEBackend", "act_quant_for",
           "get_backend", "supported_act_dtypes"]


def _module(name: str):
    if name not in BACKEND_MODULES:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKEND_MODULES)}")
    return importlib.import_module(BACKEND_MODULES[name])


def get_backend(name: str, **options) -> MoEBackend:
    """The backend called `name`, configured with `options` (e.g. weight_format).

    `act_dtype` ("bf16" | "fp8" | "fp4") defaults to $KIMI_K3_MOE_ACT_DTYPE, else bf16;
    a backend that cannot run it on its arch raises `UnsupportedActDtype`.
    """
    act_dtype = resolve_act_dtype(options.pop("act_dtype", None))
    try:
        module = _module(name)
        factory = module.make_backend
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailable(f"backend {name!r} is not installed here: {exc}") from exc
    if hasattr(module, "supported_act_dtypes"):
        options["act_dtype"] = act_dtype
    elif act_dtype != BF16:
        raise UnsupportedActDtype(f"act_dtype={act_dtype!r}: the {name} backend runs bf16 activations only "
                                  "(it declares no supported_act_dtypes)")
    return factory(**options)


def supported_act_dtypes(name: str, arch: str | None) -> tuple[str, ...]:
    """What backend `name` declares for `arch`; bf16 only when it declares nothing or is not installed."""
    try:
        hook = getattr(_module(name), "supported_act_dtypes", None)
    except ImportError:
        return (BF16,)
    return tuple(hook(arch)) if hook else (BF16,)


def act_quant_for(name: str, arch: str | None, act_dtype: str) -> ActQuant:
    """The activation quantization backend `name` applies for `act_dtype` on `arch`."""
    try:
        hook = getattr(_module(name), "act_quant_for", None)
    except ImportError:
        hook = None
    return hook(arch, act_dtype) if hook else ActQuant.for_dtype(act_dtype)

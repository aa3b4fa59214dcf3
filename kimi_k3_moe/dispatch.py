"""Platform -> ordered backend plan: what serves here, what stands behind it, and why.

  gfx950 (MI355X)        flydsl on MXFP4 -> triton on MXFP4 -> torch on MXFP4
  gfx942 (MI300X/MI325X) flydsl on int4  -> triton on int4  -> torch on int4
  other ROCm GPUs        triton on MXFP4 -> torch
  CUDA sm_80 and newer   triton on MXFP4 -> torch
  anything else          torch

`KIMI_K3_MOE_BACKEND=torch|triton|flydsl` replaces the plan with that one
backend, and fails loudly where it cannot run.

`KIMI_K3_MOE_ACT_DTYPE=bf16|fp8|fp4` (default bf16) opts in to quantized
activations. Every choice carries it as its `act_dtype` option; backends whose
kernels do not run it on this arch (their package's `supported_act_dtypes`) leave
the plan, the torch fallback emulates the scheme of the kernels it stands behind,
and a GPU where no kernel backend runs it refuses the setting here, at load,
naming the arch and what it supports. Nothing falls back to bf16.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kimi_k3_moe import settings
from kimi_k3_moe.act_quant import BF16, ENV_ACT_DTYPE, UnsupportedActDtype, resolve_act_dtype
from kimi_k3_moe.kernels import (BACKEND_MODULES, BackendUnavailable, MoEBackend, act_quant_for, get_backend,
                                 supported_act_dtypes)

ENV_BACKEND = settings.BACKEND
FLYDSL_ARCHS = ("gfx942", "gfx950")
INT4_ARCHS = ("gfx942",)  # no FP4 matrix instructions there: requantise to int4


@dataclass(frozen=True)
class Platform:
    vendor: str              # "cpu", "cuda" or "rocm"
    arch: str | None = None  # "sm_90", "gfx942", ...
    device_name: str = ""

    @property
    def is_gpu(self) -> bool:
        return self.vendor != "cpu"

    def __str__(self) -> str:
        return self.vendor if not self.is_gpu else f"{self.vendor} {self.arch} ({self.device_name})"


def gfx_arch(gcn_arch_name: str) -> str:
    """'gfx942:sramecc+:xnack-' -> 'gfx942'."""
    return gcn_arch_name.split(":", 1)[0]


def detect_platform(device: int = 0) -> Platform:
    if not torch.cuda.is_available():
        return Platform("cpu")
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        return Platform("rocm", gfx_arch(props.gcnArchName), props.name)
    return Platform("cuda", f"sm_{props.major}{props.minor}", props.name)


def sm_version(arch: str | None) -> int:
    match = re.fullmatch(r"sm_(\d+)a?", arch or "")
    return int(match.group(1)) if match else 0


@dataclass(frozen=True)
class BackendChoice:
    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""

    def make(self) -> MoEBackend:
        return get_backend(self.name, **dict(self.options))

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.name}[{opts}]" if opts else self.name


def _choices_for(platform: Platform) -> list[BackendChoice]:
    torch_choice = BackendChoice("torch", {"weight_format": "mxfp4"}, "pure PyTorch, runs anywhere")
    if platform.vendor == "rocm" and platform.arch in FLYDSL_ARCHS:
        fmt = "int4" if platform.arch in INT4_ARCHS else "mxfp4"
        why = ("no FP4 MFMA on gfx942: experts requantised to int4" if fmt == "int4"
               else "gfx950 runs MXFP4 weights directly")
        # The whole chain shares one weight format, so a fallback computes the same
        # function and can take pre-converted int4 experts.
        return [BackendChoice("flydsl", {"arch": platform.arch, "weight_format": fmt}, why),
                BackendChoice("triton", {"weight_format": fmt}, "fallback behind FlyDSL"),
                BackendChoice("torch", {"weight_format": fmt}, "pure PyTorch, last fallback")]
    if platform.vendor == "rocm" or (platform.vendor == "cuda" and sm_version(platform.arch) >= 80):
        return [BackendChoice("triton", {"weight_format": "mxfp4"},
                              f"Triton kernels for {platform.arch}"), torch_choice]
    return [torch_choice]


def _with_act_dtype(plan: list[BackendChoice], platform: Platform, act_dtype: str,
                    forced: bool) -> list[BackendChoice]:
    """Each choice with `act_dtype` in its options; those that cannot run it dropped (or, forced, refused)."""
    arch = platform.arch if platform.is_gpu else None
    kept, kernels_support = [], set()
    for choice in plan:
        supported = supported_act_dtypes(choice.name, arch)
        if choice.name != "torch":
            kernels_support.update(supported)
        if act_dtype in supported:
            kept.append(BackendChoice(choice.name, {**choice.options, "act_dtype": act_dtype}, choice.reason))
        elif forced:
            raise UnsupportedActDtype(f"{ENV_ACT_DTYPE}={act_dtype!r}: the {choice.name} backend ({ENV_BACKEND}) "
                                      f"does not run it on {platform}; supported there: {', '.join(supported)}")
    kernel_choices = [c for c in kept if c.name != "torch"]
    if act_dtype != BF16 and platform.is_gpu and not forced and not kernel_choices:
        choices = [d for d in (BF16, "fp8", "fp4") if d in kernels_support | {BF16}]
        raise UnsupportedActDtype(f"{ENV_ACT_DTYPE}={act_dtype!r} is not available on {platform}: no kernel "
                                  f"backend here runs {act_dtype} activations; supported on {platform.arch}: "
                                  f"{', '.join(choices)}")
    if act_dtype != BF16 and kernel_choices:
        # the torch fallback computes what the kernels in front of it compute
        scheme = act_quant_for(kernel_choices[0].name, arch, act_dtype)
        kept = [BackendChoice(c.name, {**c.options, "act_quant": scheme}, c.reason) if c.name == "torch" else c
                for c in kept]
    return kept


def plan_backends(platform: Platform | None = None, env: Mapping[str, str] | None = None,
                  act_dtype: str | None = None) -> list[BackendChoice]:
    """Backends to try in order on `platform` (detected when None).

    `act_dtype` (else $KIMI_K3_MOE_ACT_DTYPE, else bf16) goes into every choice's options.
    """
    platform = platform or detect_platform()
    env = os.environ if env is None else env
    act_dtype = resolve_act_dtype(act_dtype, env)
    forced = settings.choice(ENV_BACKEND, env)
    return _with_act_dtype(_forced_plan(platform, forced) if forced else _choices_for(platform), platform,
                           act_dtype, forced=bool(forced))


def _forced_plan(platform: Platform, forced: str) -> list[BackendChoice]:
    plan = _choices_for(platform)
    if forced not in BACKEND_MODULES:
        raise ValueError(f"{ENV_BACKEND}={forced!r} is not a backend; choose one of {sorted(BACKEND_MODULES)}")
    for choice in plan:
        if choice.name == forced:
            return [BackendChoice(choice.name, choice.options, f"forced by {ENV_BACKEND}")]
    options: dict[str, Any] = {}
    if forced == "flydsl":
        if platform.arch not in FLYDSL_ARCHS:
            raise BackendUnavailable(f"{ENV_BACKEND}=flydsl, but FlyDSL kernels exist for "
                                     f"{FLYDSL_ARCHS} only and this machine is {platform}")
        options["arch"] = platform.arch
    return [BackendChoice(forced, options, f"forced by {ENV_BACKEND}")]


def resolve(plan: list[BackendChoice]) -> tuple[MoEBackend, BackendChoice, list[str]]:
    """The first backend of `plan` that can run here, and why each earlier one could not."""
    skipped = []
    for choice in plan:
        try:
            backend = choice.make()
            ok, why = backend.available()
        except (BackendUnavailable, ValueError) as exc:
            ok, why = False, str(exc)
        if ok:
            return backend, choice, skipped
        skipped.append(f"{choice} ({choice.reason}): {why}")
    raise BackendUnavailable("no backend can run here: " + "; ".join(skipped))

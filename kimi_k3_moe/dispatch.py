"""Platform -> ordered backend plan: what serves here, what stands behind it, and why.

  gfx950 (MI355X)        flydsl on MXFP4 -> triton on MXFP4 -> torch on MXFP4
  gfx942 (MI300X/MI325X) flydsl on int4  -> triton on int4  -> torch on int4
  other ROCm GPUs        triton on MXFP4 -> torch
  CUDA sm_80 and newer   triton on MXFP4 -> torch
  anything else          torch

The plan is `kernels.SPECS` (fastest first) filtered by each spec's `supports`
for the platform's weight format (`platform.Platform.weight_format`).

`KIMI_K3_MOE_BACKEND=torch|triton|flydsl` replaces the plan with that one
backend, and fails loudly where it cannot run.

`KIMI_K3_MOE_ACT_DTYPE=bf16|fp8|fp4` (default bf16) opts in to quantized
activations; it is read once, here. Every choice carries it as its `act_dtype`
option; backends whose kernels do not run it on this arch leave the plan, the
fallback that emulates (torch) computes the scheme of the kernels it stands
behind, and a GPU where no kernel backend runs it refuses the setting here, at
load, naming the arch and what it supports. Nothing falls back to bf16.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kimi_k3_moe import kernels, settings
from kimi_k3_moe.act_quant import ACT_DTYPES, BF16, ENV_ACT_DTYPE, UnsupportedActDtype, resolve_act_dtype
from kimi_k3_moe.configs import engine_verdicts
from kimi_k3_moe.kernels import BackendSpec, BackendUnavailable, MoEBackend, get_spec
from kimi_k3_moe.platform import Platform, detect_platform

ENV_BACKEND = settings.BACKEND


@dataclass(frozen=True)
class BackendChoice:
    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""

    @property
    def spec(self) -> BackendSpec:
        return get_spec(self.name)

    def make(self) -> MoEBackend:
        return self.spec.make(**dict(self.options))

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.name}[{opts}]" if opts else self.name


def _choice(spec: BackendSpec, platform: Platform, weight_format: str, reason: str) -> BackendChoice:
    return BackendChoice(spec.name, {**spec.options(platform, weight_format), "weight_format": weight_format}, reason)


def _choices_for(platform: Platform) -> list[BackendChoice]:
    # The whole chain shares one weight format, so a fallback computes the same
    # function and can take pre-converted int4 experts.
    weight_format = platform.weight_format
    plan = []
    for spec in kernels.SPECS:
        ok, why = spec.runs_on(platform, weight_format)
        if ok:
            plan.append(_choice(spec, platform, weight_format, why))
    return plan


def _with_act_dtype(plan: list[BackendChoice], platform: Platform, act_dtype: str,
                    forced: bool) -> list[BackendChoice]:
    """Each choice with `act_dtype` in its options; those that cannot run it dropped (or, forced, refused)."""
    kept, kernels_support = [], set()
    for choice in plan:
        spec, weight_format = choice.spec, choice.options.get("weight_format", platform.weight_format)
        supported = spec.act_dtypes(platform, weight_format)
        if not spec.emulates:
            kernels_support.update(supported)
        if act_dtype in supported:
            kept.append(BackendChoice(choice.name, {**choice.options, "act_dtype": act_dtype}, choice.reason))
        elif forced:
            raise UnsupportedActDtype(f"{ENV_ACT_DTYPE}={act_dtype!r}: the {choice.name} backend ({ENV_BACKEND}) "
                                      f"does not run it on {platform}; supported there: {', '.join(supported)}")
    kernel_choices = [c for c in kept if not c.spec.emulates]
    if act_dtype != BF16 and platform.is_gpu and not forced and not kernel_choices:
        choices = [d for d in ACT_DTYPES if d in kernels_support | {BF16}]
        raise UnsupportedActDtype(f"{ENV_ACT_DTYPE}={act_dtype!r} is not available on {platform}: no kernel "
                                  f"backend here runs {act_dtype} activations; supported on {platform.arch}: "
                                  f"{', '.join(choices)}")
    if act_dtype != BF16 and kernel_choices:
        # the emulating fallback computes what the kernels in front of it compute
        arch = platform.arch if platform.is_gpu else None
        scheme = kernel_choices[0].spec.act_quant_for(arch, act_dtype)
        kept = [BackendChoice(c.name, {**c.options, "act_quant": scheme}, c.reason) if c.spec.emulates else c
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
    names = [s.name for s in kernels.SPECS]
    if forced not in names:
        raise ValueError(f"{ENV_BACKEND}={forced!r} is not a backend; choose one of {sorted(names)}")
    for choice in _choices_for(platform):
        if choice.name == forced:
            return [BackendChoice(choice.name, choice.options, f"forced by {ENV_BACKEND}")]
    spec = get_spec(forced)
    if spec.arch_bound:
        raise BackendUnavailable(f"{ENV_BACKEND}={forced}, but {spec.runs_on(platform, platform.weight_format)[1]}")
    # not planned here, but it may still run (the Triton interpreter on a CPU): its `available` says
    return [BackendChoice(forced, {}, f"forced by {ENV_BACKEND}")]


def serving_table(backend: str) -> str | None:
    """Which tile table serves `backend` (a name or a description, "triton[mxfp4]") here: a user table
    from `kimi-k3-moe tune` or the packaged one, and why; None for a backend that reads no tiles."""
    return get_spec(backend.split("[")[0]).table_line()


def aiter_situ_path() -> str | None:
    """vLLM 0.33's own Kimi-K3 path on ROCm (aiter's fused MoE with SiTUv2), when aiter here has it."""
    try:
        import aiter
        from aiter import ActivationType
    except Exception:  # no aiter (or one that does not import): the engine has no such path here
        return None
    if getattr(ActivationType, "Situv2", None) is None:
        return None
    return f"vLLM's aiter a16w4 MoE (aiter {getattr(aiter, '__version__', 'unknown version')})"


def engine_keeps_layer(platform: Platform, engine_path: Callable[[], str | None], layer_key: str, *,
                       identity: dict | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """Why a Kimi-K3 layer stays on the engine's own path, or None when kimi-k3-moe serves it.

    Only where the engine has a Kimi-K3 SiTU path of its own with kernels tuned on that hardware
    (`engine_path()` names it, asked on gfx950 only; vLLM 0.33 there: aiter's a16w4): our kernels
    never ran there, so installing the plugin must not replace it on a guess. Ours serves when $KIMI_K3_MOE_BACKEND
    forces a backend, or when `kimi-k3-moe bench` measured ours faster for this layer shape on this
    GPU (configs/engine_verdicts.py). gfx942 and NVIDIA always get ours.
    """
    env = os.environ if env is None else env
    if platform.vendor != "rocm" or platform.arch != "gfx950" or settings.choice(ENV_BACKEND, env):
        return None
    path = engine_path()
    if path is None:
        return None
    if identity is None:
        from kimi_k3_moe.configs.user_tables import device_identity
        identity = device_identity()
    verdict, why = engine_verdicts.lookup(identity, layer_key, env)
    if verdict == "ours":
        return None
    return (f"{path} serves Kimi-K3 on {platform.arch} with kernels tuned on that GPU, and ours have "
            f"not been measured faster there ({why}); {ENV_BACKEND}=flydsl serves the layer with ours, and "
            f"`kimi-k3-moe bench` with the aiter peer on this GPU records which is faster")

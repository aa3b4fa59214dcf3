"""The "flydsl" backend: FlyDSL kernels on gfx942 (packed int4) and gfx950 (MXFP4).

Evidence (README's ladder): compiled for gfx942 and gfx950 in CI, address logic
played on the CPU by k3lab/flydsl/emulator.py; never run on AMD hardware here. The plugin
runs the load-time self-check on these kernels first and falls back to Triton
when they disagree with the reference. Importing this module does not import
flydsl: compiling and launching do, when first needed.
"""
from __future__ import annotations

import ctypes
import importlib
import os
from typing import Any

import torch

from kimi_k3_moe import settings
from kimi_k3_moe.act_quant import BF16, ActQuant, check_supported
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.experts import Int4Experts, Mxfp4Experts, WeightFormat
from kimi_k3_moe.formats import int4, mxfp4
from kimi_k3_moe.kernels.base import BackendUnavailable, MoEBackend
from kimi_k3_moe.kernels.common import alignment
from kimi_k3_moe.kernels.flydsl import SPEC, build, pipeline, supported_act_dtypes, supported_weight_formats, tiles
from kimi_k3_moe.kernels.flydsl.config import BETA_MODES, REDUCTIONS, FlyKernelConfig, QuantConfig, check_arch
from kimi_k3_moe.kernels.flydsl.experts import FlyDSLExperts
from kimi_k3_moe.platform import detect_platform, for_arch, is_rocm

HIP_LIBRARIES = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")


def detect_arch(device: int = 0) -> str | None:
    """gfx arch of a ROCm GPU torch sees, or None (no GPU, or not a ROCm build)."""
    found = detect_platform(device)
    return found.arch if found.vendor == "rocm" else None


class FlyDSLBackend(MoEBackend):
    name = "flydsl"
    spec = SPEC

    def __init__(self, arch: str | None = None, weight_format: str | None = None, *,
                 int4_method: str = int4.DEFAULT_METHOD,
                 betas: str = "const", reduce: str | None = None, device: int = 0, act_dtype: str = BF16):
        self.device_index = device
        self.arch = arch if arch is not None else detect_arch(device)
        if self.arch is not None:
            check_arch(self.arch)
        here = for_arch(self.arch)
        weight_format = weight_format or (here.weight_format if self.arch else None)
        if self.arch and weight_format not in supported_weight_formats(self.arch):
            raise ValueError(f"flydsl on {self.arch}: weight_format {weight_format!r} not in "
                             f"{supported_weight_formats(self.arch)}")
        if betas not in BETA_MODES:
            raise ValueError(f"flydsl: betas {betas!r} not in {BETA_MODES}")
        # None: $KIMI_K3_MOE_REDUCE, whose default "auto" is the tile table's per-tier choice
        reduce = settings.choice(settings.REDUCE) if reduce is None else reduce
        if reduce not in ("auto", *REDUCTIONS):
            raise ValueError(f"flydsl: reduce {reduce!r} not in {('auto', *REDUCTIONS)}")
        if int4_method not in int4.METHODS:
            raise ValueError(f"flydsl: int4_method {int4_method!r} not in {int4.METHODS}")
        # refused here, at load, as the spec declares: gfx942 has no scaled MFMA (LLVM would abort
        # compiling one), and the scaled MFMA reads e2m1 weights
        act_dtype = check_supported(self.name, self.arch, act_dtype, supported_act_dtypes(self.arch))
        if act_dtype not in SPEC.act_dtypes(here, weight_format):
            raise ValueError(f"flydsl on {self.arch}: act_dtype {act_dtype!r} runs on MXFP4 weights "
                             f"(the scaled MFMA reads e2m1), not {weight_format!r}")
        self.act_quant = ActQuant.for_dtype(act_dtype)
        self.format = WeightFormat.of(weight_format, int4_method) if weight_format else None
        self.betas = betas
        self.reduce = reduce
        self._compiled: dict[FlyKernelConfig, Any] = {}
        self._ready: tuple[bool, str] | None = None

    def describe(self) -> str:
        act = f", {self.act_quant.tag()}" if self.act_quant.quantizes else ""
        return f"{self.name}[{self.arch or 'no AMD GPU'}, {self.weight_format}{act}]"

    # ------------------------------------------------------------------ availability
    def available(self) -> tuple[bool, str]:
        if self._ready is None:
            self._ready = self._probe()
        return self._ready

    def _probe(self) -> tuple[bool, str]:
        try:
            importlib.import_module("flydsl.compiler")
        except Exception as exc:   # flydsl missing, or numpy (an undeclared dependency) missing
            return False, (f"flydsl does not import here ({type(exc).__name__}: {exc}); "
                           "pip install 'kimi-k3-moe[flydsl]'")
        try:
            importlib.import_module("triton")
        except Exception as exc:   # the forward's alignment and top-k sum are Triton kernels
            return False, f"triton does not import here ({type(exc).__name__}: {exc}); the ROCm torch wheels bring it"
        if not is_rocm():
            return False, f"torch {torch.__version__} is not a ROCm build: FlyDSL kernels need an AMD GPU"
        if not torch.cuda.is_available():
            return False, "no AMD GPU visible to torch (ROCm build, but torch.cuda.is_available() is False)"
        found = detect_arch(self.device_index)
        if self.arch is None or found != self.arch:
            return False, (f"GPU {self.device_index} is {found}; this backend was built for {self.arch} "
                           f"(FlyDSL kernels exist for gfx942 and gfx950)")
        env_arch = os.environ.get("FLYDSL_GPU_ARCH") or os.environ.get("ARCH")
        if env_arch and env_arch != self.arch:
            return False, f"FLYDSL_GPU_ARCH/ARCH={env_arch} contradicts the GPU's {self.arch}"
        errors = []
        for lib in HIP_LIBRARIES:
            try:
                ctypes.CDLL(lib)
                break
            except OSError as exc:
                errors.append(str(exc))
        else:
            return False, f"the HIP runtime does not load ({'; '.join(errors)})"
        from importlib.metadata import version
        return True, f"flydsl {version('flydsl')} on {self.arch} ({torch.cuda.get_device_name(self.device_index)})"

    # ------------------------------------------------------------------ weights
    prepared_types = (FlyDSLExperts,)

    def prepare(self, experts: Mxfp4Experts | Int4Experts | FlyDSLExperts) -> FlyDSLExperts:
        if self.arch is None:
            raise BackendUnavailable("flydsl: no arch given and no AMD GPU detected")
        prepared = super().prepare(experts)
        try:   # a shape the kernels cannot tile is a reason to use another backend, found at load
            tiles.stage_configs(self.arch, self.weight_format, hidden=prepared.hidden_size,
                                inter=prepared.intermediate_size, top_k=1, num_tokens=1,
                                activation=ActivationSpec.silu(), has_offsets=prepared.has_offsets,
                                act_dtype=self.act_quant.dtype)
        except ValueError as exc:
            raise BackendUnavailable(f"flydsl cannot serve this layer: {exc}") from exc
        alignment.counters(prepared.device, prepared.num_experts)  # at load: never first inside a graph capture
        return prepared

    def lay_out(self, experts: Mxfp4Experts | Int4Experts) -> FlyDSLExperts:
        if isinstance(experts, Mxfp4Experts):
            for name, scale in (("w13_scale", experts.w13_scale), ("w2_scale", experts.w2_scale)):
                nan = int((scale == mxfp4.E8M0_NAN).sum())
                if nan:
                    raise ValueError(f"Mxfp4Experts.{name} holds {nan} NaN scale byte(s) (0xFF)")
        return FlyDSLExperts.from_experts(experts)

    # ------------------------------------------------------------------ running
    def forward(self, prepared: FlyDSLExperts, hidden: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: ActivationSpec,
                expert_map: torch.Tensor | None = None) -> torch.Tensor:
        self.require_available()
        return pipeline.moe_forward(prepared, hidden, topk_weights, topk_ids, activation, expert_map,
                                    arch=self.arch, launch=self._launch, betas=self.betas, reduce=self.reduce,
                                    act_dtype=self.act_quant.dtype)

    def precompile(self, prepared: FlyDSLExperts, activation: ActivationSpec, top_k: int) -> list[str]:
        """Compile every tier's kernels for this layer now (before graph capture); their names."""
        self.require_available()
        names = []
        if self.act_quant.quantizes:
            qcfg = QuantConfig(self.arch, self.act_quant.dtype)
            self._compiled_for(qcfg)
            names.append(qcfg.name)
        for tier in tiles.default_table()[self.arch]:
            n = tier.max_tokens or 1 << 20
            for cfg in tiles.stage_configs(self.arch, self.weight_format, hidden=prepared.hidden_size,
                                           inter=prepared.intermediate_size, top_k=top_k, num_tokens=n,
                                           activation=activation, betas=self.betas,
                                           has_offsets=prepared.has_offsets, reduce=self.reduce,
                                           act_dtype=self.act_quant.dtype):
                self._compiled_for(cfg)
                names.append(cfg.name)
        return names

    def _compiled_for(self, cfg: FlyKernelConfig | QuantConfig):
        compiled = self._compiled.get(cfg)
        if compiled is None:
            import flydsl.compiler as flyc
            # CPU placeholders: compile without launching (with live GPU tensors flyc.compile
            # would also launch once); the returned function binds real tensors per call.
            try:
                compiled = flyc.compile(build.launcher(cfg), *build.placeholder_args(cfg))
            except Exception as exc:
                raise BackendUnavailable(f"flydsl: compiling {cfg.name} failed: {exc}") from exc
            if compiled is None:
                raise BackendUnavailable("flydsl: COMPILE_ONLY is set in this process; kernels cannot run")
            self._compiled[cfg] = compiled
        return compiled

    def _launch(self, cfg: FlyKernelConfig | QuantConfig, args: tuple) -> None:
        compiled = self._compiled_for(cfg)
        stream = torch.cuda.current_stream(self.device_index)
        try:
            compiled(*args, stream)
        except Exception as exc:
            raise BackendUnavailable(f"flydsl: launching {cfg.name} failed: {exc}") from exc

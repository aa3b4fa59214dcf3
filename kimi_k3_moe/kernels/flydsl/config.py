"""One FlyDSL kernel specialisation: every field that changes the generated code.

A `KernelConfig` is frozen and hashable: it keys the in-process memo of built
launchers, and `name` (which carries the stage, arch, format, shape, tile,
activation and exact beta bits) becomes the kernel symbol, the host launcher's
name and FlyDSL's on-disk cache folder. Everything that is wrong with a config
is refused here, when it is made, never at launch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kimi_k3_moe.act_quant import BF16, FP8
from kimi_k3_moe.activation import SILU, SITUV2, ActivationSpec
from kimi_k3_moe.experts.format import INT4, MXFP4
from kimi_k3_moe.kernels.flydsl import layout, supported_act_dtypes, supported_weight_formats
from kimi_k3_moe.platform import FLYDSL_ARCHS

# Which weight formats and act dtypes each arch's kernels are built for is the spec's declaration
# (kimi_k3_moe.kernels.flydsl, from the platform facts): gfx942 int4 and bf16 only (no FP4 path, no
# scaled MFMA: LLVM aborts); fp8/fp4 activations run on gfx950's scaled MFMA and read MXFP4 weights.

# bf16 MFMA each arch has: gfx950's K=32 form does not exist on gfx942 (LLVM aborts).
MFMA = {"gfx942": "16x16x16", "gfx950": "16x16x32"}
ACTIVATIONS = (SILU, SITUV2)
BETA_MODES = ("const", "runtime")
REDUCTIONS = ("slots", "fused", "atomic")


class UnsupportedArchError(ValueError):
    """An AMD architecture the FlyDSL kernels are not written for."""


def check_arch(arch: str) -> str:
    if arch not in FLYDSL_ARCHS:
        raise UnsupportedArchError(
            f"FlyDSL MoE kernels exist for {FLYDSL_ARCHS} only, not {arch!r} "
            "(gfx942 = MI300X/MI325X with int4 weights, gfx950 = MI355X with MXFP4); "
            "use the triton backend there")
    return arch


@dataclass(frozen=True)
class KernelConfig:
    arch: str
    stage: int                    # 1: x @ W13^T + activation; 2: inter @ W2^T * router weight
    weight_format: str            # "int4" | "mxfp4"
    N: int                        # output columns (stage 1: I, stage 2: H)
    K: int                        # reduction length (stage 1: H, stage 2: I)
    top_k: int
    BM: int = 16                  # sorted rows per workgroup (the alignment block)
    waves: int = 4                # waves per workgroup, side by side along N
    k_waves: int = 1              # ... times this many along K, each summing a slice; partials meet in LDS
    n_rep: int = 2                # 16-column sub-tiles per wave
    kb_unroll: int = 1            # K128 blocks per loop iteration
    a_lds: bool = False           # stage the activation tile through LDS
    prefetch: bool = False        # software-pipelined K loop: the next iteration's loads before this one's MFMAs
    load_first: bool = False      # without prefetch: all of an iteration's loads before its staged tile's barrier
    waves_per_eu: int = 0         # occupancy target handed to LLVM (caps registers); 0 = LLVM's choice
    has_offsets: bool = False     # asymmetric int4: value = q*scale + offset
    activation: str | None = None       # stage 1: "silu" | "situv2"; stage 2: None
    betas: str = "const"                # situv2: "const" (baked in) | "runtime" (kernel args)
    beta: float | None = None           # const situv2 only
    linear_beta: float | None = None    # const situv2 only; None: up passes unchanged
    # stage 2: "slots" (deterministic bf16 rows per (token, slot), summed by a launch after it) | "fused"
    # (the same rows, summed in slot order by the workgroup that completes a token: no launch after it)
    # | "atomic" (fp32 adds)
    reduce: str = "slots"
    split_k: int = 1                    # stage 2 with atomic reduce only
    act_dtype: str = BF16               # "bf16" | "fp8" | "fp4": this stage's input (stage 1 also its output)
    # direct layout: block b is (token, slot) pair b alone (row 0; the rest padding) and BE holds the
    # routed ids as given, so no alignment runs; ids outside [0, num_experts) read nothing
    direct: bool = False
    num_experts: int = 0                # direct only: the bound every id is checked against

    def __post_init__(self) -> None:
        check_arch(self.arch)
        if self.stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2, got {self.stage!r}")
        if self.weight_format not in supported_weight_formats(self.arch):
            raise ValueError(f"weight_format {self.weight_format!r} is not built for {self.arch}; "
                             f"choose one of {supported_weight_formats(self.arch)}")
        if self.has_offsets and self.weight_format != INT4:
            raise ValueError("has_offsets applies to int4 weights only")
        for flag in ("a_lds", "prefetch", "load_first", "has_offsets", "direct"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"KernelConfig.{flag} must be true or false, got {getattr(self, flag)!r}")
        if isinstance(self.waves_per_eu, bool) or not isinstance(self.waves_per_eu, int) \
                or not 0 <= self.waves_per_eu <= 8:
            raise ValueError(f"waves_per_eu must be an int in [0, 8], got {self.waves_per_eu!r}")
        for field in ("N", "K", "top_k", "BM", "waves", "k_waves", "n_rep", "kb_unroll", "split_k"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KernelConfig.{field} must be a positive int, got {v!r}")
        self._check_tile()
        self._check_activation()
        self._check_reduction()
        self._check_act_dtype()
        self._check_direct()

    # ------------------------------------------------------------------ checks
    def _check_tile(self) -> None:
        if self.BM % layout.MFMA_TILE:
            raise ValueError(f"BM={self.BM} must be a multiple of {layout.MFMA_TILE}")
        if self.kb_unroll not in (1, 2, 4):
            raise ValueError(f"kb_unroll={self.kb_unroll} must be 1, 2 or 4")
        if self.waves * self.k_waves > 16:
            raise ValueError(f"waves={self.waves} x k_waves={self.k_waves}: at most 16 waves (1024 threads) "
                             "per workgroup")
        if self.N % self.BN:
            raise ValueError(f"N={self.N} is not a multiple of the tile width BN={self.BN} "
                             f"(waves {self.waves} x n_rep {self.n_rep} x 16)")
        step = layout.K_BLOCK * self.kb_unroll
        if self.K % step:
            raise ValueError(f"K={self.K} is not a multiple of {step} (128 x kb_unroll {self.kb_unroll})")
        if self.a_lds and (self.BM * 16 * self.kb_unroll) % (self.waves * layout.LANES):
            raise ValueError(f"a_lds: the staged tile's {self.BM * 16 * self.kb_unroll} 16-byte chunks "
                             f"must split evenly over {self.waves * layout.LANES} threads")
        if self.load_first and self.prefetch:
            raise ValueError("load_first orders a K iteration's own loads; prefetch already issues them an "
                             "iteration ahead: choose one")
        if self.k_waves > 1:
            if self.a_lds or self.act_dtype != BF16:
                raise ValueError(f"k_waves={self.k_waves} splits K over waves that read their activations "
                                 "directly: a_lds and quantized activations take k_waves=1")
            iters = self.K // (step * self.split_k)
            if iters % self.k_waves:
                raise ValueError(f"k_waves={self.k_waves} does not divide the {iters} K iterations "
                                 f"(K={self.K}, 128 x kb_unroll {self.kb_unroll}, split_k {self.split_k})")

    def _check_activation(self) -> None:
        if self.stage == 2:
            if self.activation is not None or self.beta is not None or self.linear_beta is not None:
                raise ValueError("stage 2 (down projection) takes no activation")
            return
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"stage-1 activation {self.activation!r} is not implemented by the FlyDSL "
                             f"kernels; choose one of {ACTIVATIONS}")
        if self.betas not in BETA_MODES:
            raise ValueError(f"betas {self.betas!r} not in {BETA_MODES}")
        if self.activation == SILU or self.betas == "runtime":
            if self.beta is not None or self.linear_beta is not None:
                raise ValueError(f"{self.activation} with betas={self.betas!r} bakes in no beta values")
            return
        # const situv2: both values explicit, never a default (engines disagree on them)
        ActivationSpec.situv2(self.beta, self.linear_beta)   # raises on a missing or bad beta

    def _check_reduction(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"reduce {self.reduce!r} not in {REDUCTIONS}")
        if self.sums_tokens and (self.stage != 2 or self.direct or self.quantized):
            raise ValueError("reduce='fused' is stage 2's, on aligned rows (the alignment zeroes its counters) "
                             "and bf16 activations")
        if self.sums_tokens and self.BN > 4 * self.threads:
            raise ValueError(f"reduce='fused': the {self.threads} threads sum 4 columns each, fewer than "
                             f"BN={self.BN}")
        if self.split_k == 1:
            return
        if self.stage == 1:
            raise ValueError("split-K on stage 1 would apply the activation to partial K sums; "
                             "stage 1 always reduces over the full K")
        if self.reduce != "atomic":
            raise ValueError("stage-2 split-K needs reduce='atomic' (the slots reduction stores, it does not add)")
        blocks = self.K // (layout.K_BLOCK * self.kb_unroll)
        if blocks % self.split_k:
            raise ValueError(f"split_k={self.split_k} does not divide the {blocks} K iterations "
                             f"(K={self.K}, 128 x kb_unroll {self.kb_unroll})")

    def _check_act_dtype(self) -> None:
        if self.act_dtype not in supported_act_dtypes(self.arch):
            raise ValueError(f"act_dtype {self.act_dtype!r} has no kernel on {self.arch} (no scaled MFMA there); "
                             f"choose one of {supported_act_dtypes(self.arch)}")
        if self.act_dtype == BF16:
            return
        if self.weight_format != MXFP4:
            raise ValueError(f"act_dtype {self.act_dtype!r} runs on MXFP4 weights (the scaled MFMA reads e2m1), "
                             f"not {self.weight_format!r}")
        if self.a_lds:
            raise ValueError("a_lds stages bf16 activation tiles; quantized activations are loaded from "
                             "global memory directly")
        if self.stage == 1 and self.n_rep % 2:
            raise ValueError(f"stage 1 with {self.act_dtype} quantizes its output per 32 columns: n_rep must be "
                             f"even (a wave's pair of 16-column sub-tiles is one scale group), got {self.n_rep}")

    def _check_direct(self) -> None:
        if not self.direct:
            if self.num_experts:
                raise ValueError("num_experts is the direct layout's id bound; set it only with direct=True")
            return
        if self.BM != layout.MFMA_TILE:
            raise ValueError(f"the direct layout puts one pair in each block of {layout.MFMA_TILE} rows, "
                             f"got BM={self.BM}")
        if self.quantized:
            raise ValueError("the direct layout is built for bf16 activations; quantized ones are aligned")
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"direct layout needs num_experts >= 1 (the id bound), got {self.num_experts!r}")

    # ------------------------------------------------------------------ derived
    @property
    def quantized(self) -> bool:
        return self.act_dtype != BF16

    @property
    def sums_tokens(self) -> bool:
        """Stage 2 writes the forward's output itself (reduce "fused")."""
        return self.reduce == "fused"

    @property
    def slot_rows(self) -> bool:
        """Stage 2 stores a bf16 row per (token, slot) (reduce "slots" or "fused")."""
        return self.reduce != "atomic"

    @property
    def BN(self) -> int:
        return self.waves * self.n_rep * layout.MFMA_TILE

    @property
    def mfma(self) -> str:
        return MFMA[self.arch]

    @property
    def workgroup_waves(self) -> int:
        return self.waves * self.k_waves

    @property
    def threads(self) -> int:
        return self.workgroup_waves * layout.LANES

    @property
    def weight_rows(self) -> int:
        """Rows per expert of the weight this stage reads (2I for w13, H for w2)."""
        return 2 * self.N if self.stage == 1 else self.N

    @property
    def k_iters(self) -> int:
        """K loop iterations per wave (each covers 128 x kb_unroll)."""
        return self.K // (layout.K_BLOCK * self.kb_unroll) // self.split_k // self.k_waves

    def activation_spec(self) -> ActivationSpec | None:
        if self.stage == 2:
            return None
        if self.activation == SILU:
            return ActivationSpec.silu()
        if self.betas == "runtime":
            return None   # values arrive at launch
        return ActivationSpec.situv2(self.beta, self.linear_beta)

    def activation_tag(self) -> str:
        """Stage 1: the activation and, when baked in, the exact bits of both betas."""
        if self.stage == 2:
            return f"red_{self.reduce}" + (f"_sk{self.split_k}" if self.split_k > 1 else "")
        if self.activation == SITUV2 and self.betas == "runtime":
            return "situv2_rtbeta"
        return self.activation_spec().cache_tag()

    @property
    def name(self) -> str:
        weights = self.weight_format + ("ofs" if self.has_offsets else "")
        if self.quantized:
            weights += "_a8" if self.act_dtype == FP8 else "_a4"
        tile = (f"bm{self.BM}_w{self.waves}x{self.n_rep}" + (f"_kw{self.k_waves}" if self.k_waves > 1 else "")
                + f"_u{self.kb_unroll}" + ("_lds" if self.a_lds else "")
                + ("_pf" if self.prefetch else "") + ("_lf" if self.load_first else "")
                + (f"_wpe{self.waves_per_eu}" if self.waves_per_eu else "")
                + (f"_dir{self.num_experts}" if self.direct else ""))
        name = (f"k3moe_s{self.stage}_{self.arch}_{weights}_n{self.N}_k{self.K}_top{self.top_k}_{tile}_"
                f"{self.activation_tag()}")
        if not _SYMBOL.fullmatch(name):   # it becomes an assembler symbol and a folder name
            raise ValueError(f"kernel name {name!r} is not a plain identifier")
        return name

    def with_activation(self, spec: ActivationSpec, betas: str = "const") -> "KernelConfig":
        """This stage-1 tile for `spec`; any other activation raises ValueError."""
        if not isinstance(spec, ActivationSpec):
            raise ValueError(f"activation must be an ActivationSpec, got {spec!r}")
        if spec.name == SILU:
            return replace(self, activation=SILU, betas="const", beta=None, linear_beta=None)
        if betas == "runtime":
            return replace(self, activation=SITUV2, betas="runtime", beta=None, linear_beta=None)
        return replace(self, activation=SITUV2, betas="const", beta=spec.beta, linear_beta=spec.linear_beta)


_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class QuantConfig:
    """The activation quantization kernel: bf16 rows -> fp8 e4m3 or MXFP4 codes + e8m0 per 32.

    One lane per group of 32 consecutive elements of the flat [T * K] input, so the
    kernel is the same for every K that is a multiple of 32.
    """

    arch: str
    act_dtype: str                # "fp8" | "fp4"
    waves: int = 4
    stage: int = 0                # marks a quantization kernel (KernelConfig stages are 1 and 2)

    def __post_init__(self) -> None:
        check_arch(self.arch)
        if self.act_dtype not in supported_act_dtypes(self.arch) or self.act_dtype == BF16:
            quantized = tuple(a for a in supported_act_dtypes(self.arch) if a != BF16)
            raise ValueError(f"no activation quantization kernel for {self.act_dtype!r} on {self.arch}; "
                             f"choose one of {quantized or 'none (bf16 only there)'}")
        if self.stage != 0:
            raise ValueError("QuantConfig.stage is 0")
        if self.waves not in (1, 2, 4):
            raise ValueError(f"waves={self.waves} must be 1, 2 or 4")

    @property
    def threads(self) -> int:
        return self.waves * layout.LANES

    @property
    def workgroup_waves(self) -> int:
        return self.waves

    @property
    def name(self) -> str:
        return f"k3moe_q_{self.arch}_{self.act_dtype}_w{self.waves}"


def runtime_betas(spec: ActivationSpec) -> tuple[float, float]:
    """Kernel arguments (beta, linear_beta) for runtime-beta situv2; 0.0 = up unchanged."""
    if spec.name != SITUV2:
        return 0.0, 0.0
    lb = spec.linear_beta
    return float(spec.beta), (0.0 if lb is None else float(lb))

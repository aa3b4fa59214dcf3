"""One FlyDSL kernel specialisation: every choice that changes the generated code, in named groups.

A `FlyKernelConfig` is frozen and hashable: it keys the in-process memo of built launchers, and
`name` (stage, arch, format, shape, tile, activation and the exact beta bits) becomes the kernel
symbol, the host launcher's name and FlyDSL's on-disk cache folder. Each group checks itself when
made; the config checks only what joins groups (a tile must divide the shape, quantized activations
read MXFP4 weights, ...). Nothing wrong with a config is found at launch.

  GemmShape   N, K, top_k                  what the layer fixes
  RowBlocks   BM, direct_experts           how sorted rows are grouped into blocks (the alignment)
  Tile        waves, n_rep, kb_unroll, k_waves, schedule (a KLoop), waves_per_eu
  Activation  stage 1's epilogue; Reduction stage 2's (the epilogue's type is the stage)
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import Enum

from kimi_k3_moe.act_quant import BF16, FP8
from kimi_k3_moe.activation import SILU, SITUV2, ActivationSpec
from kimi_k3_moe.amd_archs import UnsupportedArchError, traits
from kimi_k3_moe.experts.format import INT4, MXFP4
from kimi_k3_moe.kernels.flydsl import layout, supported_act_dtypes, supported_weight_formats

__all__ = ["Activation", "FlyKernelConfig", "GemmShape", "KLoop", "QuantConfig", "Reduction", "RowBlocks",
           "Tile", "UnsupportedArchError", "check_arch", "runtime_betas"]

ACTIVATIONS = (SILU, SITUV2)
BETA_MODES = ("const", "runtime")
REDUCTIONS = ("slots", "fused", "atomic")


def check_arch(arch: str) -> str:
    return traits(arch).arch


def _positive(owner: str, **values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{owner}.{name} must be a positive int, got {v!r}")


class KLoop(Enum):
    """A K iteration's order: where its activations come from and when its loads are issued.

    GLOBAL*: each wave loads its activation fragments from global memory; LDS*: the workgroup
    stages the BM x 128*kb_unroll activation tile through LDS (one barrier after storing it).
    plain: each block's loads right before its MFMAs (after the staged tile's barrier);
    LOAD_FIRST: every load of the iteration before the staged tile's barrier (more registers);
    PREFETCH: software-pipelined, iteration it+1's loads issued before iteration it's MFMAs.
    LDS_DB: PREFETCH with the staged tile double-buffered in LDS: iteration it+1's tile is stored into
    the other buffer after iteration it's MFMAs, then one barrier per iteration.
    """
    GLOBAL = "global"
    GLOBAL_LOAD_FIRST = "global_load_first"
    GLOBAL_PREFETCH = "global_prefetch"
    LDS = "lds"
    LDS_LOAD_FIRST = "lds_load_first"
    LDS_PREFETCH = "lds_prefetch"
    LDS_DB = "lds_db"

    @property
    def staged(self) -> bool:
        return self.value.startswith("lds")

    @property
    def double_buffered(self) -> bool:
        return self is KLoop.LDS_DB

    @property
    def prefetch(self) -> bool:
        return self.value.endswith("prefetch") or self.double_buffered

    @property
    def lds_buffers(self) -> int:
        """Staged activation tiles held in LDS at once."""
        return 2 if self.double_buffered else 1 if self.staged else 0

    @property
    def load_first(self) -> bool:
        return self.value.endswith("load_first")

    @property
    def name_suffix(self) -> str:
        if self.double_buffered:
            return "_lds_db"
        return ("_lds" if self.staged else "") + ("_pf" if self.prefetch else "") + ("_lf" if self.load_first else "")

    def with_staging(self, staged: bool) -> KLoop:
        """The same load order, activations staged through LDS or not (LDS_DB unstaged: GLOBAL_PREFETCH,
        its weights' order without the tile)."""
        if self.double_buffered:
            return self if staged else KLoop.GLOBAL_PREFETCH
        return KLoop(("lds" if staged else "global") + self.value[len("lds" if self.staged else "global"):])

    @classmethod
    def from_flags(cls, a_lds: bool, prefetch: bool = False, load_first: bool = False) -> KLoop:
        """The schedule tile tables before the KLoop wrote as three booleans."""
        if prefetch and load_first:
            raise ValueError("load_first orders a K iteration's own loads; prefetch already issues them an "
                             "iteration ahead: choose one")
        return cls(("lds" if a_lds else "global") + ("_prefetch" if prefetch else "_load_first" if load_first else ""))


LEGACY_TILE_FLAGS = ("a_lds", "prefetch", "load_first")


@dataclass(frozen=True)
class Tile:
    """One stage's workgroup tile: `waves` waves side by side along N (each n_rep 16-column sub-tiles)
    times `k_waves` along K (partials summed in LDS); kb_unroll K128 blocks per K iteration."""
    waves: int = 4
    n_rep: int = 2
    kb_unroll: int = 1
    k_waves: int = 1
    schedule: KLoop = KLoop.GLOBAL
    waves_per_eu: int = 0         # occupancy target handed to LLVM (caps registers); 0 = LLVM's choice

    def __post_init__(self) -> None:
        _positive("Tile", waves=self.waves, n_rep=self.n_rep, kb_unroll=self.kb_unroll, k_waves=self.k_waves)
        if not isinstance(self.schedule, KLoop):
            raise ValueError(f"Tile.schedule must be one of {[s.value for s in KLoop]}, got {self.schedule!r}")
        if isinstance(self.waves_per_eu, bool) or not isinstance(self.waves_per_eu, int) \
                or not 0 <= self.waves_per_eu <= 8:
            raise ValueError(f"waves_per_eu must be an int in [0, 8], got {self.waves_per_eu!r}")
        if self.kb_unroll not in (1, 2, 4):
            raise ValueError(f"kb_unroll={self.kb_unroll} must be 1, 2 or 4")
        if self.workgroup_waves > 16:
            raise ValueError(f"waves={self.waves} x k_waves={self.k_waves}: at most 16 waves (1024 threads) "
                             "per workgroup")
        if self.k_waves > 1 and self.schedule.staged:
            raise ValueError(f"k_waves={self.k_waves} splits K over waves that read their activations "
                             "directly: an LDS schedule takes k_waves=1")

    @property
    def width(self) -> int:
        """BN: output columns per workgroup."""
        return self.waves * self.n_rep * layout.MFMA_TILE

    @property
    def workgroup_waves(self) -> int:
        return self.waves * self.k_waves

    def to_row(self) -> dict:
        """The tile table's JSON entry (defaults left out)."""
        row = {"waves": self.waves, "n_rep": self.n_rep, "kb_unroll": self.kb_unroll,
               "schedule": self.schedule.value}
        if self.k_waves != 1:
            row["k_waves"] = self.k_waves
        if self.waves_per_eu:
            row["waves_per_eu"] = self.waves_per_eu
        return row

    @classmethod
    def from_row(cls, row: dict, where: str = "tile") -> Tile:
        """A table entry; tables written before the KLoop (a_lds/prefetch/load_first) are read too.
        Anything wrong is one line naming `where`."""
        try:
            return cls(**_tile_fields(row))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


def _tile_fields(row: dict) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"a tile is a JSON object, got {row!r}")
    row = dict(row)
    legacy = [k for k in LEGACY_TILE_FLAGS if k in row]
    if legacy:
        if "schedule" in row or "a_lds" not in row:
            raise ValueError(f"a tile sets either schedule or a_lds (with prefetch, load_first), got {sorted(row)}")
        flags = [row.pop(k, False) for k in LEGACY_TILE_FLAGS]
        if not all(isinstance(f, bool) for f in flags):
            raise ValueError(f"{LEGACY_TILE_FLAGS} must be true or false, got {flags}")
        row["schedule"] = KLoop.from_flags(*flags).value
    wanted, allowed = {"waves", "n_rep", "kb_unroll", "schedule"}, {"k_waves", "waves_per_eu"}
    if not wanted <= set(row) <= wanted | allowed:
        raise ValueError(f"a tile must set {sorted(wanted)} (optionally {sorted(allowed)}), got {sorted(row)}")
    if row["schedule"] not in {s.value for s in KLoop}:
        raise ValueError(f"schedule {row['schedule']!r} is not one of {[s.value for s in KLoop]}")
    return {**row, "schedule": KLoop(row["schedule"])}


@dataclass(frozen=True)
class GemmShape:
    """N output columns (stage 1: I, stage 2: H), K reduction length (stage 1: H, stage 2: I), top_k."""
    N: int
    K: int
    top_k: int

    def __post_init__(self) -> None:
        _positive("GemmShape", N=self.N, K=self.K, top_k=self.top_k)


@dataclass(frozen=True)
class RowBlocks:
    """BM sorted rows per block (the alignment block). direct_experts > 0: the direct layout, block b
    is (token, slot) pair b alone (row 0, the rest padding) and BE holds the routed ids as given, so no
    alignment runs; ids outside [0, direct_experts) read nothing."""
    BM: int = 16
    direct_experts: int = 0

    def __post_init__(self) -> None:
        _positive("RowBlocks", BM=self.BM)
        if self.BM % layout.MFMA_TILE:
            raise ValueError(f"BM={self.BM} must be a multiple of {layout.MFMA_TILE}")
        if isinstance(self.direct_experts, bool) or not isinstance(self.direct_experts, int) \
                or self.direct_experts < 0:
            raise ValueError(f"direct layout needs direct_experts >= 1 (the id bound), got {self.direct_experts!r}")
        if self.direct and self.BM != layout.MFMA_TILE:
            raise ValueError(f"the direct layout puts one pair in each block of {layout.MFMA_TILE} rows, "
                             f"got BM={self.BM}")

    @property
    def direct(self) -> bool:
        return self.direct_experts > 0


@dataclass(frozen=True)
class Activation:
    """Stage 1's epilogue: SiLU, or SiTUv2 with both betas baked in ("const") or kernel arguments."""
    name: str
    betas: str = "const"
    beta: float | None = None
    linear_beta: float | None = None   # const situv2; None: up passes unchanged

    def __post_init__(self) -> None:
        if self.name not in ACTIVATIONS:
            raise ValueError(f"stage-1 activation {self.name!r} is not implemented by the FlyDSL "
                             f"kernels; choose one of {ACTIVATIONS}")
        if self.betas not in BETA_MODES:
            raise ValueError(f"betas {self.betas!r} not in {BETA_MODES}")
        if self.name == SILU or self.betas == "runtime":
            if self.beta is not None or self.linear_beta is not None:
                raise ValueError(f"{self.name} with betas={self.betas!r} bakes in no beta values")
            return
        ActivationSpec.situv2(self.beta, self.linear_beta)   # const: both explicit (engines disagree on them)

    @classmethod
    def of(cls, spec: ActivationSpec, betas: str = "const") -> Activation:
        if not isinstance(spec, ActivationSpec):
            raise ValueError(f"activation must be an ActivationSpec, got {spec!r}")
        if spec.name == SILU:
            return cls(SILU)
        if betas == "runtime":
            return cls(SITUV2, "runtime")
        return cls(SITUV2, "const", spec.beta, spec.linear_beta)

    def spec(self) -> ActivationSpec | None:
        """The baked-in activation; None for runtime betas (values arrive at launch)."""
        if self.name == SILU:
            return ActivationSpec.silu()
        return None if self.betas == "runtime" else ActivationSpec.situv2(self.beta, self.linear_beta)

    def tag(self) -> str:
        return "situv2_rtbeta" if self.betas == "runtime" else self.spec().cache_tag()


@dataclass(frozen=True)
class Reduction:
    """Stage 2's epilogue: "slots" (deterministic bf16 rows per (token, slot), summed by a launch after
    it) | "fused" (the same rows, summed in slot order by the workgroup that completes a token: no
    launch after it) | "atomic" (fp32 adds; the only one that takes split_k > 1)."""
    kind: str = "slots"
    split_k: int = 1

    def __post_init__(self) -> None:
        if self.kind not in REDUCTIONS:
            raise ValueError(f"reduce {self.kind!r} not in {REDUCTIONS}")
        _positive("Reduction", split_k=self.split_k)
        if self.split_k > 1 and self.kind != "atomic":
            raise ValueError("stage-2 split-K needs reduce='atomic' (the slots reduction stores, it does not add)")

    def tag(self) -> str:
        return f"red_{self.kind}" + (f"_sk{self.split_k}" if self.split_k > 1 else "")


@dataclass(frozen=True)
class FlyKernelConfig:
    arch: str
    weight_format: str                # "int4" | "mxfp4"
    shape: GemmShape
    epilogue: Activation | Reduction  # Activation: stage 1 (x @ W13^T); Reduction: stage 2 (@ W2^T)
    rows: RowBlocks = field(default_factory=RowBlocks)
    tile: Tile = field(default_factory=Tile)
    act_dtype: str = BF16             # "bf16" | "fp8" | "fp4": this stage's input (stage 1 also its output)
    has_offsets: bool = False         # asymmetric int4: value = q*scale + offset

    def __post_init__(self) -> None:
        check_arch(self.arch)
        for name, kinds in (("shape", (GemmShape,)), ("rows", (RowBlocks,)), ("tile", (Tile,)),
                            ("epilogue", (Activation, Reduction))):
            if not isinstance(getattr(self, name), kinds):
                raise ValueError(f"FlyKernelConfig.{name} must be a {' or '.join(k.__name__ for k in kinds)}, "
                                 f"got {getattr(self, name)!r}")
        if self.weight_format not in supported_weight_formats(self.arch):
            raise ValueError(f"weight_format {self.weight_format!r} is not built for {self.arch}; "
                             f"choose one of {supported_weight_formats(self.arch)}")
        if not isinstance(self.has_offsets, bool) or (self.has_offsets and self.weight_format != INT4):
            raise ValueError("has_offsets (true or false) applies to int4 weights only")
        self._check_tile_fits_shape()
        self._check_act_dtype()
        self._check_reduction()

    def _check_tile_fits_shape(self) -> None:
        tile, N, K = self.tile, self.shape.N, self.shape.K
        if N % self.BN:
            raise ValueError(f"N={N} is not a multiple of the tile width BN={self.BN} "
                             f"(waves {tile.waves} x n_rep {tile.n_rep} x 16)")
        step = layout.K_BLOCK * tile.kb_unroll
        if K % step:
            raise ValueError(f"K={K} is not a multiple of {step} (128 x kb_unroll {tile.kb_unroll})")
        if tile.schedule.staged and (self.BM * 16 * tile.kb_unroll) % (tile.waves * layout.LANES):
            raise ValueError(f"{tile.schedule.value}: the staged tile's {self.BM * 16 * tile.kb_unroll} 16-byte "
                             f"chunks must split evenly over {tile.waves * layout.LANES} threads")
        iters = K // (step * self.reduction.split_k)
        if tile.k_waves > 1 and iters % tile.k_waves:
            raise ValueError(f"k_waves={tile.k_waves} does not divide the {iters} K iterations "
                             f"(K={K}, 128 x kb_unroll {tile.kb_unroll}, split_k {self.reduction.split_k})")

    def _check_act_dtype(self) -> None:
        if self.act_dtype not in supported_act_dtypes(self.arch):
            raise ValueError(f"act_dtype {self.act_dtype!r} has no kernel on {self.arch} (no scaled MFMA there); "
                             f"choose one of {supported_act_dtypes(self.arch)}")
        if not self.quantized:
            return
        if self.weight_format != MXFP4:
            raise ValueError(f"act_dtype {self.act_dtype!r} runs on MXFP4 weights (the scaled MFMA reads e2m1), "
                             f"not {self.weight_format!r}")
        if self.tile.schedule.staged or self.tile.k_waves > 1:
            raise ValueError("quantized activations are loaded from global memory by each wave: no LDS "
                             "schedule, k_waves=1")
        if self.stage == 1 and self.tile.n_rep % 2:
            raise ValueError(f"stage 1 with {self.act_dtype} quantizes its output per 32 columns: n_rep must be "
                             f"even (a wave's pair of 16-column sub-tiles is one scale group), got {self.tile.n_rep}")
        if self.rows.direct:
            raise ValueError("the direct layout is built for bf16 activations; quantized ones are aligned")

    def _check_reduction(self) -> None:
        if self.sums_tokens and (self.rows.direct or self.quantized):
            raise ValueError("reduce='fused' is stage 2's, on aligned rows (the alignment zeroes its counters) "
                             "and bf16 activations")
        if self.sums_tokens and self.BN > 4 * self.threads:
            raise ValueError(f"reduce='fused': the {self.threads} threads sum 4 columns each, fewer than "
                             f"BN={self.BN}")
        blocks = self.shape.K // (layout.K_BLOCK * self.tile.kb_unroll)
        if blocks % self.reduction.split_k:
            raise ValueError(f"split_k={self.reduction.split_k} does not divide the {blocks} K iterations "
                             f"(K={self.shape.K}, 128 x kb_unroll {self.tile.kb_unroll})")

    # ------------------------------------------------------------------ derived
    @property
    def stage(self) -> int:
        return 1 if isinstance(self.epilogue, Activation) else 2

    @property
    def activation(self) -> Activation | None:
        return self.epilogue if self.stage == 1 else None

    @property
    def reduction(self) -> Reduction:
        """Stage 2's reduction; stage 1 stores rows and splits no K (the defaults)."""
        return self.epilogue if self.stage == 2 else Reduction()

    @property
    def BM(self) -> int:
        return self.rows.BM

    @property
    def BN(self) -> int:
        return self.tile.width

    @property
    def quantized(self) -> bool:
        return self.act_dtype != BF16

    @property
    def sums_tokens(self) -> bool:
        """Stage 2 writes the forward's output itself (reduce "fused")."""
        return self.reduction.kind == "fused"

    @property
    def slot_rows(self) -> bool:
        """Stage 2 stores a bf16 row per (token, slot) (reduce "slots" or "fused")."""
        return self.reduction.kind != "atomic"

    @property
    def mfma(self) -> str:
        return traits(self.arch).mfma

    @property
    def workgroup_waves(self) -> int:
        return self.tile.workgroup_waves

    @property
    def threads(self) -> int:
        return self.workgroup_waves * layout.LANES

    @property
    def weight_rows(self) -> int:
        """Rows per expert of the weight this stage reads (2I for w13, H for w2)."""
        return 2 * self.shape.N if self.stage == 1 else self.shape.N

    @property
    def k_iters(self) -> int:
        """K loop iterations per wave (each covers 128 x kb_unroll)."""
        t = self.tile
        return self.shape.K // (layout.K_BLOCK * t.kb_unroll) // self.reduction.split_k // t.k_waves

    def activation_spec(self) -> ActivationSpec | None:
        return self.activation.spec() if self.stage == 1 else None

    def activation_tag(self) -> str:
        """Stage 1: the activation and, when baked in, the exact bits of both betas; stage 2 its reduction."""
        return self.epilogue.tag()

    @property
    def name(self) -> str:
        t = self.tile
        weights = self.weight_format + ("ofs" if self.has_offsets else "")
        if self.quantized:
            weights += "_a8" if self.act_dtype == FP8 else "_a4"
        tile = (f"bm{self.BM}_w{t.waves}x{t.n_rep}" + (f"_kw{t.k_waves}" if t.k_waves > 1 else "")
                + f"_u{t.kb_unroll}" + t.schedule.name_suffix
                + (f"_wpe{t.waves_per_eu}" if t.waves_per_eu else "")
                + (f"_dir{self.rows.direct_experts}" if self.rows.direct else ""))
        s = self.shape
        name = f"k3moe_s{self.stage}_{self.arch}_{weights}_n{s.N}_k{s.K}_top{s.top_k}_{tile}_{self.activation_tag()}"
        if not _SYMBOL.fullmatch(name):   # it becomes an assembler symbol and a folder name
            raise ValueError(f"kernel name {name!r} is not a plain identifier")
        return name

    def with_activation(self, spec: ActivationSpec, betas: str = "const") -> FlyKernelConfig:
        """This stage-1 tile for `spec`; any other activation raises ValueError."""
        return replace(self, epilogue=Activation.of(spec, betas))

    def with_tile(self, **changes) -> FlyKernelConfig:
        return replace(self, tile=replace(self.tile, **changes))

    def with_reduction(self, kind: str, split_k: int = 1) -> FlyKernelConfig:
        return replace(self, epilogue=Reduction(kind, split_k))


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

    def __post_init__(self) -> None:
        check_arch(self.arch)
        if self.act_dtype not in supported_act_dtypes(self.arch) or self.act_dtype == BF16:
            quantized = tuple(a for a in supported_act_dtypes(self.arch) if a != BF16)
            raise ValueError(f"no activation quantization kernel for {self.act_dtype!r} on {self.arch}; "
                             f"choose one of {quantized or 'none (bf16 only there)'}")
        if self.waves not in (1, 2, 4):
            raise ValueError(f"waves={self.waves} must be 1, 2 or 4")

    @property
    def stage(self) -> int:
        return 0                  # marks a quantization kernel (the GEMMs are stages 1 and 2)

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

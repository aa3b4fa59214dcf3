"""MODELLED speed of the FlyDSL MoE on MI355X (gfx950, MXFP4) and MI300X (gfx942, int4), beside aiter's timings.

Nothing here runs on AMD hardware. Every kernel of every token tier is compiled for its arch on
this machine (one process per compile), its ISA is read by k3lab.flydsl.isa_model
(one wave's critical path, occupancy rounds, HBM bytes over eta x peak, plus T0 per launch).
The model's three constants are fitted on aiter's published gfx950 a16w4 stage timings at the
K3 TP8 per-rank shape, with aiter's kernel compiled at the tile each timed row names
(benchmarks/flydsl_model_data.py): all 16 rows of the pre-retune table; aiter PR 5118's retune
is the held-out check and a second fit. Ours is then compared with aiter's newest rows (measured
by aiter: model vs measured) and with aiter's kernels through the same model (model vs model),
beside the HBM and compute floors (the compute floor at each arch's dense bf16 MFMA rate from its
traits); every ratio carries its band when L and eta each move +-30 % (the other two constants
refitted). Every row is modelled under uniform routing and under the bench's `skewed` routing (one
draw, benchmarks/flydsl_model_routing.py), with each stage's last-round fill (the grid's tail) and
what balancing that tail would save.

    python benchmarks/flydsl_model.py [--json [FILE]] [--aiter-src DIR] [--rocm DIR] [--tokens 1,16]

aiter's kernels: FlyDSL's repository carries a standalone copy (kernels/moe/moe_2stage_a16wmix/,
importing only flydsl and kernels.common); put a checkout at .peer/FlyDSL (ignored by git):
`git clone --depth 1 https://github.com/ROCm/FlyDSL .peer/FlyDSL`. Without it nothing is fitted:
our rows print with the constants below against aiter's measured rows, bands with the others held.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import flydsl_model_data as aiter_rows  # noqa: E402
import flydsl_model_routing as routes  # noqa: E402
from flydsl_model_routing import UNIFORM, RoutingModel  # noqa: E402

from k3lab.flydsl import artifacts, isa_model  # noqa: E402
from k3lab.flydsl.isa_model import Launch, Params  # noqa: E402
from kimi_k3_moe.amd_archs import AMD_ARCHS  # noqa: E402

H, I, E, TOP_K = 3584, 384, 896, 16          # Kimi-K3 routed experts, per rank at TP8
TIERS = (1, 4, 16, 64, 128, 256, 1024, 2048, 4096, 8192, 16384)
FORMAT = {arch: t.weight_formats[0] for arch, t in AMD_ARCHS.items()}
SCALE_BYTES = {"mxfp4": 1, "int4": 2}          # per 32 weights: e8m0 byte, bf16 group scale
MFMA_K = {arch: t.mfma_k for arch, t in AMD_ARCHS.items()}
SCALED_MFMA_K = 128                            # gfx950's scaled fp8/fp4 MFMA, 16x16x128
ACT_BYTES = {"bf16": 2.0, "fp8": 1 + 1 / 32, "fp4": 0.5 + 1 / 32}   # per activation, e8m0 per 32 included
# constants of the fit below (docs/FLYDSL.md); used when aiter's source is absent
FITTED = Params(t0_us=3.5, latency_ns=575.0, eta=0.70)
OLD_CONSTANTS = Params(t0_us=1.1, latency_ns=725.0, eta=0.64)   # the earlier fit, at the wrong tiles
SWING = 0.30              # the sensitivity band: L and eta each times 1 -+ SWING
GLUE_LAUNCH_US = 2.5      # a small kernel between the stages, graph replay (stated, not fitted)
PEER_SRC_HINT = ("aiter's kernels are not at {src}: get FlyDSL's repository (github.com/ROCm/FlyDSL, "
                 "kernels/moe/moe_2stage_a16wmix/ and kernels/common/) into that folder, e.g. "
                 "`git clone --depth 1 https://github.com/ROCm/FlyDSL .peer/FlyDSL`")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ bytes and floors
def weight_bytes(weight_format: str, rows: int, cols: int) -> float:
    return rows * cols * (0.5 + SCALE_BYTES[weight_format] / 32)


def hbm_floor_us(arch: str, tokens: int, routing: RoutingModel = UNIFORM) -> float:
    """The touched experts' weights and scales at the full HBM peak (eta 1: a hard floor)."""
    w = FORMAT[arch]
    per_expert = weight_bytes(w, 2 * I, H) + weight_bytes(w, H, I)
    return routing.distinct(tokens) * per_expert / (isa_model.DEVICES[arch].peak_tbs * 1e12) * 1e6


def flop_per_token() -> float:
    """The layer's work per token at K3 TP8: 2 x (H x 2I + I x H) x top-k (132.1 MFLOP)."""
    return 2 * (H * 2 * I + I * H) * TOP_K


def bf16_tflops(arch: str) -> float:
    """Dense bf16 MFMA peak from the arch's traits: CUs x SIMDs x the MFMA's flops / its issue cycles x clock
    (gfx942 16x16x16 in 16 cycles at 2.1 GHz on 304 CUs: 1307; gfx950 16x16x32 at 2.4 GHz on 256: 2517)."""
    t = AMD_ARCHS[arch]
    return t.cus * t.simds_per_cu * 2 * 16 * 16 * t.mfma_k / t.mfma_cycles * t.clock_ghz * 1e9 / 1e12


def compute_floor_us(arch: str, tokens: int) -> float:
    return tokens * flop_per_token() / (bf16_tflops(arch) * 1e12) * 1e6


# ------------------------------------------------------------------ what each side launches
_TILE = re.compile(r"^t(\d+)x(\d+)x(\d+)((?:_[a-z]+\d*)*)$")


@dataclass(frozen=True)
class PeerSpec:
    """One of aiter's a16w4 kernels (FlyDSL's standalone copy), as aiter's host builds it from a table name."""
    arch: str
    stage: int
    BM: int
    tile_n: int
    tile_k: int
    k_wave: int = 1
    b_cache_mod: int = 0
    xcd: int = 0

    @classmethod
    def from_tile(cls, arch: str, stage: int, tile: str) -> PeerSpec:
        """`tile` is the part of aiter's kernel name after the dtypes, e.g. "t32x32x256_w4_xcd4_kw2".
        As aiter's host reads it: `_bnt` defaults to 2 on stage 1 and 0 on stage 2; `_w` (waves per
        EU) and `_persist` are not passed to this kernel at run time, so they change nothing here;
        stage 2 adds atomically whatever the name says."""
        m = _TILE.match(tile)
        if not m:
            raise ValueError(f"aiter tile {tile!r} is not t<BM>x<N>x<K>[_flags]")
        flags = dict(re.match(r"([a-z]+)(\d*)$", f).groups() for f in m.group(4).split("_")[1:])
        unknown = set(flags) - {"w", "bnt", "xcd", "kw", "persist", "atomic"}
        if unknown:
            raise ValueError(f"aiter tile {tile!r}: flags {sorted(unknown)} are not modelled")
        return cls(arch, stage, int(m.group(1)), int(m.group(2)), int(m.group(3)), k_wave=int(flags.get("kw") or 1),
                   b_cache_mod=int(flags.get("bnt") or (2 if stage == 1 else 0)), xcd=int(flags.get("xcd") or 0))

    @property
    def key(self) -> str:
        return (f"aiter_s{self.stage}_{self.arch}_bm{self.BM}_tn{self.tile_n}_tk{self.tile_k}_kw{self.k_wave}"
                f"_bcm{self.b_cache_mod}_xcd{self.xcd}")


def peer_pair(tile1: str, tile2: str) -> tuple[PeerSpec, PeerSpec]:
    return PeerSpec.from_tile("gfx950", 1, tile1), PeerSpec.from_tile("gfx950", 2, tile2)


def all_peer_specs() -> list[PeerSpec]:
    pairs = [peer_pair(r[1], r[3]) for r in aiter_rows.PRE_RETUNE + aiter_rows.RETUNE_5118]
    pairs += [peer_pair(*tiles) for _, tiles in aiter_rows.NEWEST_A16W4.values() if tiles]
    return list(dict.fromkeys(s for pair in pairs for s in pair))


def our_configs(arch: str, tokens: int, reduce: str = "auto", act_dtype: str = "bf16"):
    from k3lab.flydsl.sweep import K3_SITU
    from kimi_k3_moe.kernels.flydsl import tiles
    # as the forward picks them for the engines' routing: int32 ids, no expert map (direct tiers apply)
    return tiles.stage_configs(arch, FORMAT[arch], hidden=H, inter=I, top_k=TOP_K, num_tokens=tokens,
                               activation=K3_SITU, direct_experts=E, table=tiles.default_table(), reduce=reduce,
                               act_dtype=act_dtype)


def mfma_per_wave(mfma_k: int, bm: int, cols: int, k: int, waves: int, int4_tiles: int = 0) -> int:
    """MFMAs one wave issues for a BM x cols x k workgroup tile split over `waves` waves. Our int4
    kernels issue one more MFMA chain per 32-group and row tile (the -136 sum of the activations)
    beside their `int4_tiles` weight tiles per wave."""
    plain = bm * cols * k // (16 * 16 * mfma_k * waves)
    return plain * (int4_tiles + 1) // int4_tiles if int4_tiles else plain


def int4_tiles(cfg) -> int:
    """Weight tiles per wave of an int4 kernel (gate and up on stage 1), 0 for MXFP4."""
    return cfg.tile.n_rep * (2 if cfg.stage == 1 else 1) if cfg.weight_format == "int4" else 0


def our_launches(arch: str, tokens: int, kernels: dict, reduce: str = "auto", act_dtype: str = "bf16",
                 routing: RoutingModel = UNIFORM) -> list[Launch]:
    s1, s2 = our_configs(arch, tokens, reduce, act_dtype)
    weight_format = FORMAT[arch]
    if s1.rows.direct:   # one block per (token, slot) pair, each reading its expert's weights
        blocks = d = tokens * TOP_K
    else:
        blocks, d = routing.blocks(tokens, s1.BM), routing.distinct(tokens)
    rows = blocks * s1.BM
    a = ACT_BYTES[act_dtype]
    mk = SCALED_MFMA_K if s1.quantized else MFMA_K[arch]
    k1, k2 = kernels[s1.name], kernels[s2.name]
    return [
        Launch("stage 1", k1, math.ceil(blocks * (I // s1.BN)),
               d * weight_bytes(weight_format, 2 * I, H) + tokens * H * a + rows * I * a + rows * 4,
               mfma_per_wave(mk, s1.BM, 2 * s1.BN, H, s1.workgroup_waves, int4_tiles(s1))),
        # stage 2's output: a bf16 row per (token, slot), or fp32 atomic adds into [T, H] counted once
        # (the convention aiter's row uses for its bf16 adds; atomic throughput is not modelled);
        # fused, it reads the slot rows back and writes the bf16 output (token_sum_bytes)
        Launch("stage 2", k2, math.ceil(blocks * (H // s2.BN)),
               d * weight_bytes(weight_format, H, I) + rows * I * a + rows * 4
               + (tokens * TOP_K * H * 2 if s2.slot_rows else tokens * H * 4)
               + (token_sum_bytes(s2, tokens) if s2.sums_tokens else 0),
               mfma_per_wave(mk, s2.BM, s2.BN, I // s2.reduction.split_k, s2.workgroup_waves, int4_tiles(s2))),
    ]


def token_sum_bytes(s2, tokens: int) -> int:
    """What a fused stage 2 moves through HBM besides its GEMM: each token's slot rows read back, its
    bf16 output, the slots' local experts and the arrival counters once each (every column tile
    rereads the same few KB from L2; the atomics' own throughput is not modelled)."""
    return tokens * TOP_K * H * 2 + tokens * H * 2 + tokens * TOP_K * 4 + (tokens + 1) * (H // s2.BN) * 4


def peer_launches(tokens: int, specs: tuple[PeerSpec, PeerSpec], kernels: dict,
                  routing: RoutingModel = UNIFORM) -> list[Launch]:
    """aiter's two a16w4 launches at these tiles; its waves per workgroup read from the compiled code."""
    s1, s2 = specs
    weight_format = FORMAT[s1.arch]
    blocks = routing.blocks(tokens, s1.BM)
    rows = blocks * s1.BM
    d = routing.distinct(tokens)
    k1, k2 = kernels[s1.key], kernels[s2.key]
    mk = MFMA_K[s1.arch]
    return [
        Launch("stage 1", k1, math.ceil(blocks * (I // s1.tile_n)),
               d * weight_bytes(weight_format, 2 * I, H) + tokens * H * 2 + rows * I * 2 + rows * 4,
               mfma_per_wave(mk, s1.BM, 2 * s1.tile_n, H, k1.waves_per_workgroup)),
        Launch("stage 2", k2, math.ceil(blocks * (H // s2.tile_n)),
               d * weight_bytes(weight_format, H, I) + rows * I * 2 + tokens * H * 2 + rows * 4,
               mfma_per_wave(mk, s2.BM, s2.tile_n, I, k2.waves_per_workgroup)),
    ]


# ------------------------------------------------------------------ our forward's other launches
def glue_ops(arch: str, tokens: int, reduce: str = "auto", act_dtype: str = "bf16") -> list[tuple[str, int]]:
    """(label, bytes of its tensor arguments) of every launch pipeline.moe_forward makes besides the
    two GEMM stages (the Triton alignment and top-k sum; with quantized activations the FlyDSL
    quantization kernel, costed like them by its bytes), recorded on the meta device (shapes only,
    no memory, nothing run); a PyTorch op that computes would show up too, under its aten name. The
    routing is the engines': int32 ids, no expert map."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from k3lab.flydsl.sweep import K3_SITU
    from kimi_k3_moe.kernels.common import launch as glue_launch
    from kimi_k3_moe.kernels.common.alignment import counters
    from kimi_k3_moe.kernels.flydsl import pipeline

    class Experts:   # what moe_forward reads of a prepared layer
        weight_format, has_offsets, num_experts, intermediate_size, hidden_size = FORMAT[arch], False, E, I, H

        def kernel_args(self, which):
            z = torch.empty(1, dtype=torch.uint8, device="meta")
            return z, z, z

    def size(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        return sum(size(y) for y in x) if isinstance(x, (list, tuple)) else 0

    ops: list = []
    allocate_or_view = ("aten.empty", "aten.view", "aten._unsafe_view", "aten.reshape", "aten.slice",
                        "aten.select", "aten.t.", "aten.expand", "aten.alias", "aten.detach", "aten.unsqueeze",
                        "aten.squeeze", "aten.as_strided", "aten.lift_fresh")

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not str(func).startswith(allocate_or_view):
                ops.append((str(func), size(list(args)) + size(list((kwargs or {}).values())) + size(out)))
            return out

    hidden = torch.empty(tokens, H, dtype=torch.bfloat16, device="meta")
    weights = torch.empty(tokens, TOP_K, device="meta")
    ids = torch.empty(tokens, TOP_K, dtype=torch.int32, device="meta")
    counters(torch.device("meta"), E)   # allocated once per process, not per forward
    run = glue_launch.Launch.__call__
    glue_launch.Launch.__call__ = lambda launch: ops.append((launch.label, size(list(launch.args.values()))))
    try:
        with Record():
            pipeline.moe_forward(Experts(), hidden, weights, ids, K3_SITU, None, arch=arch,
                                 launch=lambda cfg, args: ops.append((cfg.name, size(list(args))))
                                 if cfg.stage == 0 else None, reduce=reduce, act_dtype=act_dtype)
    finally:
        glue_launch.Launch.__call__ = run
    return ops


def glue_us(ops, device, params: Params) -> float:
    return sum(GLUE_LAUNCH_US + b / (params.eta * device.peak_tbs * 1e12) * 1e6 for _, b in ops)


def peer_sort_us(tokens: int, device, params: Params) -> float:
    """aiter's one sorting launch, which also zeroes the bf16 output its stage 2 adds into."""
    return GLUE_LAUNCH_US + (tokens * H * 2 + tokens * TOP_K * 8) / (params.eta * device.peak_tbs * 1e12) * 1e6


# ------------------------------------------------------------------ the comparisons
# (arch, our activations, aiter's measured rows, what they are)
VARIANTS = (("gfx950", "bf16", aiter_rows.NEWEST_A16W4, "a16w4 (newest)"),
            ("gfx950", "fp8", aiter_rows.A8W4, "a8w4"),
            ("gfx950", "fp4", aiter_rows.A4W4, "a4w4"),
            ("gfx942", "bf16", aiter_rows.GFX942_A16W4, "gfx942 a16w4 (MI300X, measured)"))
RATIOS = ("ours_kernels_over_aiter_measured", "ours_all_over_aiter_measured", "ours_over_aiter_model",
          "ours_all_over_hbm_floor", "ours_all_over_compute_floor", "skewed_over_uniform")


def _slots(launch: Launch, device) -> int:
    """Workgroups the GPU holds at once for this kernel, counted as isa_model.launch_time counts them."""
    k = launch.kernel
    occ = artifacts.occupancy(device.arch, vgpr=k.vgpr, agpr=k.agpr, accum_offset=k.accum_offset,
                              lds_bytes=k.lds_bytes, waves_per_workgroup=k.waves_per_workgroup)
    return device.cus * max(1, occ["waves_per_simd"] * device.simds // k.waves_per_workgroup)


def _detail(launch: Launch, t, device, params: Params) -> dict:
    """One stage's figures, with the last round's fill (the grid's tail: the share of the GPU's workgroup
    slots busy in the final round) and the stage with its tail balanced: the work of a launch that fills
    the GPU at least twice spread over every slot to the end (finer work items in the tail, e.g. the
    hot experts' N or K split further), an upper bound on what scheduling alone saves. Equal work items
    handed out by persistent workgroups keep the same last round, so they alone save nothing here."""
    slots = _slots(launch, device)
    fill = launch.workgroups / slots - (t.rounds - 1)
    balanced = t.us if t.rounds < 2 else \
        params.t0_us + max(t.compute_us * launch.workgroups / (t.rounds * slots), t.memory_us)
    return {"kernel": launch.kernel.name, "us": round(t.us, 1), "compute_us": round(t.compute_us, 1),
            "memory_us": round(t.memory_us, 1), "bound": "hbm" if t.memory_us >= t.compute_us else "issue",
            "critical_us": round(t.critical_us, 1), "rounds": t.rounds, "waves_per_simd": t.waves_per_simd,
            "workgroups": launch.workgroups, "slots": slots, "last_round_fill": round(fill, 3),
            "balanced_tail_us": round(balanced, 1), "hbm_mb": round(launch.hbm_bytes / 1e6, 2)}


def _ours(arch, act, t, kernels, params: Params, reduce: str, routing: RoutingModel) -> tuple[list[dict], float]:
    device = isa_model.DEVICES[arch]
    launches = our_launches(arch, t, kernels, reduce, act, routing)
    stages = [isa_model.launch_time(x, device, params) for x in launches]
    return [_detail(x, s, device, params) for x, s in zip(launches, stages, strict=True)], sum(s.us for s in stages)


def model_row(arch: str, act: str, measured: dict, t: int, kernels: dict, params: Params, reduce: str,
              skewed: RoutingModel = routes.SKEWED) -> dict:
    """One token count: ours (model) under uniform and skewed routing, aiter's measured row, aiter through
    the same model where its row names a FlyDSL kernel we compiled (gfx950 bf16 only), the floors, the ratios."""
    device = isa_model.DEVICES[arch]
    row: dict = {"tokens": t}
    s1 = our_configs(arch, t, reduce, act)[0]
    if all(c.name in kernels for c in our_configs(arch, t, reduce, act)):
        ops = glue_ops(arch, t, reduce, act)
        glue = glue_us(ops, device, params)
        row["ours_glue_ops"] = [name for name, _ in ops]
        row["ours_launches"] = 2 + len(ops)
        for routing in (UNIFORM, skewed):
            stages, kernels_us = _ours(arch, act, t, kernels, params, reduce, routing)
            tag = "" if routing is UNIFORM else "skewed_"
            row[f"ours_{tag}stages"] = stages
            row[f"ours_{tag}kernels_us"] = kernels_us
            row[f"ours_{tag}all_us"] = kernels_us + glue
            row[f"ours_{tag}tail_gain_us"] = max(0.0, kernels_us - sum(x["balanced_tail_us"] for x in stages))
            if not s1.rows.direct:
                row[f"{tag or 'uniform_'}routing"] = routing.summary(t, s1.BM)
        row["skewed_over_uniform"] = row["ours_skewed_all_us"] / row["ours_all_us"]
    entry = measured.get(t)
    if entry is not None:
        total, tiles = entry if isinstance(entry, tuple) else (entry, None)
        row["aiter_measured_us"] = total
        specs = peer_pair(*tiles) if tiles else None
        if specs and all(s.key in kernels for s in specs):
            for routing in (UNIFORM, skewed):
                launches = peer_launches(t, specs, kernels, routing)
                us = sum(isa_model.launch_time(x, device, params).us for x in launches)
                row["aiter_model_us" if routing is UNIFORM else "aiter_model_skewed_us"] = \
                    us + peer_sort_us(t, device, params)
    row["hbm_floor_us"], row["compute_floor_us"] = hbm_floor_us(arch, t), compute_floor_us(arch, t)
    if "ours_all_us" in row:
        if "aiter_measured_us" in row:
            row["ours_kernels_over_aiter_measured"] = row["ours_kernels_us"] / row["aiter_measured_us"]
            row["ours_all_over_aiter_measured"] = row["ours_all_us"] / row["aiter_measured_us"]
        if "aiter_model_us" in row:
            row["ours_over_aiter_model"] = row["ours_all_us"] / row["aiter_model_us"]
        row["ours_all_over_hbm_floor"] = row["ours_all_us"] / row["hbm_floor_us"]
        row["ours_all_over_compute_floor"] = row["ours_all_us"] / row["compute_floor_us"]
    return row


def comparison(arch, act, measured, tokens, kernels, param_sets: dict, reduce: str,
               skewed: RoutingModel = routes.SKEWED) -> list[dict]:
    """Rows at the central constants, each ratio with its [low, high] over every constant set."""
    rows = []
    for t in tokens:
        by_set = {k: model_row(arch, act, measured, t, kernels, p, reduce, skewed) for k, p in param_sets.items()}
        row = by_set["central"]
        for key in RATIOS:
            values = [r[key] for r in by_set.values() if key in r]
            if key in row:
                row[key + "_band"] = [min(values), max(values)]
        rows.append(row)
    return rows


def _fmt(row: dict, key: str) -> str:
    v = row.get(key)
    if v is None:
        return "n/a"
    if key in RATIOS:
        lo, hi = row[key + "_band"]
        digits = 0 if v >= 20 else 2
        return f"{v:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"
    return str(v) if isinstance(v, int) else f"{v:.1f}"


COLUMNS = (("tokens", "tokens"), ("ours_all_us", "ours all"), ("ours_launches", "launches"),
           ("ours_skewed_all_us", "ours all, skewed"), ("skewed_over_uniform", "skewed / uniform"),
           ("aiter_measured_us", "aiter measured"), ("aiter_model_us", "aiter all (model)"),
           ("ours_kernels_over_aiter_measured", "ours kernels / aiter measured"),
           ("ours_all_over_aiter_measured", "ours all / aiter measured"),
           ("ours_over_aiter_model", "ours / aiter, both modelled"),
           ("hbm_floor_us", "HBM floor"), ("ours_all_over_hbm_floor", "ours all / HBM floor"),
           ("compute_floor_us", "compute floor"), ("ours_all_over_compute_floor", "ours all / compute floor"))


def print_table(title: str, rows: list[dict]) -> None:
    """A markdown table, as docs/PERF.md carries it (a column empty in every row left out)."""
    columns = [(k, h) for k, h in COLUMNS if any(k in r for r in rows)]
    print(f"\n**{title}**\n")
    print("| " + " | ".join(h for _, h in columns) + " |")
    print("|" + "---:|" * len(columns))
    for r in rows:
        print("| " + " | ".join(_fmt(r, k) for k, _ in columns) + " |")


# issue 47's targets (model figures): (table prefix, ratio, bound, token counts)
TARGETS = (("gfx942 int4 bf16", "ours_all_over_compute_floor", 2.0, (4096, 16384)),
           ("gfx942 int4 bf16", "ours_all_over_aiter_measured", 0.5, (16384,)),
           ("gfx950 mxfp4 bf16", "ours_all_over_compute_floor", 2.0, (4096, 16384)),
           ("gfx950 mxfp4 bf16", "ours_all_over_aiter_measured", 0.6, (4096, 16384)),
           ("gfx950 mxfp4 fp8", "ours_all_over_aiter_measured", 0.9, (4096, 16384)),
           ("gfx950 mxfp4 fp4", "ours_all_over_aiter_measured", 0.9, (4096, 16384)),
           ("", "skewed_over_uniform", 1.25, (4096, 16384)))


def print_targets(rows_by_table: dict) -> None:
    """Each target of the issue with the model's figure (central constants, band in brackets)."""
    print("\n**Targets (model figures)**\n")
    print("| table | ratio | target | " + " | ".join(f"{t} tokens" for t in (4096, 16384)) + " |")
    print("|---|---|---:|---:|---:|")
    for prefix, key, bound, tokens in TARGETS:
        for name, rows in rows_by_table.items():
            if not name.startswith(prefix):
                continue
            cells = []
            for t in (4096, 16384):
                r = next((r for r in rows if r["tokens"] == t), None)
                if t not in tokens or r is None or key not in r:
                    cells.append("")
                    continue
                cells.append(f"{_fmt(r, key)} {'met' if r[key] <= bound else 'MISSED'}")
            print(f"| {name} | {key.replace('_', ' ')} | <= {bound} | " + " | ".join(cells) + " |")


def print_skew(rows_by_table: dict) -> None:
    """Where skewed routing puts the rows, and what the grid's tail costs (both routings, our kernels)."""
    print("\n**Routing and the grid's tail (ours, bf16 activations): stage-1 row blocks at the tier's BM, the "
          "busiest expert, the last round's fill per stage, what balancing the tail would save**\n")
    print("| arch | tokens | BM | blocks uniform / skewed | busiest expert rows (blocks) | top 5 % experts' share "
          "| last-round fill s1 / s2, uniform | skewed | balanced tail saves, uniform / skewed us |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, rows in rows_by_table.items():
        if "bf16-act" not in name:
            continue
        for r in rows:
            u, k = r.get("uniform_routing"), r.get("skewed_routing")
            if not u or "ours_stages" not in r:
                continue
            fill = lambda st: " / ".join(f"{x['last_round_fill']:.2f}" for x in st)  # noqa: E731
            print(f"| {name.split()[0]} | {r['tokens']} | {u['BM']} | {u['blocks']:.0f} / {k['blocks']:.0f} "
                  f"| {k['max_rows']} ({k['max_blocks']}) | {k['top5pct_share']:.2f} | {fill(r['ours_stages'])} "
                  f"| {fill(r['ours_skewed_stages'])} | {r['ours_tail_gain_us']:.1f} / "
                  f"{r['ours_skewed_tail_gain_us']:.1f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", nargs="?", const=str(ROOT / "out" / "flydsl_model" / "model.json"),
                        help="also write everything as JSON (default out/flydsl_model/model.json)")
    parser.add_argument("--aiter-src", default=str(ROOT / ".peer" / "FlyDSL"),
                        help="checkout of FlyDSL's repository holding kernels/moe/moe_2stage_a16wmix")
    parser.add_argument("--rocm", help="ROCm root with llvm/bin/ld.lld (toolchain.py makes a stand-in)")
    parser.add_argument("--python", default=sys.executable, help="interpreter with flydsl for the compiles")
    parser.add_argument("--out", default=str(ROOT / "out" / "flydsl_model"), help="ISA and JSON folder")
    parser.add_argument("--tokens", default=",".join(map(str, TIERS)), help="comma-separated token counts")
    parser.add_argument("--fresh", action="store_true", help="recompile even where an ISA file exists")
    parser.add_argument("--skew-seed", type=int, default=routes.SKEW_SEED,
                        help="seed of the skewed routing's one draw (the tables use the default)")
    parser.add_argument("--reduce", default="auto", choices=("auto", "slots", "fused", "atomic"),
                        help="our top-k sum: the tile table's per-tier choice (auto) or one at every tier")
    args = parser.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
        if any(t < 1 for t in tokens):
            raise ValueError
    except ValueError:
        parser.error(f"--tokens wants positive integers separated by commas, got {args.tokens!r}")
    from kimi_k3_moe.kernels.flydsl.toolchain import rocm_root
    rocm = args.rocm or rocm_root()
    if rocm is None or not (Path(rocm) / "llvm" / "bin" / "ld.lld").exists():
        parser.error(f"no llvm/bin/ld.lld under {rocm or 'any ROCm root'}: pass --rocm DIR "
                     "(python -m kimi_k3_moe.kernels.flydsl.toolchain --shim DIR makes one)")
    try:
        subprocess.run([args.python, "-c", "import flydsl"], check=True, capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError):
        parser.error(f"--python {args.python} cannot import flydsl (pip install 'kimi-k3-moe[flydsl]' there)")
    out = Path(args.out)
    src = Path(args.aiter_src)
    have_peer = (src / "kernels" / "moe" / "moe_2stage_a16wmix" / "gemm1.py").exists()

    from flydsl_model_compile import compile_ours, compile_peer
    from flydsl_model_fit import fit_report, observations, print_fit, sensitivity_params

    ours_cfgs = list(dict.fromkeys(c for arch, act, _, _ in VARIANTS for t in tokens
                                   for c in our_configs(arch, t, args.reduce, act)))
    kernels = compile_ours(ours_cfgs, out / "ours", str(rocm), args.python, args.fresh)
    failed: dict = {}
    if have_peer:
        peer, failed = compile_peer(all_peer_specs(), out / "aiter", src, str(rocm), args.python, args.fresh)
        kernels.update(peer)
    else:
        log(PEER_SRC_HINT.format(src=src))

    report, params, pre_obs = None, FITTED, []
    if have_peer:
        try:
            report = fit_report(kernels)
            params = Params(**report["params"])
            pre_obs = observations(aiter_rows.PRE_RETUNE, kernels)
        except RuntimeError as exc:
            log(f"fit skipped ({exc}); using the earlier constants")
    sets = sensitivity_params(params, pre_obs)
    print_fit(report, params, sets)
    for key, why in failed.items():
        print(f"aiter kernel not compiled: {key}: {why}")
    result = {"params": asdict(params), "fit": report, "aiter_failed": failed, "glue_launch_us": GLUE_LAUNCH_US,
              "sensitivity_params": {k: asdict(p) for k, p in sets.items()}, "sources": aiter_rows.SOURCES,
              "skewed_routing": {"sigma": routes.SKEW_SIGMA, "seed": args.skew_seed,
                                 "generator": "kimi_k3_moe.bench.data"},
              "tables": {}}
    for arch, act, measured, what in VARIANTS:
        rows = comparison(arch, act, measured, tokens, kernels, sets, args.reduce,
                          RoutingModel("skewed", seed=args.skew_seed))
        name = f"{arch} {FORMAT[arch]} {act}-act vs aiter {what}"
        result["tables"][name] = rows
        print_table(f"{isa_model.DEVICES[arch].name} ({name}), K3 TP8 per rank, us; ours and 'aiter model' are "
                    "MODEL figures, 'aiter measured' is aiter's table", rows)
    print_skew(result["tables"])
    print_targets(result["tables"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

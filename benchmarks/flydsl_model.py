"""MODELLED speed of the FlyDSL MoE on MI355X (gfx950, MXFP4) and MI300X (gfx942, int4), beside aiter's kernels.

Nothing here runs on AMD hardware. Every kernel of every token tier is compiled for its arch on
this machine (one process per compile), its ISA is read by kimi_k3_moe.kernels.flydsl.isa_model
(one wave's critical path, occupancy rounds, HBM bytes over eta x peak, plus T0 per launch),
and the model's three constants are fitted on aiter's published gfx950 stage timings at the
K3 TP8 per-rank shape, with aiter's own kernels compiled the same way.

    python benchmarks/flydsl_model.py [--json [FILE]] [--aiter-src DIR] [--rocm DIR]

aiter's kernels: FlyDSL's repository carries a standalone copy (kernels/moe/moe_2stage_a16wmix/,
importing only flydsl and kernels.common); put a checkout at .peer/FlyDSL (ignored by git).
Without it our rows are still printed, with the constants fitted earlier.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kimi_k3_moe.amd_archs import AMD_ARCHS  # noqa: E402
from kimi_k3_moe.kernels.flydsl import isa_model  # noqa: E402
from kimi_k3_moe.kernels.flydsl.isa_model import Launch, Params  # noqa: E402

H, I, E, TOP_K = 3584, 384, 896, 16          # Kimi-K3 routed experts, per rank at TP8
TIERS = (1, 4, 16, 64, 128, 256, 1024, 4096, 16384)
FORMAT = {arch: t.weight_formats[0] for arch, t in AMD_ARCHS.items()}
SCALE_BYTES = {"mxfp4": 1, "int4": 2}          # per 32 weights: e8m0 byte, bf16 group scale
MFMA_K = {arch: t.mfma_k for arch, t in AMD_ARCHS.items()}
# aiter's published a16w4 gfx950 stage timings (stage 1, stage 2; us) at this shape, from its
# tuned K3 table (kimik3_fp4_tuned_fmoe.csv)
PUBLISHED = {1: (15.3, 11.5), 16: (62.3, 41.0), 128: (209.9, 128.5), 1024: (243.1, 164.4),
             16384: (1595.7, 1500.6)}
# constants from the last fit (see docs/FLYDSL.md); used when aiter's source is absent
FITTED = Params(t0_us=1.1, latency_ns=725.0, eta=0.64)
GLUE_LAUNCH_US = 2.5      # a small PyTorch kernel between ours, graph replay (stated, not fitted)
PEER_SRC_HINT = ("aiter's kernels are not at {src}: get FlyDSL's repository (github.com/ROCm/FlyDSL, "
                 "kernels/moe/moe_2stage_a16wmix/ and kernels/common/) into that folder, e.g. "
                 "`git clone --depth 1 https://github.com/ROCm/FlyDSL .peer/FlyDSL`")
CHILD_MEMORY = 12 << 30   # address-space cap of one compile process


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ routing statistics
def distinct_experts(tokens: int) -> float:
    """Expected experts touched by `tokens` tokens each routed to TOP_K distinct experts, uniformly."""
    return E * (1 - (1 - TOP_K / E) ** tokens)


def expected_blocks(tokens: int, bm: int) -> float:
    """Expected BM-row blocks after aligning every expert's rows to BM (all experts together)."""
    n, p = tokens, TOP_K / E
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    lo, hi = max(0, int(mean - 12 * sd) - 1), min(n, int(mean + 12 * sd) + 2)
    total = 0.0
    for c in range(lo, hi + 1):
        logpmf = (math.lgamma(n + 1) - math.lgamma(c + 1) - math.lgamma(n - c + 1)
                  + (c * math.log(p) if c else 0.0) + ((n - c) * math.log1p(-p) if n - c else 0.0))
        total += math.exp(logpmf) * -(-c // bm)
    return E * total


def weight_bytes(weight_format: str, rows: int, cols: int) -> float:
    return rows * cols * (0.5 + SCALE_BYTES[weight_format] / 32)


# ------------------------------------------------------------------ what each side launches
@dataclass(frozen=True)
class PeerSpec:
    """One of aiter's a16w4/a16wi4 kernels (FlyDSL's standalone copy), as its host code picks it."""
    arch: str
    stage: int
    BM: int
    tile_n: int
    tile_k: int
    k_wave: int = 1
    b_cache_mod: int = 0
    xcd: int = 0

    @property
    def key(self) -> str:
        return (f"aiter_s{self.stage}_{self.arch}_bm{self.BM}_tn{self.tile_n}_tk{self.tile_k}_kw{self.k_wave}"
                f"_bcm{self.b_cache_mod}_xcd{self.xcd}")


def peer_specs(arch: str, tokens: int) -> tuple[PeerSpec, PeerSpec]:
    """aiter's tiles at this token count: its tuned gfx950 K3 table (t32x32x256 with K over 2 waves at
    1 token, t32x128x128 from 16 tokens; block 16 up to 512 tokens since aiter PR 5118),
    and for gfx942 int4 its host's defaults (tile_n 128, 64 at BM 64; tile_k 256; a16wi4 block_m rule)."""
    if arch == "gfx950":
        bm = 16 if tokens <= 512 else 32
        if tokens <= 2:
            s1 = PeerSpec(arch, 1, bm, 32, 256, k_wave=2)
        elif tokens < 16:
            s1 = PeerSpec(arch, 1, bm, 128, 256)
        else:
            s1 = PeerSpec(arch, 1, bm, 128, 128, b_cache_mod=2 if tokens <= 1024 else 0, xcd=1)
    else:
        routes_blocks = -(-tokens * TOP_K // (E * 32))
        bm = 64 if routes_blocks == 2 else 32
        s1 = PeerSpec(arch, 1, bm, 64 if bm == 64 else 128, 256, b_cache_mod=2 if 16 <= tokens <= 1024 else 0)
    # stage 2: 4 waves over a 256-column tile; tile_k 128 because I (384) is no multiple of 256
    s2 = PeerSpec(arch, 2, s1.BM, 256, 128, b_cache_mod=0 if (tokens <= 16 or tokens >= 2048) else 2, xcd=1)
    return s1, s2


def our_configs(arch: str, tokens: int, reduce: str = "auto"):
    from kimi_k3_moe.kernels.flydsl import tiles
    from kimi_k3_moe.kernels.flydsl.sweep import K3_SITU
    # as the forward picks them for the engines' routing: int32 ids, no expert map (direct tiers apply)
    return tiles.stage_configs(arch, FORMAT[arch], hidden=H, inter=I, top_k=TOP_K, num_tokens=tokens,
                               activation=K3_SITU, direct_experts=E, table=tiles.default_table(), reduce=reduce)


def mfma_per_wave(arch: str, bm: int, cols: int, k: int, waves: int, int4_tiles: int = 0) -> int:
    """MFMAs one wave issues for a BM x cols x k workgroup tile split over `waves` waves. Our int4
    kernels issue one more MFMA chain per 32-group and row tile (the -136 sum of the activations)
    beside their `int4_tiles` weight tiles per wave."""
    plain = bm * cols * k // (16 * 16 * MFMA_K[arch] * waves)
    return plain * (int4_tiles + 1) // int4_tiles if int4_tiles else plain


def int4_tiles(cfg) -> int:
    """Weight tiles per wave of an int4 kernel (gate and up on stage 1), 0 for MXFP4."""
    return cfg.tile.n_rep * (2 if cfg.stage == 1 else 1) if cfg.weight_format == "int4" else 0


def our_launches(arch: str, tokens: int, kernels: dict, reduce: str = "auto") -> list[Launch]:
    s1, s2 = our_configs(arch, tokens, reduce)
    weight_format = FORMAT[arch]
    if s1.rows.direct:   # one block per (token, slot) pair, each reading its expert's weights
        blocks = d = tokens * TOP_K
    else:
        blocks, d = expected_blocks(tokens, s1.BM), distinct_experts(tokens)
    rows = blocks * s1.BM
    k1, k2 = kernels[s1.name], kernels[s2.name]
    return [
        Launch("stage 1", k1, math.ceil(blocks * (I // s1.BN)),
               d * weight_bytes(weight_format, 2 * I, H) + tokens * H * 2 + rows * I * 2 + rows * 4,
               mfma_per_wave(arch, s1.BM, 2 * s1.BN, H, s1.workgroup_waves, int4_tiles(s1))),
        # stage 2's output: a bf16 row per (token, slot), or fp32 atomic adds into [T, H] counted once
        # (the convention aiter's row uses for its bf16 adds; atomic throughput is not modelled);
        # fused, it reads the slot rows back and writes the bf16 output (token_sum_bytes)
        Launch("stage 2", k2, math.ceil(blocks * (H // s2.BN)),
               d * weight_bytes(weight_format, H, I) + rows * I * 2 + rows * 4
               + (tokens * TOP_K * H * 2 if s2.slot_rows else tokens * H * 4)
               + (token_sum_bytes(s2, tokens) if s2.sums_tokens else 0),
               mfma_per_wave(arch, s2.BM, s2.BN, I // s2.reduction.split_k, s2.workgroup_waves, int4_tiles(s2))),
    ]


def token_sum_bytes(s2, tokens: int) -> int:
    """What a fused stage 2 moves through HBM besides its GEMM: each token's slot rows read back, its
    bf16 output, the slots' local experts and the arrival counters once each (every column tile
    rereads the same few KB from L2; the atomics' own throughput is not modelled)."""
    return tokens * TOP_K * H * 2 + tokens * H * 2 + tokens * TOP_K * 4 + (tokens + 1) * (H // s2.BN) * 4


def peer_launches(arch: str, tokens: int, kernels: dict) -> list[Launch]:
    s1, s2 = peer_specs(arch, tokens)
    weight_format = FORMAT[arch]
    blocks = expected_blocks(tokens, s1.BM)
    rows = blocks * s1.BM
    d = distinct_experts(tokens)
    return [
        Launch("stage 1", kernels[s1.key], math.ceil(blocks * (I // s1.tile_n)),
               d * weight_bytes(weight_format, 2 * I, H) + tokens * H * 2 + rows * I * 2 + rows * 4,
               mfma_per_wave(arch, s1.BM, 2 * s1.tile_n, H, 4)),
        Launch("stage 2", kernels[s2.key], math.ceil(blocks * (H // s2.tile_n)),
               d * weight_bytes(weight_format, H, I) + rows * I * 2 + tokens * H * 2 + rows * 4,
               mfma_per_wave(arch, s2.BM, s2.tile_n, I, 4)),
    ]


# ------------------------------------------------------------------ our forward's other launches
def glue_ops(arch: str, tokens: int, reduce: str = "auto") -> list[tuple[str, int]]:
    """(label, bytes of its tensor arguments) of every launch pipeline.moe_forward makes besides the
    two FlyDSL stages (the Triton alignment and top-k sum), recorded on the meta device (shapes only,
    no memory, nothing run); a PyTorch op that computes would show up too, under its aten name. The
    routing is the engines': int32 ids, no expert map."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from kimi_k3_moe.kernels.flydsl import pipeline
    from kimi_k3_moe.kernels.flydsl.sweep import K3_SITU
    from kimi_k3_moe.kernels.triton import launch as triton_launch
    from kimi_k3_moe.kernels.triton.alignment import counters

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
    run = triton_launch.Launch.__call__
    triton_launch.Launch.__call__ = lambda launch: ops.append((launch.label, size(list(launch.args.values()))))
    try:
        with Record():
            pipeline.moe_forward(Experts(), hidden, weights, ids, K3_SITU, None, arch=arch,
                                 launch=lambda cfg, args: None, reduce=reduce)
    finally:
        triton_launch.Launch.__call__ = run
    return ops


def glue_us(ops, device, params: Params) -> float:
    return sum(GLUE_LAUNCH_US + b / (params.eta * device.peak_tbs * 1e12) * 1e6 for _, b in ops)


def peer_sort_us(tokens: int, device, params: Params) -> float:
    """aiter's one sorting launch, which also zeroes the bf16 output its stage 2 adds into."""
    return GLUE_LAUNCH_US + (tokens * H * 2 + tokens * TOP_K * 8) / (params.eta * device.peak_tbs * 1e12) * 1e6


# ------------------------------------------------------------------ compiling
def _limit_memory():
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))


def compile_ours(configs, out: Path, rocm: str, python: str, fresh: bool) -> dict:
    from kimi_k3_moe.kernels.flydsl.build import compile_in_subprocess

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    found = {}
    for n, cfg in enumerate(configs, 1):
        isa = out / f"{cfg.name}.s"
        if isa.exists() and not fresh:
            log(f"[ours {n}/{len(configs)}] {cfg.name}: reusing {isa.name}")
        else:
            t0 = time.perf_counter()
            result = compile_in_subprocess(cfg, out, rocm=rocm, python=python)
            log(f"[ours {n}/{len(configs)}] {cfg.name}: {result.status} ({time.perf_counter() - t0:.0f} s)")
            if not result.ok:
                log(result.log_tail[-800:])
                continue
        found[cfg.name] = isa_model.parse(isa.read_text(), cfg.name)
    return found


def compile_peer(specs, out: Path, src: Path, rocm: str, python: str, fresh: bool) -> tuple[dict, dict]:
    from kimi_k3_moe.kernels.flydsl.toolchain import compile_env

    found, failed = {}, {}
    for n, spec in enumerate(specs, 1):
        isa = out / f"{spec.key}.s"
        if not (isa.exists() and not fresh):
            t0 = time.perf_counter()
            env = compile_env(spec.arch, rocm=rocm, dump_dir=out / "dump" / spec.key)
            env["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT)])
            try:
                proc = subprocess.run([python, __file__, "--peer-compile", json.dumps(asdict(spec)), "--out",
                                       str(isa)], env=env, capture_output=True, text=True, timeout=900,
                                      preexec_fn=_limit_memory)
                status = "ok" if proc.returncode == 0 and isa.exists() else (
                    "sigabrt" if proc.returncode == -6 else f"failed (rc {proc.returncode})")
                tail = (proc.stdout + proc.stderr)[-600:]
            except subprocess.TimeoutExpired:
                status, tail = "timeout", ""
            log(f"[aiter {n}/{len(specs)}] {spec.key}: {status} ({time.perf_counter() - t0:.0f} s)")
            if status != "ok":
                failed[spec.key] = status + ": " + " ".join(tail.split())[-300:]
                continue
        else:
            log(f"[aiter {n}/{len(specs)}] {spec.key}: reusing {isa.name}")
        found[spec.key] = isa_model.parse(isa.read_text(), spec.key)
    return found, failed


def peer_compile_child(spec: dict, out: str) -> int:
    """In a fresh process with FLYDSL_GPU_ARCH etc. set: build one aiter kernel and copy its ISA dump."""
    import flydsl.expr as fx
    s = PeerSpec(**spec)
    w = FORMAT[s.arch]
    if s.stage == 1:
        from kernels.moe.moe_2stage_a16wmix.gemm1 import compile_gemm1_a16w4_port
        launch = compile_gemm1_a16w4_port(BM=s.BM, D_HIDDEN=H, D_INTER=I, NE=E, TOPK=TOP_K, TILE_N=s.tile_n,
                                          TILE_K=s.tile_k, act="situv2", b_cache_mod=s.b_cache_mod,
                                          xcd_swizzle=s.xcd, w_dtype=w, k_wave=s.k_wave)
        launch(0, 0, 0, 0, 0, 0, 1, 1, 4.0, 0.25, 25.0, 0.04, math.inf, 0, fx.Stream(None))
    else:
        from kernels.moe.moe_2stage_a16wmix.gemm2 import compile_gemm2_a16w4_port
        launch = compile_gemm2_a16w4_port(BM=s.BM, NE=E, N_OUT=H, D_INTER=I, TILE_N=s.tile_n, TILE_K=s.tile_k,
                                          b_cache_mod=s.b_cache_mod, xcd_swizzle=s.xcd, w_dtype=w)
        launch(0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, fx.Stream(None))
    dumps = sorted(Path(os.environ["FLYDSL_DUMP_DIR"]).glob("**/*_final_isa.s"))
    if len(dumps) != 1:
        print(f"expected one ISA dump, found {len(dumps)}", file=sys.stderr)
        return 1
    Path(out).write_text(dumps[0].read_text())
    return 0


# ------------------------------------------------------------------ the model table
def _detail(launch: Launch, t) -> dict:
    return {"kernel": launch.kernel.name, "us": round(t.us, 1), "compute_us": round(t.compute_us, 1),
            "memory_us": round(t.memory_us, 1), "critical_us": round(t.critical_us, 1), "rounds": t.rounds,
            "waves_per_simd": t.waves_per_simd, "workgroups": launch.workgroups,
            "hbm_mb": round(launch.hbm_bytes / 1e6, 2)}


def model_rows(arch: str, tokens_list, ours: dict, peer: dict, params: Params, reduce: str = "auto") -> list[dict]:
    device = isa_model.DEVICES[arch]
    weight_format = FORMAT[arch]
    rows = []
    for t in tokens_list:
        row: dict = {"arch": arch, "device": device.name, "tokens": t}
        configs = our_configs(arch, t, reduce)
        if all(c.name in ours for c in configs):
            launches = our_launches(arch, t, ours, reduce)
            stages = [isa_model.launch_time(x, device, params) for x in launches]
            ops = glue_ops(arch, t, reduce)
            row["reduce"] = configs[1].reduce
            row["ours_stages"] = [_detail(x, s) for x, s in zip(launches, stages)]
            row["ours_glue_ops"] = [name for name, _ in ops]
            row["ours_glue_mb"] = round(sum(b for _, b in ops) / 1e6, 1)
            row["ours_kernels_us"] = round(sum(s.us for s in stages), 1)
            row["ours_launches"] = 2 + len(ops)
            row["ours_all_us"] = round(row["ours_kernels_us"] + glue_us(ops, device, params), 1)
        keys = [s.key for s in peer_specs(arch, t)]
        if all(k in peer for k in keys):
            launches = peer_launches(arch, t, peer)
            stages = [isa_model.launch_time(x, device, params) for x in launches]
            row["aiter_stages"] = [_detail(x, s) for x, s in zip(launches, stages)]
            row["aiter_kernels_us"] = round(sum(s.us for s in stages), 1)
            row["aiter_all_us"] = round(row["aiter_kernels_us"] + peer_sort_us(t, device, params), 1)
        if arch == "gfx950" and t in PUBLISHED:
            row["aiter_published_us"] = round(sum(PUBLISHED[t]), 1)
        if "ours_all_us" in row and "aiter_published_us" in row:
            row["ratio_all_published"] = round(row["ours_all_us"] / row["aiter_published_us"], 2)
        if "ours_all_us" in row and "aiter_all_us" in row:
            row["ratio_kernels"] = round(row["ours_kernels_us"] / row["aiter_kernels_us"], 2)
            row["ratio_all"] = round(row["ours_all_us"] / row["aiter_all_us"], 2)
        if weight_format == "int4":
            floor = distinct_experts(t) * (weight_bytes(weight_format, 2 * I, H) + weight_bytes(weight_format, H, I)) \
                / (0.70 * device.peak_tbs * 1e12) * 1e6
            row["int4_floor_us"] = round(floor, 1)
            if "ours_all_us" in row:
                row["ours_all_over_floor"] = round(row["ours_all_us"] / floor, 2)
        rows.append(row)
    return rows


def fit_on_published(peer: dict) -> tuple[Params, float, list]:
    obs, where = [], []
    for t, pair in PUBLISHED.items():
        if not all(s.key in peer for s in peer_specs("gfx950", t)):
            continue
        for launch, measured in zip(peer_launches("gfx950", t, peer), pair):
            obs.append((launch, isa_model.MI355X, measured))
            where.append((t, launch.label))
    if len(obs) < 4:
        raise RuntimeError(f"only {len(obs)} of aiter's published stage timings have a compiled kernel")
    params, err = isa_model.fit(obs)
    detail = [(t, label, m, round(isa_model.launch_time(x, d, params).us, 1))
              for (x, d, m), (t, label) in zip(obs, where)]
    return params, err, detail


def _cell(row: dict, key: str) -> str:
    v = row.get(key)
    return "n/a" if v is None else (f"{v:.2f}" if "ratio" in key or "over" in key else f"{v:.1f}")


def print_table(rows: list[dict]) -> None:
    arch = rows[0]["arch"]
    cols = [("tokens", "tokens"), ("ours_kernels_us", "ours kernels"), ("ours_all_us", "ours all"),
            ("ours_launches", "launches"), ("aiter_kernels_us", "aiter kernels"), ("aiter_all_us", "aiter all"),
            ("aiter_published_us", "aiter published"), ("ratio_kernels", "ours/aiter kernels"),
            ("ratio_all", "ours/aiter all")]
    if arch == "gfx950":
        cols += [("ratio_all_published", "ours all/aiter published")]
    if arch == "gfx942":
        cols += [("int4_floor_us", "int4 floor"), ("ours_all_over_floor", "ours all/floor")]
    print(f"\n{rows[0]['device']} ({arch}, {FORMAT[arch]}), K3 TP8 per rank, uniform routing, MODEL us")
    print(" | ".join(h for _, h in cols))
    for r in rows:
        print(" | ".join(str(r["tokens"]) if k == "tokens" else
                         (str(r.get(k, "n/a")) if k == "ours_launches" else _cell(r, k)) for k, _ in cols))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", nargs="?", const=str(ROOT / "out" / "flydsl_model" / "model.json"),
                        help="also write the table as JSON (default out/flydsl_model/model.json)")
    parser.add_argument("--aiter-src", default=str(ROOT / ".peer" / "FlyDSL"),
                        help="checkout of FlyDSL's repository holding kernels/moe/moe_2stage_a16wmix")
    parser.add_argument("--rocm", help="ROCm root with llvm/bin/ld.lld (toolchain.py makes a stand-in)")
    parser.add_argument("--python", default=sys.executable, help="interpreter with flydsl for the compiles")
    parser.add_argument("--out", default=str(ROOT / "out" / "flydsl_model"), help="ISA and JSON folder")
    parser.add_argument("--tokens", default=",".join(map(str, TIERS)), help="comma-separated token counts")
    parser.add_argument("--fresh", action="store_true", help="recompile even where an ISA file exists")
    parser.add_argument("--reduce", default="auto", choices=("auto", "slots", "fused", "atomic"),
                        help="our top-k sum: the tile table's per-tier choice (auto) or one at every tier")
    parser.add_argument("--peer-compile", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer_compile:
        return peer_compile_child(json.loads(args.peer_compile), args.out)
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
    (out / "ours").mkdir(parents=True, exist_ok=True)
    (out / "aiter").mkdir(parents=True, exist_ok=True)
    src = Path(args.aiter_src)
    have_peer = (src / "kernels" / "moe" / "moe_2stage_a16wmix" / "gemm1.py").exists()

    archs = ("gfx950", "gfx942")
    ours_cfgs = list(dict.fromkeys(c for a in archs for t in tokens for c in our_configs(a, t, args.reduce)))
    ours = compile_ours(ours_cfgs, out / "ours", str(rocm), args.python, args.fresh)
    peer, failed = {}, {}
    if have_peer:
        fit_tokens = sorted(set(tokens) | set(PUBLISHED))
        specs = list(dict.fromkeys(s for a in archs for t in fit_tokens for s in peer_specs(a, t)))
        peer, failed = compile_peer(specs, out / "aiter", src, str(rocm), args.python, args.fresh)
    else:
        log(PEER_SRC_HINT.format(src=src))

    params, err, detail = FITTED, None, []
    if have_peer:
        try:
            params, err, detail = fit_on_published(peer)
        except RuntimeError as exc:
            log(f"fit skipped ({exc}); using the earlier constants")
    print(f"model constants: T0 {params.t0_us} us, L {params.latency_ns} ns, eta {params.eta}"
          + (f" (fitted now on {len(detail)} aiter gfx950 stage timings, RMS log error {err:.1%})" if err is not None
             else " (from the earlier fit)"))
    for t, stage, measured, modelled in detail:
        print(f"  fit: {t} tokens {stage}: published {measured} us, model {modelled} us")
    for key, why in failed.items():
        print(f"aiter kernel not compiled: {key}: {why}")
    result = {"params": asdict(params), "rms_log_error": err, "fit": detail, "aiter_failed": failed,
              "glue_launch_us": GLUE_LAUNCH_US, "rows": {}}
    for arch in archs:
        rows = model_rows(arch, tokens, ours, peer, params, args.reduce)
        result["rows"][arch] = rows
        print_table(rows)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

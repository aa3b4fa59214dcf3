"""Shared helpers of the GPU scripts: K3 shapes, random experts and routing,
CUDA-graph timing with a cold L2, the two ceilings, parallel precompilation.

Run the scripts from the repository root (`python benchmarks/<script>.py`).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kimi_k3_moe.experts import ExpertWeights  # noqa: E402

K3_TOPK = 16
SHAPES = {  # per-rank MoE shapes of Kimi-K3 (K3_FACTS 1)
    "tp8": dict(num_experts=896, hidden=3584, inter=384),
    "tp16": dict(num_experts=896, hidden=3584, inter=192),
    "tiny": dict(num_experts=8, hidden=256, inter=64),  # CPU dry runs under TRITON_INTERPRET=1
}
L2_FLUSH_BYTES = 256 << 20


def log(*parts) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


def mxfp4_bytes_per_expert(hidden: int, inter: int) -> int:
    """Packed codes plus e8m0 scales of w13 and w2 of one expert."""
    w13 = 2 * inter * (hidden // 2 + hidden // 32)
    w2 = hidden * (inter // 2 + inter // 32)
    return w13 + w2


def random_experts(num_experts: int, hidden: int, inter: int, device, gen: torch.Generator) -> ExpertWeights:
    """Uniformly random e2m1 codes (RMS 2.93) with e8m0 scales drawn around the value that makes
    stage-1 outputs RMS ~4 for unit-variance inputs (so SiLU and SiTUv2 really differ, as on K3)
    and stage-2 weights RMS ~1/sqrt(I)."""
    import math

    def side(n, k, target_rms):
        center = 127 + round(math.log2(target_rms / 2.93))
        packed = torch.randint(0, 256, (num_experts, n, k // 2), dtype=torch.uint8, device=device, generator=gen)
        scale = torch.randint(center - 2, center + 3, (num_experts, n, k // 32), dtype=torch.uint8,
                              device=device, generator=gen)
        return packed, scale
    return ExpertWeights(*side(2 * inter, hidden, 4.0 / math.sqrt(hidden)), *side(hidden, inter, 1.0 / math.sqrt(inter)))


def random_routing(num_tokens: int, num_experts: int, topk: int, device, gen: torch.Generator):
    """Distinct experts per token (uniform), positive weights summing to 1 (like renormalised sigmoid top-k)."""
    scores = torch.rand(num_tokens, num_experts, device=device, generator=gen)
    weights, ids = scores.topk(topk, dim=1)
    weights = weights / weights.sum(1, keepdim=True)
    return weights.float(), ids.to(torch.int32)


def random_hidden(num_tokens: int, hidden: int, device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(num_tokens, hidden, device=device, generator=gen).to(torch.bfloat16)


class ColdL2Timer:
    """Times a callable as a CUDA graph replay, flushing L2 before each replay (median, min)."""

    def __init__(self, device=None):
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device or "cuda")

    def time_graph(self, fn, reps: int = 25, warmup: int = 2) -> dict:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        del graph
        return {"median_us": statistics.median(times), "min_us": min(times), "reps": reps}


def copy_bandwidth_gbps(device="cuda", nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy, bytes read plus written per second (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9


def bf16_matmul_tflops(device="cuda", n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def fp8_matmul_tflops(device="cuda", n: int = 8192, reps: int = 10) -> float | None:
    """e4m3 x e4m3 -> bf16 (torch._scaled_mm, fast accumulation), measured like bf16_matmul_tflops;
    None where torch has no fp8 matmul here."""
    try:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device, dtype=torch.float32)

        def mm():
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
        for _ in range(3):
            mm()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            mm()
        end.record()
        end.synchronize()
        return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3) / 1e12
    except Exception as exc:  # reported by the caller
        log(f"fp8 matmul rate not measured: {type(exc).__name__}: {exc}")
        return None


def moe_flops(num_tokens: int, topk: int, hidden: int, inter: int) -> float:
    return 2.0 * num_tokens * topk * (hidden * 2 * inter + inter * hidden)


def poison_allocator(nbytes: int = 8 << 30) -> None:
    """Fill (then free) a large block so the next allocations start as NaN, not zeros."""
    if not torch.cuda.is_available():
        return
    junk = torch.full((nbytes // 2,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del junk


def write_json(path, data) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


def env_info() -> dict:
    import triton
    if not torch.cuda.is_available():
        return {"gpu": "none (interpreter)", "torch": torch.__version__, "triton": triton.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "cuda": torch.version.cuda}


# ---------------------------------------------------------------- precompile
@dataclass(frozen=True)
class Recipe:
    """Enough to rebuild a launch plan in another process (with empty tensors) and compile it."""

    fmt: str
    num_experts: int
    hidden: int
    inter: int
    num_tokens: int
    topk: int
    act: tuple          # (name, beta, linear_beta)
    config: str         # MoEConfig as JSON
    offsets: bool = False
    expert_map: bool = False
    act_dtype: str = "bf16"   # "fp8": the e4m3-activation kernels (MXFP4 weights)


def _build_plan(recipe: Recipe, device="cuda"):
    from kimi_k3_moe.activation import ActivationSpec
    from kimi_k3_moe.configs.triton_table import MoEConfig
    from kimi_k3_moe.kernels.triton.layout import TritonExperts
    from kimi_k3_moe.kernels.triton.moe import plan_moe
    e, h, i = recipe.num_experts, recipe.hidden, recipe.inter
    sdt = torch.uint8 if recipe.fmt == "mxfp4" else torch.bfloat16

    def side(n, k):
        return (torch.empty(e, n, k // 2, dtype=torch.uint8, device=device),
                torch.empty(e, n, k // 32, dtype=sdt, device=device))
    w13, s13 = side(2 * i, h)
    w2, s2 = side(h, i)
    off = recipe.offsets and recipe.fmt == "int4"
    experts = TritonExperts(recipe.fmt, w13, s13, w2, s2, torch.empty_like(s13) if off else None,
                            torch.empty_like(s2) if off else None)
    t = recipe.num_tokens
    hidden = torch.empty(t, h, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(t, recipe.topk, dtype=torch.int32, device=device)
    weights = torch.empty(t, recipe.topk, dtype=torch.float32, device=device)
    emap = torch.zeros(e, dtype=torch.int32, device=device) if recipe.expert_map else None
    act = ActivationSpec(*recipe.act)
    cfg = MoEConfig.from_json(json.loads(recipe.config))
    if recipe.act_dtype == "fp8":
        from kimi_k3_moe.kernels.triton.aot import meta_fp8_experts
        from kimi_k3_moe.kernels.triton.fp8_moe import plan_moe_fp8
        return plan_moe_fp8(meta_fp8_experts(e, h, i, device), hidden, weights, ids, act, emap,
                            torch.empty_like(hidden), cfg)
    return plan_moe(experts, hidden, weights, ids, act, emap, torch.empty_like(hidden), cfg)


def _warm(recipe: Recipe) -> str:
    try:
        for launch in _build_plan(recipe):
            launch.kernel.warmup(**launch.args, grid=launch.grid, num_warps=launch.num_warps,
                                 num_stages=launch.num_stages)
        return ""
    except Exception as exc:  # reported, and the main process compiles it again itself
        return f"{recipe}: {type(exc).__name__}: {exc}"[:400]


def precompile(recipes, workers: int = 12) -> list[str]:
    """Compile every recipe's kernels in worker processes, filling Triton's disk cache."""
    import multiprocessing as mp
    from dataclasses import replace
    # compiled kernels do not depend on the token count (it is a runtime argument)
    recipes = list(dict.fromkeys(replace(r, num_tokens=64) for r in recipes))
    if not recipes:
        return []
    start = time.time()
    with mp.get_context("spawn").Pool(min(workers, len(recipes))) as pool:
        errors = [e for e in pool.map(_warm, recipes, chunksize=1) if e]
    log(f"precompiled {len(recipes)} plans in {time.time() - start:.1f} s ({len(errors)} errors)")
    for e in errors[:5]:
        log("  precompile error:", e)
    return errors

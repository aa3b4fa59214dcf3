"""Shared helpers of the GPU scripts: K3 shapes, random experts and routing,
CUDA-graph timing with a cold L2 and the two ceilings (all from kimi_k3_moe.bench,
the one implementation `kimi-k3-moe bench/tune` use), parallel precompilation.

Run the scripts from the repository root (`python benchmarks/<script>.py`).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kimi_k3_moe.bench.data import expert_map_for, random_experts, random_hidden, random_routing  # noqa: E402,F401
from kimi_k3_moe.bench.shapes import K3_TOPK  # noqa: E402,F401
from kimi_k3_moe.bench.timing import GraphTimer, copy_bandwidth_gbps, mxfp4_bytes_per_expert  # noqa: E402,F401

SHAPES = {  # per-rank MoE shapes of Kimi-K3 (K3_FACTS 1)
    "tp8": dict(num_experts=896, hidden=3584, inter=384),
    "tp16": dict(num_experts=896, hidden=3584, inter=192),
    # EP16: the rank holds 56 of the 896 experts whole; routing is over all 896, through an expert map
    "ep16": dict(num_experts=56, hidden=3584, inter=3072, routed_experts=896),
    "tiny": dict(num_experts=8, hidden=256, inter=64),  # CPU dry runs under TRITON_INTERPRET=1
}


def log(*parts) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


class ColdL2Timer(GraphTimer):
    """The package's one timing method (kimi_k3_moe.bench.timing) under the scripts' old name."""

    def time_graph(self, fn, reps: int = 25, warmup: int = 2) -> dict:
        self.warmup = warmup
        return self.time(fn, reps)


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

    weight_format: str
    num_experts: int
    hidden: int
    inter: int
    num_tokens: int
    topk: int
    act: tuple          # (name, beta, linear_beta)
    config: str         # MoEConfig as JSON
    offsets: bool = False
    expert_map: bool = False
    map_size: int = 0   # the map's length (the experts routed over); 0: num_experts


def _build_plan(recipe: Recipe, device="cuda"):
    from kimi_k3_moe.activation import ActivationSpec
    from kimi_k3_moe.kernels.triton.layout import TritonExperts
    from kimi_k3_moe.kernels.triton.moe import plan_moe
    from kimi_k3_moe.kernels.triton.table import MoEConfig
    e, h, i = recipe.num_experts, recipe.hidden, recipe.inter
    sdt = torch.uint8 if recipe.weight_format == "mxfp4" else torch.bfloat16

    def side(n, k):
        return (torch.empty(e, n, k // 2, dtype=torch.uint8, device=device),
                torch.empty(e, n, k // 32, dtype=sdt, device=device))
    w13, s13 = side(2 * i, h)
    w2, s2 = side(h, i)
    off = recipe.offsets and recipe.weight_format == "int4"
    # the scales are not read (empty memory): compile what weights with scales up to 2 run
    experts = TritonExperts(recipe.weight_format, w13, s13, w2, s2, torch.empty_like(s13) if off else None,
                            torch.empty_like(s2) if off else None, wide_scales=False)
    t = recipe.num_tokens
    hidden = torch.empty(t, h, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(t, recipe.topk, dtype=torch.int32, device=device)
    weights = torch.empty(t, recipe.topk, dtype=torch.float32, device=device)
    emap = torch.zeros(recipe.map_size or e, dtype=torch.int32, device=device) if recipe.expert_map else None
    act = ActivationSpec(*recipe.act)
    cfg = MoEConfig.from_json(json.loads(recipe.config))
    return plan_moe(experts, hidden, weights, ids, act, emap, torch.empty_like(hidden), cfg)


def _warm(recipe: Recipe) -> str:
    try:
        for launch in _build_plan(recipe):
            launch.kernel.warmup(**launch.args, grid=launch.grid, **launch.options())
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

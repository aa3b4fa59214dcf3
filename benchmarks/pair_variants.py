"""Candidate configs beside the table's, timed in one run (data for the table).

For each token count: the table's config (the baseline) and each candidate, every one a
CUDA-graph replay with L2 flushed before it, median of --reps, with the copy bandwidth of
this run; each candidate's output is compared with the baseline's (relative L2) and
discarded above 1e-2.

    python benchmarks/pair_variants.py [--tokens 16,64,...] [--formats mxfp4,int4] [--out F]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from kimi_k3_moe.configs.triton_table import KernelConfig, MoEConfig


def candidates(base: MoEConfig, tokens: int, hidden: int = 3584, inter: int = 384) -> dict[str, MoEConfig]:
    """One-dot variants of an aligned config at `tokens` (gemv tiers get none), valid for the shape;
    stage-2 K steps that do not divide I (TP16: 192) become 64 wide."""
    out = {}
    for name, cfg in _candidates(base).items():
        if inter % cfg.stage2.block_k:
            cfg = replace(cfg, stage2=replace(cfg.stage2, block_k=64))
        try:
            cfg = cfg.validate(hidden, inter)
        except ValueError:
            continue
        if cfg != base and cfg not in out.values():
            out[name] = cfg
    return out


def _candidates(base: MoEConfig) -> dict[str, MoEConfig]:
    """The table's config with its stage 2 taking several N tiles per program
    (`KernelConfig.n_tiles`: K unrolled, the tile loop pipelined); at 4096+ tokens (stage 2 not
    swapped: the table's 4096+ entries) in pair order, the row block's activations held once as the
    A operand (measured slower there, 2026-12-01; kept as data)."""
    if base.path != "aligned":
        return {}
    s2 = base.stage2
    if not s2.swap:  # 4096+: the not-swapped stage 2 keeps the row block's activations as its A operand
        pairs = replace(s2, pairs=True, interleave=True, block_k=128, num_stages=2)
        return {f"s2-pairs-n{bn}-tiles{n}-k128-s2": replace(base, stage2=replace(pairs, block_n=bn, n_tiles=n))
                for bn, n in ((128, 2), (128, 4), (128, 7), (64, 4), (64, 8))}
    if base.block_m > 64:
        return {}
    out = {f"s2-tiles{n}-k{bk}-s{st}": replace(base, stage2=replace(s2, n_tiles=n, block_k=bk, num_stages=st))
           for n in (4, 8, 14, 28) for bk, st in ((128, 2), (128, 3), (64, 2))}
    if not s2.pairs:  # stage 2 in pair order instead (stage 1 then writes inter in that order)
        pairs = replace(s2, block_n=64, block_k=128, num_stages=3, interleave=True, pairs=True)
        out.update({f"s2-pairs-tiles{n}-k128-s3": replace(base, stage2=replace(pairs, n_tiles=n)) for n in (4, 8, 14)})
    out["s2-n128w8-tiles4-k128-s2"] = replace(base, stage2=replace(s2, block_n=128, num_warps=8, n_tiles=4, block_k=128,
                                                                   num_stages=2))
    return out


def ep_candidates(base: MoEConfig, tokens: int, hidden: int, inter: int) -> dict[str, MoEConfig]:
    """EP: the TP8 table's config at the same token count (under EP16 a local expert gets as many
    rows per token as under TP8: 16/896), and, for few tokens, GEMV tiles narrow enough to give
    the handful of local pairs enough programs."""
    from kimi_k3_moe.configs import triton_table as tt
    out = {}
    tp8 = tt.lookup("nvidia_h200", "mxfp4", 896, hidden, 384, tokens, is_cuda=True,
                    table=tt.load_table("nvidia_h200") or {}).config
    if inter % tp8.stage2.block_k:
        tp8 = replace(tp8, stage2=replace(tp8.stage2, block_k=128))
    out["tp8-table"] = tp8
    if tokens <= 64:
        g = tt.heuristic_config(hidden, inter, 1, is_cuda=True)
        for bn1, bk1 in ((4, 512), (8, 512), (8, 256), (16, 256)):
            for bn2, bk2 in ((8, 256), (16, 128)):
                out[f"gemv-s1n{bn1}k{bk1}-s2n{bn2}k{bk2}"] = replace(
                    g, stage1=KernelConfig(bn1, bk1, 4, 1), stage2=KernelConfig(bn2, bk2, 4, 1))
    valid = {}
    for name, cfg in out.items():
        try:
            valid[name] = cfg.validate(hidden, inter)
        except ValueError:
            pass
    return valid


def main() -> int:
    from _common import (K3_TOPK, ColdL2Timer, Recipe, copy_bandwidth_gbps, env_info, log,
                         mxfp4_bytes_per_expert, precompile, random_experts, random_hidden, random_routing,
                         write_json)
    import torch

    from kimi_k3_moe.activation import ActivationSpec
    from kimi_k3_moe.kernels import get_backend
    from kimi_k3_moe.reference import relative_l2
    from kimi_k3_moe.weights.requant import requantize_experts
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16,64,256,1024,4096,16384")
    ap.add_argument("--shape", default="tp8")
    ap.add_argument("--formats", default="mxfp4")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--out", default="results/pair_variants.json")
    args = ap.parse_args()
    situ = ActivationSpec.situv2(4.0, 25.0)
    from kimi_k3_moe.bench.data import expert_map_for
    from kimi_k3_moe.bench.shapes import parse_shape
    s = parse_shape(args.shape)  # EP shapes: this rank holds held_experts of the num_experts routed over
    e, h, i, routed = s.held_experts, s.hidden, s.inter, s.num_experts
    emap = expert_map_for(routed, e, "cuda") if s.is_ep else None
    variants = ep_candidates if emap is not None else candidates
    info = env_info()
    bw = copy_bandwidth_gbps()
    log(f"copy bandwidth {bw:.0f} GB/s")
    gen = torch.Generator(device="cuda").manual_seed(20261201)
    experts = random_experts(e, h, i, "cuda", gen)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for fmt in args.formats.split(","):
        be = get_backend("triton", weight_format=fmt)
        p = be.prepare(requantize_experts(experts, progress=False) if fmt == "int4" else experts)
        plans = {t: {"table": be.lookup(p, t).config, **variants(be.lookup(p, t).config, t, h, i)} for t in tokens}
        act = (situ.name, situ.beta, situ.linear_beta)
        precompile([Recipe(fmt, e, h, i, t, K3_TOPK, act, json.dumps(c.to_json(), sort_keys=True),
                           expert_map=emap is not None)
                    for t in tokens for c in plans[t].values()])
        timer = ColdL2Timer()
        for t in tokens:
            hidden = random_hidden(t, h, "cuda", gen)
            weights, ids = random_routing(t, routed, K3_TOPK, "cuda", gen, held=e if emap is not None else None)
            held = ids if emap is None else ids[emap[ids.long()] >= 0]
            floor = int(torch.unique(held).numel()) * mxfp4_bytes_per_expert(h, i) / (bw * 1e9) * 1e6
            row = {"fmt": fmt, "tokens": t, "floor_bw_us": floor}
            ref = None
            for name, cfg in plans[t].items():
                out = torch.empty_like(hidden)
                try:
                    b = get_backend("triton", weight_format=fmt, config=cfg)
                    b.forward(p, hidden, weights, ids, situ, emap, out=out)
                    if ref is None:
                        ref = out.clone()
                    err = relative_l2(out.float(), ref.float())
                    if not err < 1e-2:
                        row[f"{name}_error"] = f"rel L2 vs table {err:.3g}"
                        continue
                    row[f"{name}_us"] = timer.time_graph(lambda: b.forward(p, hidden, weights, ids, situ, emap, out=out),
                                                         reps=args.reps)["median_us"]
                except Exception as exc:
                    row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]
            timed = {k[:-3]: v for k, v in row.items() if k.endswith("_us") and k != "floor_bw_us"}
            best = min(timed, key=timed.get)
            row["best"], row["best_us"] = best, timed[best]
            row["best_config"] = plans[t][best].to_json()
            rows.append(row)
            log(f"{fmt} T={t}: floor {floor:.1f} table {row.get('table_us', float('nan')):.1f} "
                f"best {best} {timed[best]:.1f} ({timed[best] / floor:.2f}x floor)")
            write_json(args.out, {"info": info, "copy_bw_GBps": bw, "shape": s.to_json(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

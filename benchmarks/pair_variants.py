"""Candidate one-dot ("pairs") configs beside the table's, timed in one run (data for the table).

For each token count: the table's config (the baseline) and each candidate, every one a
CUDA-graph replay with L2 flushed before it, median of --reps, with the copy bandwidth of
this run; each candidate's output is compared with the baseline's (relative L2) and
discarded above 1e-2. `candidates()` is also what the CPU compile check builds.

    python benchmarks/pair_variants.py [--tokens 16,64,...] [--formats mxfp4,int4] [--out F]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from kimi_k3_moe.configs.triton_table import KernelConfig, MoEConfig


def _stage_sets(block_m: int):
    """(stage-1, stage-2) candidates by block_m: weights as the register operand (swap) up to 64
    rows, where the two stage-1 accumulators still fit next to the decoded tile; 128 rows not."""
    k = KernelConfig
    if block_m <= 32:
        return ({"s1n64k128s3": k(64, 128, 4, 3, pairs=True), "s1n64k256s4": k(64, 256, 4, 4, pairs=True),
                 "s1n64k256s3": k(64, 256, 4, 3, pairs=True)},
                {"s2n64k64s4": k(64, 64, 4, 4, pairs=True), "s2n64k128": k(64, 128, 4, 3, pairs=True),
                 "s2n64k128s2": k(64, 128, 4, 2, pairs=True)})
    if block_m == 64:
        return ({"s1n64k64s4": k(64, 64, 4, 4, pairs=True), "s1n64k128s3": k(64, 128, 4, 3, pairs=True),
                 "s1n64k256s3": k(64, 256, 4, 3, pairs=True)},
                {"s2n128k128w8": k(128, 128, 8, 3, pairs=True), "s2n128k64w8s4": k(128, 64, 8, 4, pairs=True)})
    return ({"s1n64k64w8": k(64, 64, 8, 3, swap=False, pairs=True),
             "s1n64k64w8s4": k(64, 64, 8, 4, swap=False, pairs=True)},
            {"s2n128k64w8": k(128, 64, 8, 3, swap=False, pairs=True),
             "s2n256k64w8": k(256, 64, 8, 3, swap=False, pairs=True)})


def candidates(base: MoEConfig, tokens: int, hidden: int = 3584, inter: int = 384) -> dict[str, MoEConfig]:
    """One-dot variants of an aligned config at `tokens` (gemv tiers get none), valid for the shape;
    stage-2 K steps that do not divide I (TP16: 192) become 64 wide."""
    out = {}
    for name, cfg in _candidates(base, tokens).items():
        if inter % cfg.stage2.block_k:
            cfg = replace(cfg, stage2=replace(cfg.stage2, block_k=64))
        try:
            out[name] = cfg.validate(hidden, inter)
        except ValueError:
            pass
    return out


def _candidates(base: MoEConfig, tokens: int) -> dict[str, MoEConfig]:
    if base.path != "aligned":
        return {}
    bms = [base.block_m]
    if tokens >= 1024:
        bms += [2 * base.block_m] if base.block_m < 64 else []
    out = {}
    if tokens >= 4096:  # one stage on the pair order beside the table's other stage
        for name, s2 in (("s2n128k128w8", KernelConfig(128, 128, 8, 3, pairs=True)),
                         ("s2n64k128", KernelConfig(64, 128, 4, 3, pairs=True))):
            out[f"table-s1-{name}"] = replace(base, stage2=s2)
        out["s1n64k128s3-table-s2"] = replace(base, stage1=KernelConfig(64, 128, 4, 3, pairs=True))
    for bm in dict.fromkeys(bms):
        s1s, s2s = _stage_sets(bm)
        for n1, s1 in s1s.items():
            for n2, s2 in s2s.items():
                out[f"bm{bm}-{n1}-{n2}"] = replace(base, block_m=bm, stage1=s1, stage2=s2)
    return out


def main() -> int:
    from _common import (K3_TOPK, SHAPES, ColdL2Timer, Recipe, copy_bandwidth_gbps, env_info, log,
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
    s = SHAPES[args.shape]
    e, h, i = s["num_experts"], s["hidden"], s["inter"]
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
        plans = {t: {"table": be.lookup(p, t).config, **candidates(be.lookup(p, t).config, t, h, i)} for t in tokens}
        act = (situ.name, situ.beta, situ.linear_beta)
        precompile([Recipe(fmt, e, h, i, t, K3_TOPK, act, json.dumps(c.to_json(), sort_keys=True))
                    for t in tokens for c in plans[t].values()])
        timer = ColdL2Timer()
        for t in tokens:
            hidden = random_hidden(t, h, "cuda", gen)
            weights, ids = random_routing(t, e, K3_TOPK, "cuda", gen)
            floor = int(torch.unique(ids).numel()) * mxfp4_bytes_per_expert(h, i) / (bw * 1e9) * 1e6
            row = {"fmt": fmt, "tokens": t, "floor_bw_us": floor}
            ref = None
            for name, cfg in plans[t].items():
                out = torch.empty_like(hidden)
                try:
                    b = get_backend("triton", weight_format=fmt, config=cfg)
                    b.forward(p, hidden, weights, ids, situ, out=out)
                    if ref is None:
                        ref = out.clone()
                    err = relative_l2(out.float(), ref.float())
                    if not err < 1e-2:
                        row[f"{name}_error"] = f"rel L2 vs table {err:.3g}"
                        continue
                    row[f"{name}_us"] = timer.time_graph(lambda: b.forward(p, hidden, weights, ids, situ, out=out),
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
            write_json(args.out, {"info": info, "copy_bw_GBps": bw, "shape": s, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Candidate configs beside the table's, timed in one run (data for the table).

For each token count: the table's config (the baseline) and each candidate, every one a
CUDA-graph replay with L2 flushed before it, median of --reps, with the copy bandwidth of
this run; each candidate's output is compared with the baseline's (relative L2) and
discarded above 1e-2.

    python benchmarks/pair_variants.py [--tokens 16,64,...] [--formats mxfp4,int4] [--out F]
                                       [--configs F | --stage1-tiles F] [--per-launch]

--per-launch also times the graphs of each config's first i launches (L2 flushed before each), so a
row says what each launch adds, its gap to the one before included.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from kimi_k3_moe.configs.triton_table import KernelConfig, MoEConfig
from kimi_k3_moe.kernels.triton.tuning_space import (PAIRS, PLAIN_INTER, SPLIT_STAGE2_BLOCK_M, STACKED, TAIL_S2_TILES,
                                                      kc)


def candidates(base: MoEConfig, tokens: int, hidden: int = 3584, inter: int = 384) -> dict[str, MoEConfig]:
    """Variants of an aligned config at `tokens`, valid for the shape (a GEMV tier gets the TP8
    table's aligned config at the same count); stage-2 K steps that do not divide I (TP16: 192)
    become 64 wide."""
    fitted = {name: replace(cfg, stage2=replace(cfg.stage2, block_k=64)) if inter % cfg.stage2.block_k else cfg
              for name, cfg in _candidates(base, tokens, hidden).items()}
    return _valid_variants(base, fitted, hidden, inter)


def _valid_variants(base: MoEConfig, variants: dict[str, MoEConfig], hidden: int,
                    inter: int) -> dict[str, MoEConfig]:
    """The variants that validate for the shape, less the base and repeats."""
    out = {}
    for name, cfg in variants.items():
        try:
            cfg = cfg.validate(hidden, inter)
        except ValueError:
            continue
        if cfg != base and cfg not in out.values():
            out[name] = cfg
    return out


def _candidates(base: MoEConfig, tokens: int, hidden: int) -> dict[str, MoEConfig]:
    """The table's config with its stage 2 taking several N tiles per program
    (`KernelConfig.n_tiles`: K unrolled, the tile loop pipelined); at 4096+ tokens stage 1 on row
    blocks of a main and a tail tile (swapped: the tail is a second MMA on the same weights)."""
    if base.path != "aligned":
        return _tp8_aligned(tokens, hidden) if tokens > 1 else {}
    s2 = base.stage2
    if tokens >= 4096:
        return _large_candidates(base, tokens)
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


def _large_candidates(base: MoEConfig, tokens: int) -> dict[str, MoEConfig]:
    """4096+ tokens: the table's entry with each many-tile stage 2 (tuning_space.TAIL_S2_TILES) on the
    entry's stage-1 blocks and on 128-row blocks of its own. (The tiles of which an SM runs two blocks,
    timed on 2026-12-03, are in results/h200-2026-12-03-s2/occupancy_tp8.json; the tail-block and
    wide stage-2 candidates of 2026-12-02 in results/h200-2026-12-02-tails/.)"""
    out = {}
    for t in TAIL_S2_TILES:
        for bm2, where in ((None, "same"), (SPLIT_STAGE2_BLOCK_M, f"b{SPLIT_STAGE2_BLOCK_M}")):
            out[f"s2{_tile_name(t)}-{where}"] = replace(base, stage2=kc(t), stage2_block_m=bm2)
    return out


def _tile_name(t) -> str:
    bn, bk, w, st, order, *tiles = t
    return (f"n{bn}k{bk}w{w}s{st}" + {True: "", False: "words", PAIRS: "pairs", STACKED: "stacked",
                                       PLAIN_INTER: "plain"}[order] + "".join(f"t{n}" for n in tiles))


def stage1_variants(base: MoEConfig, tiles: list, hidden: int, inter: int) -> dict[str, MoEConfig]:
    """The config with each stage-1 tile [block_n, block_k, warps, stages] instead of its own (the
    rest, stage 2 included, kept); tiles invalid for the config are left out."""
    return _valid_variants(base, {
        f"s1n{bn}k{bk}w{w}s{st}": replace(base, stage1=replace(base.stage1, block_n=bn, block_k=bk, num_warps=w,
                                                                num_stages=st))
        for bn, bk, w, st in tiles}, hidden, inter)


def _tp8_aligned(tokens: int, hidden: int) -> dict[str, MoEConfig]:
    """The TP8 MXFP4 table's config at `tokens` when it is an aligned one (TP16's GEMV tiers)."""
    from kimi_k3_moe.configs import triton_table as tt
    tp8 = tt.lookup("nvidia_h200", "mxfp4", 896, hidden, 384, tokens, is_cuda=True,
                    table=tt.load_table("nvidia_h200") or {}).config
    return {"tp8-table": tp8} if tp8.path == "aligned" else {}


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


def launch_times(backend, prepared, hidden, weights, ids, act, emap, out, timer, reps) -> list:
    """[label, us] per launch of one forward: the time of the graph of launches 1..i less that of
    1..i-1 (a launch's own time plus the gap before it; a prefix replays from scratch, as the whole
    forward does: the alignment's counters are cleared by its first launch)."""
    plan = backend.plan(prepared, hidden, weights, ids, act, emap, out)
    rows, before = [], 0.0
    for i, launch in enumerate(plan):
        upto = timer.time_graph(lambda: [f() for f in plan[:i + 1]], reps=reps)["median_us"]
        rows.append([launch.label, round(upto - before, 2)])
        before = upto
    return rows


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
    ap.add_argument("--configs", help="JSON {tokens: {name: MoEConfig json}} timed instead of the generated candidates")
    ap.add_argument("--stage1-tiles", help="JSON {tokens: [[block_n, block_k, warps, stages], ...]}: the table's "
                    "config with each stage-1 tile instead (whatever the table holds when the run starts)")
    ap.add_argument("--per-launch", action="store_true",
                    help="time what each launch of every config adds (prefix graphs)")
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
        if args.configs:
            given = json.load(open(args.configs))
            plans = {t: {"table": be.lookup(p, t).config,
                         **{n: MoEConfig.from_json(c).validate(h, i) for n, c in given.get(str(t), {}).items()}}
                     for t in tokens}
        elif args.stage1_tiles:
            given = json.load(open(args.stage1_tiles))
            plans = {t: {"table": be.lookup(p, t).config,
                         **stage1_variants(be.lookup(p, t).config, given.get(str(t), []), h, i)} for t in tokens}
        else:
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
                    eager = out.clone()
                    row[f"{name}_us"] = timer.time_graph(lambda: b.forward(p, hidden, weights, ids, situ, emap, out=out),
                                                         reps=args.reps)["median_us"]
                    # the last graph replay against the eager run: a race (e.g. a launch reading its
                    # predecessor's output too early) shows as a difference
                    row[f"{name}_replay_bitwise"] = bool(torch.equal(out, eager))
                    if args.per_launch:
                        row[f"{name}_launches"] = launch_times(b, p, hidden, weights, ids, situ, emap, out, timer,
                                                               args.reps)
                except Exception as exc:
                    row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]
            timed = {k[:-3]: v for k, v in row.items() if k.endswith("_us") and k != "floor_bw_us"}
            best = min(timed, key=timed.get)
            row["best"], row["best_us"] = best, timed[best]
            row["best_config"] = plans[t][best].to_json()
            rows.append(row)
            log(f"{fmt} T={t}: floor {floor:.1f} table {row.get('table_us', float('nan')):.1f} "
                f"best {best} {timed[best]:.1f} ({timed[best] / floor:.2f}x floor)")
            for name in sorted(timed, key=timed.get):
                parts = " ".join(f"{label}={us}" for label, us in row.get(f"{name}_launches", []))
                log(f"  {name:40s} {timed[name]:9.1f}  {parts}")
            write_json(args.out, {"info": info, "copy_bw_GBps": bw, "shape": s.to_json(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time the Triton MoE against its floors and against peers, all in one run.

For each token count at K3's TP8 per-rank shape (H 3584, I 384, E 896,
top-16): our forward (SiTUv2, MXFP4 and optionally int4); the bandwidth floor
(MXFP4 bytes of the experts actually touched over the copy bandwidth measured
in this run); the compute floor (FLOPs over the bf16 matmul rate measured in
this run); and peers on the same routing: plain PyTorch with bf16 weights
(`torch._grouped_mm`) and OpenAI's triton_kernels (`matmul_ogs`, vendored in
the vllm wheel; pass its folder with --peer-path, never committed here).
Every time is a CUDA-graph replay with L2 flushed before it, median of --reps.

    python benchmarks/bench_moe.py [--tokens 1,4,16,64,256,1024,4096,16384] [--peer-path .peer]
    python benchmarks/bench_moe.py --act-dtypes bf16,fp8 --peers ""     # fp8 activations beside bf16

With fp8 in --act-dtypes, MXFP4 also runs with e4m3 activations (Hopper); its
compute floor uses the e4m3 matmul rate measured in the same run
(torch._scaled_mm, fast accumulation), and each fp8 row is also given as a
ratio to the bf16 path. --fp8-variants times a few other fp8 tile configs at
large token counts (data for tuning; the default config is what ships).
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback

from _common import (K3_TOPK, SHAPES, ColdL2Timer, Recipe, bf16_matmul_tflops, copy_bandwidth_gbps,
                     env_info, fp8_matmul_tflops, log, moe_flops, mxfp4_bytes_per_expert, precompile,
                     random_experts, random_hidden, random_routing, write_json)

import torch  # noqa: E402

from kimi_k3_moe.activation import ActivationSpec  # noqa: E402
from kimi_k3_moe.kernels import get_backend  # noqa: E402
from kimi_k3_moe.reference import relative_l2  # noqa: E402
from kimi_k3_moe.loading import prepare_for  # noqa: E402

SITU = ActivationSpec.situv2(4.0, 25.0)


# ------------------------------------------------------------------ peers
class TorchGroupedPeer:
    """Plain PyTorch: bf16 weights (dequantised from the same MXFP4), torch._grouped_mm, same SiTUv2."""

    name = "torch_grouped_mm_bf16"

    def __init__(self, experts):
        e = experts.num_experts
        self.w13 = torch.empty(e, 2 * experts.intermediate_size, experts.hidden_size, dtype=torch.bfloat16,
                               device="cuda")
        self.w2 = torch.empty(e, experts.hidden_size, experts.intermediate_size, dtype=torch.bfloat16,
                              device="cuda")
        for i in range(e):
            a, b = experts.dequantize(i)
            self.w13[i], self.w2[i] = a, b
        self.num_experts = e

    def __call__(self, hidden, weights, ids):
        t, k = ids.shape
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=hidden.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        tok = order // k
        x = hidden[tok]
        h = torch._grouped_mm(x, self.w13.transpose(1, 2), offs=offs)
        a = SITU.apply(h)
        y = torch._grouped_mm(a, self.w2.transpose(1, 2), offs=offs)
        y = y.float() * weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros(t, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        out.index_add_(0, tok, y)
        return out.to(hidden.dtype)


class TritonKernelsPeer:
    """OpenAI triton_kernels (v3.5.1 API, as vendored by vllm 0.33.0): routing + two matmul_ogs,
    Hopper MX value/scale layouts, fused swiglu (its only gated activation; a stand-in for SiTUv2)."""

    name = "triton_kernels_matmul_ogs"

    def __init__(self, experts, path):
        sys.path.insert(0, path)
        import triton_kernels.matmul_ogs_details.opt_flags as opt_flags
        import triton_kernels.swiglu
        from triton_kernels.matmul_ogs import FlexCtx, FnSpecs, FusedActivation, PrecisionConfig, matmul_ogs
        from triton_kernels.numerics import InFlexData
        from triton_kernels.routing import routing
        from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
        from triton_kernels.tensor_details import layout
        self.routing, self.matmul_ogs = routing, matmul_ogs
        opt_flags.update_opt_flags_constraints({"split_k": 1})

        def swizzle(packed, scale):
            vl, vo = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
            sl, so = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
            w = convert_layout(wrap_torch_tensor(packed.transpose(-2, -1), dtype=FP4), vl, **vo)
            s = convert_layout(wrap_torch_tensor(scale.transpose(-2, -1)), sl, **so)
            return w, s
        self.w13, s13 = swizzle(experts.w13_packed, experts.w13_scale)
        self.w2, s2 = swizzle(experts.w2_packed, experts.w2_scale)
        self.pc1 = PrecisionConfig(weight_scale=s13, flex_ctx=FlexCtx(rhs_data=InFlexData()))
        self.pc2 = PrecisionConfig(weight_scale=s2, flex_ctx=FlexCtx(rhs_data=InFlexData()))
        self.act = FusedActivation(FnSpecs("swiglu", triton_kernels.swiglu.swiglu_fn, ("alpha", "limit")),
                                   (1.702, 7.0), 2)
        self.num_experts = experts.num_experts

    def route(self, ids):
        """Its own routing kernels on random logits (same token count and top-k as ours)."""
        logits = torch.randn(ids.shape[0], self.num_experts, device="cuda", dtype=torch.bfloat16)
        return self.routing(logits, ids.shape[1])

    def matmuls(self, hidden, routed):
        rdata, gather, scatter = routed
        inter = self.matmul_ogs(hidden, self.w13, None, rdata, gather_indx=gather, precision_config=self.pc1,
                                fused_activation=self.act)
        return self.matmul_ogs(inter, self.w2, None, rdata, scatter_indx=scatter, precision_config=self.pc2,
                               gammas=rdata.gate_scal)


def fp8_variants(cfg):
    """A few other e4m3 tile configs around `cfg` (aligned path only), by name."""
    from dataclasses import replace
    if cfg.path != "aligned":
        return {}
    out = {"s1-one-dot": replace(cfg, stage1=replace(cfg.stage1, interleave=True)),
           "s2-bk128": replace(cfg, stage2=replace(cfg.stage2, block_k=128, interleave=True))}
    if cfg.block_m < 128:
        out["bm-x2"] = replace(cfg, block_m=cfg.block_m * 2)
    if cfg.stage1.block_k < 512:
        out["s1-bk512"] = replace(cfg, stage1=replace(cfg.stage1, block_k=512, num_stages=2))
    return out


# ------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,16,64,256,1024,4096,16384")
    ap.add_argument("--shape", default="tp8", choices=["tp8", "tp16"])
    ap.add_argument("--formats", default="mxfp4,int4")
    ap.add_argument("--peers", default="torch,triton_kernels")
    ap.add_argument("--peer-path", default=".peer")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--out", default="results/bench_moe.json")
    ap.add_argument("--act-dtypes", default="bf16", help="bf16 and/or fp8 (fp8: MXFP4 weights only)")
    ap.add_argument("--fp8-variants", default="", help="token counts at which to time alternative fp8 configs")
    args = ap.parse_args()
    act_dtypes = [a for a in args.act_dtypes.split(",") if a]
    variant_tokens = [int(t) for t in args.fp8_variants.split(",") if t]
    tokens = [int(t) for t in args.tokens.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    peers = [p for p in args.peers.split(",") if p]
    s = SHAPES[args.shape]
    e, h, i = s["num_experts"], s["hidden"], s["inter"]
    info = env_info()
    log("bench_moe", info)
    bw = copy_bandwidth_gbps()
    tflops = bf16_matmul_tflops()
    fp8_tflops = fp8_matmul_tflops() if "fp8" in act_dtypes else None
    log(f"copy bandwidth {bw:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s, fp8 matmul {fp8_tflops} TFLOP/s")
    gen = torch.Generator(device="cuda").manual_seed(4321)
    experts = random_experts(e, h, i, "cuda", gen)
    backends, prepared = {}, {}
    for fmt in formats:
        backends[fmt] = get_backend("triton", weight_format=fmt)
        prepared[fmt] = prepare_for(backends[fmt], experts)
    if "bf16" not in act_dtypes:
        formats = []
    recipes = [Recipe(fmt, e, h, i, t, K3_TOPK, (SITU.name, SITU.beta, SITU.linear_beta),
                      __import__("json").dumps(backends[fmt].lookup(prepared[fmt], t).config.to_json(), sort_keys=True))
               for fmt in formats for t in tokens]
    fp8_be = fp8_p = None
    variants = {}
    if "fp8" in act_dtypes:
        fp8_be = get_backend("triton", weight_format="mxfp4", act_dtype="fp8")
        fp8_p = fp8_be.prepare(experts)
        recipes += [Recipe("mxfp4", e, h, i, t, K3_TOPK, (SITU.name, SITU.beta, SITU.linear_beta),
                           __import__("json").dumps(fp8_be.lookup(fp8_p, t).config.to_json(), sort_keys=True),
                           act_dtype="fp8") for t in tokens]
        for t in variant_tokens:
            variants[t] = fp8_variants(fp8_be.lookup(fp8_p, t).config)
            recipes += [Recipe("mxfp4", e, h, i, t, K3_TOPK, (SITU.name, SITU.beta, SITU.linear_beta),
                               __import__("json").dumps(cfg.to_json(), sort_keys=True), act_dtype="fp8")
                        for cfg in variants[t].values()]
    precompile(recipes, args.workers)
    peer_objs = {}
    for p in peers:
        try:
            peer_objs[p] = TorchGroupedPeer(experts) if p == "torch" else TritonKernelsPeer(experts, args.peer_path)
        except Exception as exc:
            log(f"peer {p} unavailable: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    timer = ColdL2Timer()
    per_expert = mxfp4_bytes_per_expert(h, i)
    rows = []
    for t in tokens:
        hidden = random_hidden(t, h, "cuda", gen)
        weights, ids = random_routing(t, e, K3_TOPK, "cuda", gen)
        distinct = int(torch.unique(ids).numel())
        row = {"tokens": t, "distinct_experts": distinct,
               "floor_bw_us": distinct * per_expert / (bw * 1e9) * 1e6,
               "floor_compute_us": moe_flops(t, K3_TOPK, h, i) / (tflops * 1e12) * 1e6}
        out = torch.empty_like(hidden)
        ours = None
        for fmt in formats:
            be, p = backends[fmt], prepared[fmt]
            try:
                row[f"ours_{fmt}_config"] = be.lookup(p, t).source
                row[f"ours_{fmt}_us"] = timer.time_graph(
                    lambda: be.forward(p, hidden, weights, ids, SITU, out=out), reps=args.reps)["median_us"]
                if fmt == "mxfp4":
                    ours = out.clone()
            except Exception as exc:
                row[f"ours_{fmt}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                traceback.print_exc()
        if fp8_be is not None:
            try:
                row["ours_mxfp4_fp8_config"] = fp8_be.lookup(fp8_p, t).source
                row["ours_mxfp4_fp8_us"] = timer.time_graph(
                    lambda: fp8_be.forward(fp8_p, hidden, weights, ids, SITU, out=out), reps=args.reps)["median_us"]
                if fp8_tflops:
                    row["floor_compute_fp8_us"] = moe_flops(t, K3_TOPK, h, i) / (fp8_tflops * 1e12) * 1e6
                    row["ours_mxfp4_fp8_x_floor_compute_fp8"] = row["ours_mxfp4_fp8_us"] / row["floor_compute_fp8_us"]
                row["ours_mxfp4_fp8_x_floor_bw"] = row["ours_mxfp4_fp8_us"] / row["floor_bw_us"]
                if "ours_mxfp4_us" in row:
                    row["fp8_over_bf16"] = row["ours_mxfp4_fp8_us"] / row["ours_mxfp4_us"]
                if ours is not None:  # e4m3 activations against bf16 ones on the same weights
                    fp8_be.forward(fp8_p, hidden, weights, ids, SITU, out=out)
                    row["fp8_vs_bf16_rel_l2"] = relative_l2(out.float(), ours.float())
            except Exception as exc:
                row["ours_mxfp4_fp8_error"] = f"{type(exc).__name__}: {exc}"[:300]
                traceback.print_exc()
        for name, cfg in variants.get(t, {}).items():
            try:
                be_v = get_backend("triton", weight_format="mxfp4", act_dtype="fp8", config=cfg)
                row[f"fp8_variant_{name}_us"] = timer.time_graph(
                    lambda: be_v.forward(fp8_p, hidden, weights, ids, SITU, out=out), reps=args.reps)["median_us"]
            except Exception as exc:
                row[f"fp8_variant_{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]
        if "torch" in peer_objs:
            try:
                peer = peer_objs["torch"]
                row["torch_us"] = timer.time_graph(lambda: peer(hidden, weights, ids), reps=args.reps)["median_us"]
                if ours is not None:  # same MXFP4 weights, same SiTUv2: a sanity check of both
                    row["torch_vs_ours_rel_l2"] = relative_l2(ours.float(), peer(hidden, weights, ids).float())
            except Exception as exc:
                row["torch_error"] = f"{type(exc).__name__}: {exc}"[:300]
                traceback.print_exc()
        if "triton_kernels" in peer_objs:
            try:
                peer = peer_objs["triton_kernels"]
                routed = peer.route(ids)
                row["tk_excl_routing_us"] = timer.time_graph(lambda: peer.matmuls(hidden, routed),
                                                             reps=args.reps)["median_us"]
                row["tk_incl_routing_us"] = timer.time_graph(lambda: peer.matmuls(hidden, peer.route(ids)),
                                                             reps=args.reps)["median_us"]
            except Exception as exc:
                row["tk_error"] = f"{type(exc).__name__}: {exc}"[:300]
                traceback.print_exc()
        for fmt in formats:
            if f"ours_{fmt}_us" in row:
                row[f"ours_{fmt}_x_floor_bw"] = row[f"ours_{fmt}_us"] / row["floor_bw_us"]
                row[f"ours_{fmt}_x_floor_compute"] = row[f"ours_{fmt}_us"] / row["floor_compute_us"]
        rows.append(row)
        log({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()})
        write_json(args.out, {"info": info, "copy_bw_GBps": bw, "bf16_TFLOPs": tflops,
                              "fp8_TFLOPs": fp8_tflops, "shape": s,
                              "topk": K3_TOPK, "activation": str(SITU), "bytes_per_expert": per_expert,
                              "rows": rows})
    if fp8_be is not None:
        print("\n tokens  ours_bf16  ours_fp8  fp8/bf16  fp8 x cmp-floor(fp8)  fp8 x bw-floor")
        for r in rows:
            print(f"{r['tokens']:>7} {r.get('ours_mxfp4_us', float('nan')):>10.1f} "
                  f"{r.get('ours_mxfp4_fp8_us', float('nan')):>9.1f} {r.get('fp8_over_bf16', float('nan')):>9.2f} "
                  f"{r.get('ours_mxfp4_fp8_x_floor_compute_fp8', float('nan')):>21.2f} "
                  f"{r.get('ours_mxfp4_fp8_x_floor_bw', float('nan')):>14.2f}")
    print("\n tokens  floor_bw  floor_cmp   ours_mx  x_floor    torch  tk_excl  tk_incl")
    for r in rows:
        print(f"{r['tokens']:>7} {r['floor_bw_us']:>9.1f} {r['floor_compute_us']:>10.1f} "
              f"{r.get('ours_mxfp4_us', float('nan')):>9.1f} {r.get('ours_mxfp4_x_floor_bw', float('nan')):>8.2f} "
              f"{r.get('torch_us', float('nan')):>8.1f} {r.get('tk_excl_routing_us', float('nan')):>8.1f} "
              f"{r.get('tk_incl_routing_us', float('nan')):>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

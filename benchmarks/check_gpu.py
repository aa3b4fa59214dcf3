"""Correctness of the Triton backend on a GPU, against the float64 reference.

At K3's TP8 per-rank shape (H 3584, I 384, E 896, top-16; or `--shape tp16`, or `ep16`: 56
experts of 896 held, the per-count and graph checks through the expert map), for each token
count: fresh random weights, routing and activations; the output tensor (and
the allocator's free memory) poisoned with NaN before every run; relative L2
error against the float64 reference over the weights the prepared form
encodes; MXFP4 and int4; SiLU and SiTUv2 (and their results must differ);
every path (table/heuristic choice, forced small-batch and aligned paths) and
both decoders (PTX, portable bits); each token count under every `--routing`
(default uniform and skewed: a fixed per-expert popularity, as real routers have,
which puts many rows on a few experts); plus expert parallelism (expert_map),
int4 with per-group offsets, repeatability and CUDA-graph replay.

    python benchmarks/check_gpu.py [--tokens 1,3,16,64,257,1024,4096] [--routing uniform,skewed] \
        [--out results/check.json]
    compute-sanitizer --tool memcheck python benchmarks/check_gpu.py --sanitize [--shape tp8]

--sanitize runs only the bad expert id cases (benchmarks/bad_ids.py: ids E, -1, 10**6
and int64 ids, MXFP4 and int4, every path, with and without an expert map), one line
each; under compute-sanitizer, memcheck must report no errors.

Exit status 1 when any check fails. Needs a CUDA/ROCm GPU with ~40 GB free.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import replace

import torch  # noqa: E402
from _common import (
    SHAPES,
    Recipe,
    env_info,
    expert_map_for,
    log,
    poison_allocator,
    precompile,
    random_experts,
    random_hidden,
    random_routing,
    write_json,
)

from kimi_k3_moe.activation import ActivationSpec  # noqa: E402
from kimi_k3_moe.bench.data import RoutingSource  # noqa: E402
from kimi_k3_moe.bench.routing import ROUTINGS, routings_arg  # noqa: E402
from kimi_k3_moe.experts import Int4Experts, Mxfp4Experts  # noqa: E402
from kimi_k3_moe.formats.bf16 import round_once  # noqa: E402
from kimi_k3_moe.formats.int4 import Int4Weights  # noqa: E402
from kimi_k3_moe.kernels import get_backend  # noqa: E402
from kimi_k3_moe.kernels.triton.probe import decode_rows  # noqa: E402
from kimi_k3_moe.kernels.triton.table import KernelConfig, KOrder, MoEConfig, heuristic_config  # noqa: E402
from kimi_k3_moe.reference import dense_moe, relative_l2  # noqa: E402
from kimi_k3_moe.weights.requant import requantize_experts  # noqa: E402

TOLERANCE = 1e-2
# the tensor-core stage 1 over K parts (path split; direct with k_split), checked whatever the table picks
SPLIT_STAGE1 = KernelConfig(32, 256, 4, 3, order=KOrder.STACKED, k_split=7)


def split_configs(h, i, is_cuda):
    """(label, MoEConfig) of the split stage 1 on both stage 2s (gemv's, the direct path's)."""
    gemv = heuristic_config(h, i, 1, is_cuda=is_cuda)
    k_split = 7 if h % (7 * 256) == 0 else 1
    s1 = replace(SPLIT_STAGE1, k_split=k_split, block_k=256 if k_split > 1 else 128)
    direct = MoEConfig("direct", 16, s1, KernelConfig(64, 128 if i % 128 == 0 else 64, 4, 3, order=KOrder.PAIRS),
                       gemv.decode, pdl=is_cuda)
    return [("split", replace(gemv, path="split", stage1=s1, pdl=is_cuda)), ("direct-split", direct)]
MIN_ACT_DIFFERENCE = 5e-2  # SiLU vs SiTUv2 outputs must differ by more than this (relative L2)
SILU = ActivationSpec.silu()
SITU = ActivationSpec.situv2(4.0, 25.0)


class Checker:
    def __init__(self, path, header):
        self.rows = []
        self.failures = []
        self.path, self.header = path, header

    def record(self, ok: bool, **row):
        row["ok"] = bool(ok)
        self.rows.append(row)
        if not ok:
            self.failures.append(row)
        write_json(self.path, {**self.header, "rows": self.rows, "failures": len(self.failures)})
        log(("PASS" if ok else "FAIL"), {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items()
                                         if k != "ok"})


def dequantized_cache(backend, prepared, dtype):
    """Every expert's float weights (what the prepared form encodes), built in chunks on the GPU."""
    w13 = torch.empty(prepared.num_experts, 2 * prepared.intermediate_size, prepared.hidden_size,
                      dtype=dtype, device=prepared.device)
    w2 = torch.empty(prepared.num_experts, prepared.hidden_size, prepared.intermediate_size,
                     dtype=dtype, device=prepared.device)
    for e in range(prepared.num_experts):
        a, b = backend.dequantize_prepared(prepared, e)
        w13[e], w2[e] = a, b
    return w13, w2


def reference(cache, hidden, weights, ids, act, expert_map=None):
    w13, w2 = cache
    return dense_moe(hidden.double(), lambda e: w13[e].double(), lambda e: w2[e].double(), weights, ids,
                     act, expert_map, compute_dtype=torch.float64)


def run_once(backend, prepared, hidden, weights, ids, act, expert_map=None):
    poison_allocator()
    out = torch.full_like(hidden, float("nan"))
    backend.forward(prepared, hidden, weights, ids, act, expert_map, out=out)
    if out.is_cuda:
        torch.cuda.synchronize()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,3,16,64,257,1024,4096")
    ap.add_argument("--shape", default="tp8", choices=sorted(SHAPES))
    ap.add_argument("--out", default="results/check_gpu.json")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--routing", type=routings_arg, default=routings_arg("uniform,skewed"),
                    help=f"comma list of {ROUTINGS}: the per-count MoE checks run under each")
    ap.add_argument("--sections", default="bf16,align,validate",
                    help="comma list: bf16 (MXFP4 and int4, bf16 activations, every path), align (the alignment "
                         "replayed over fresh routing against a PyTorch count), int4-methods (int4 conversions "
                         "--int4-methods), validate (load-time scale scan on the GPU: NaN/overflow bytes refused, "
                         "its cost)")
    ap.add_argument("--int4-methods", default="search,asym")
    ap.add_argument("--int4-tokens", default="3,64,1024")
    ap.add_argument("--sanitize", action="store_true",
                    help="only the bad expert id cases (benchmarks/bad_ids.py), for compute-sanitizer memcheck; "
                         "one line per case, exit 1 if any fails")
    ap.add_argument("--sanitize-tokens", default="1,3,64,300",
                    help="token counts of --sanitize (default: gemv and direct paths, one- and two-launch alignment)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    topk = args.topk
    tokens = [int(t) for t in args.tokens.split(",")]
    shape = SHAPES[args.shape]
    e, h, i = shape["num_experts"], shape["hidden"], shape["inter"]
    info = env_info()
    log("check_gpu", info, "seed", args.seed)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    if args.sanitize:
        from bad_ids import run_cases
        failed = run_cases(dev, gen, e, h, i, topk, [int(t) for t in args.sanitize_tokens.split(",")], say=log)
        log(f"sanitize: {failed} case(s) failed (seed {args.seed})")
        return 1 if failed else 0
    chk = Checker(args.out, {"info": info, "seed": args.seed, "tolerance": TOLERANCE, "shape": shape})

    sections = set(args.sections.split(","))
    # an expert-parallel shape: the router picks among routed_experts, this rank holds the first e
    routed = shape.get("routed_experts", e)
    ep_map = expert_map_for(routed, e, dev) if routed != e else None
    if "bf16" in sections and not bf16_checks(chk, args, dev, gen, e, h, i, topk, tokens, ep_map):
        return 1
    if "align" in sections:
        alignment_checks(chk, dev, gen, e, topk, tokens, ep_map)
    if "validate" in sections:
        validation_checks(chk, dev, gen, e, h, i)
    if "int4-methods" in sections:
        int4_method_checks(chk, dev, gen, e, h, i, topk, [int(t) for t in args.int4_tokens.split(",")],
                           args.int4_methods.split(","), args.workers)
    log(f"{len(chk.rows) - len(chk.failures)}/{len(chk.rows)} checks passed; results in {args.out}")
    return 1 if chk.failures else 0


def json_dumps(obj) -> str:
    import json
    return json.dumps(obj, sort_keys=True)



def bf16_checks(chk, args, dev, gen, e, h, i, topk, tokens, ep_map) -> bool:
    """The bf16-activation checks (MXFP4 and int4, every path and decoder); False when unavailable.
    With an expert-parallel map `ep_map` (this rank holds its first e of the routed experts) the
    per-count checks and the graph check go through it."""
    routed = e if ep_map is None else ep_map.numel()
    held = e if ep_map is not None else None  # at least one pair on this rank: none would check nothing
    experts = random_experts(e, h, i, dev, gen)
    backends = {"mxfp4": get_backend("triton", weight_format="mxfp4"),
                "int4": get_backend("triton", weight_format="int4")}
    ok, why = backends["mxfp4"].available()
    log("available:", ok, why)
    if not ok:
        return False
    prepared = {"mxfp4": backends["mxfp4"].prepare(experts)}
    converted = requantize_experts(experts, progress=False)
    prepared["int4"] = backends["int4"].prepare(converted)  # the pre-converted Int4Experts route
    offsets = Int4Experts(
        Int4Weights(converted.w13.packed, converted.w13.scales, "asym",
                    (torch.randn(converted.w13.scales.shape, device=dev, generator=gen) * 0.01).bfloat16()),
        Int4Weights(converted.w2.packed, converted.w2.scales, "asym",
                    (torch.randn(converted.w2.scales.shape, device=dev, generator=gen) * 0.01).bfloat16()))
    # random offsets on the search codes: a layout test, labelled "asym" since the
    # backend takes pre-converted experts of its own method only
    prepared["int4+offsets"] = get_backend("triton", weight_format="int4", int4_method="asym").prepare(offsets)
    del converted, offsets
    # one e8m0 byte above MXFP4_FOLD_MAX_SCALE sends the whole layer to the two-multiply PTX decoder
    wide_scale = experts.w13_scale.clone()
    wide_scale[0, 0, 0] = 140
    prepared["mxfp4-wide"] = backends["mxfp4"].prepare(
        Mxfp4Experts(experts.w13_packed, wide_scale, experts.w2_packed, experts.w2_scale))
    chk.record(prepared["mxfp4-wide"].wide_scales and not prepared["mxfp4"].wide_scales, check="wide_scales")
    log("prepared", {k: f"{v.nbytes / 1e9:.2f} GB" for k, v in prepared.items()})

    # Decoders alone: every element of a few rows, bit for bit.
    for weight_format, p in prepared.items():
        real_fmt = "mxfp4" if weight_format.startswith("mxfp4") else "int4"
        for decode in (("ptx", "bits") if dev == "cuda" else ("bits",)):
            for ex in (0, e // 2 + 1):
                rows = slice(0, min(256, p.w13.shape[1]))
                got = decode_rows(p.w13[ex, rows], p.w13_scale[ex, rows],
                                  None if p.w13_offset is None else p.w13_offset[ex, rows], real_fmt, decode,
                                  block_k=128, wide_scales=p.wide_scales)
                exact = p.dequantize(ex, torch.float64)[0][rows]
                # the kernels feed bf16 to the dot: the PTX decoders round q * s (+ o) once (a bf16x2
                # FMA), the portable one rounds it to fp32, then to bf16 (the same unless offsets)
                want_bf16 = (round_once(exact) if decode == "ptx" else exact.float().bfloat16()).float()
                bad = int((got != want_bf16).sum())
                chk.record(bad == 0, check="decode", weight_format=weight_format, decode=decode, expert=ex,
                           mismatches=bad, max_abs=float((got.double() - exact).abs().max()))

    caches = {"mxfp4": dequantized_cache(backends["mxfp4"], prepared["mxfp4"], torch.bfloat16),
              "int4": dequantized_cache(backends["int4"], prepared["int4"], torch.float32)}
    log("dequantized caches ready")

    def variants(t):
        """(label, backend options) to run at t tokens."""
        out = [("default", {})]
        if dev == "cuda" and t in (3, 257):
            out.append(("default/bits", {"decode": "bits"}))
        if t <= 3:
            out.append(("aligned-bm16", {"config": replace(heuristic_config(h, i, 64, is_cuda=dev == "cuda"),
                                                           block_m=16)}))
        if t <= 16:
            out.append(("gemv", {"config": heuristic_config(h, i, 1, is_cuda=dev == "cuda")}))
            out.extend((label, {"config": cfg}) for label, cfg in split_configs(h, i, dev == "cuda"))
        if t in (16, 257):
            base = heuristic_config(h, i, t, is_cuda=dev == "cuda")
            if base.path == "aligned" and base.stage1.block_k >= 128 and base.stage2.block_k >= 128:
                out.append(("aligned-worddots", {"config": replace(
                    base, stage1=replace(base.stage1, order=KOrder.WORDS),
                    stage2=replace(base.stage2, order=KOrder.WORDS))}))
        return out

    # Compile everything first, in parallel worker processes.
    recipes = []
    for t in tokens:
        for weight_format in ("mxfp4", "int4"):
            for _label, opts in variants(t):
                be = get_backend("triton", weight_format=weight_format, **opts)
                cfg = be.lookup(prepared[weight_format], t).config
                for act in (SILU, SITU):
                    recipes.append(Recipe(weight_format, e, h, i, t, topk, (act.name, act.beta, act.linear_beta),
                                          json_dumps(cfg.to_json()), expert_map=ep_map is not None, map_size=routed))
    recipes.append(Recipe("int4", e, h, i, 64, topk, ("situv2", 4.0, 25.0),
                          json_dumps(get_backend("triton", weight_format="int4").lookup(prepared["int4"], 64)
                                     .config.to_json()), offsets=True))
    recipes.append(Recipe("mxfp4", e, h, i, 64, topk, ("situv2", 4.0, 25.0),
                          json_dumps(get_backend("triton").lookup(prepared["mxfp4"], 64).config.to_json()),
                          expert_map=True))
    if dev == "cuda":
        precompile(recipes, args.workers)

    sources = [RoutingSource(r, routed, topk, dev, gen) for r in args.routing]
    for t, source in ((t, s) for t in tokens for s in sources):
        routing = str(source.routing)
        hidden = random_hidden(t, h, dev, gen)
        weights, ids = source(t, held=held)
        for weight_format in ("mxfp4", "int4"):
            outs = {}
            for act in (SILU, SITU):
                ref = reference(caches[weight_format], hidden, weights, ids, act, ep_map)
                for label, opts in variants(t):
                    be = get_backend("triton", weight_format=weight_format, **opts)
                    config = be.lookup(prepared[weight_format], t).source
                    try:
                        out = run_once(be, prepared[weight_format], hidden, weights, ids, act, ep_map)
                        err = relative_l2(out.float(), ref)
                        finite = bool(torch.isfinite(out).all())
                        chk.record(finite and err <= TOLERANCE, check="moe", tokens=t, routing=routing,
                                   weight_format=weight_format, act=act.name, variant=label, rel_l2=err, finite=finite,
                                   config=config)
                        outs[(act.name, label)] = out
                        if label in ("default", "split", "direct-split"):
                            again = run_once(be, prepared[weight_format], hidden, weights, ids, act, ep_map)
                            chk.record(torch.equal(again, out), check="repeatable", tokens=t, routing=routing,
                                       weight_format=weight_format, act=act.name)
                    except Exception as exc:
                        chk.record(False, check="moe", tokens=t, routing=routing, weight_format=weight_format,
                                   act=act.name, variant=label, error=f"{type(exc).__name__}: {exc}"[:300])
                        traceback.print_exc()
            for label, _ in variants(t):
                a, b = outs.get(("silu", label)), outs.get(("situv2", label))
                if a is not None and b is not None:
                    diff = relative_l2(a.float(), b.float())
                    chk.record(diff > MIN_ACT_DIFFERENCE, check="silu!=situ", tokens=t, routing=routing,
                               weight_format=weight_format, variant=label, rel_diff=diff)

    # Expert parallelism: odd experts live on another rank (3 tokens: the table's small-batch path;
    # 16 tokens and "aligned" at 3: the one-launch alignment; 64: the two-launch one).
    emap = torch.arange(e, device=dev, dtype=torch.int32)
    emap[1::2] = -1
    for t, label, opts in ((3, "default", {}), (16, "default", {}), (64, "default", {}),
                           (3, "aligned", {"config": heuristic_config(h, i, 64, is_cuda=dev == "cuda")}),
                           (64, "gemv", {"config": heuristic_config(h, i, 1, is_cuda=dev == "cuda")}),
                           *((t, label, {"config": cfg}) for t in (3, 16)
                             for label, cfg in split_configs(h, i, dev == "cuda"))):
        hidden = random_hidden(t, h, dev, gen)
        weights, ids = random_routing(t, e, topk, dev, gen)
        be = get_backend("triton", **opts)
        ref = reference(caches["mxfp4"], hidden, weights, ids, SITU, emap)
        out = run_once(be, prepared["mxfp4"], hidden, weights, ids, SITU, emap)
        chk.record(relative_l2(out.float(), ref) <= TOLERANCE, check="expert_map", tokens=t, variant=label,
                   rel_l2=relative_l2(out.float(), ref), config=be.lookup(prepared["mxfp4"], t).source)

    # MXFP4 with a scale above 2: the two-multiply decoder through every path of the table.
    p = prepared["mxfp4-wide"]
    cache = dequantized_cache(backends["mxfp4"], p, torch.bfloat16)
    for t in (3, 64, 1024):
        hidden = random_hidden(t, h, dev, gen)
        weights, ids = random_routing(t, e, topk, dev, gen)
        ref = reference(cache, hidden, weights, ids, SITU)
        out = run_once(backends["mxfp4"], p, hidden, weights, ids, SITU)
        chk.record(relative_l2(out.float(), ref) <= TOLERANCE, check="mxfp4-wide-scales", tokens=t,
                   rel_l2=relative_l2(out.float(), ref))
    del cache

    # int4 with per-group offsets (asymmetric conversions).
    p = prepared["int4+offsets"]
    cache = dequantized_cache(backends["int4"], p, torch.float32)
    for t, label, opts in ((3, "gemv", {"config": heuristic_config(h, i, 1, is_cuda=dev == "cuda")}),
                           (64, "default", {}),
                           *((3, label, {"config": cfg}) for label, cfg in split_configs(h, i, dev == "cuda"))):
        hidden = random_hidden(t, h, dev, gen)
        weights, ids = random_routing(t, e, topk, dev, gen)
        be = get_backend("triton", weight_format="int4", **opts)
        ref = reference(cache, hidden, weights, ids, SITU)
        out = run_once(be, p, hidden, weights, ids, SITU)
        chk.record(relative_l2(out.float(), ref) <= TOLERANCE, check="int4+offsets", tokens=t, variant=label,
                   rel_l2=relative_l2(out.float(), ref))
    del cache

    # CUDA graph capture and replay give the eager result (1-16 tokens: programmatic dependent launch).
    graph_runs = [(t, "default", backends["mxfp4"]) for t in (1, 3, 16, 257)]
    graph_runs += [(t, label, get_backend("triton", config=cfg)) for t in (1, 16)
                   for label, cfg in split_configs(h, i, True)]
    for t, label, be in (graph_runs if dev == "cuda" else ()):
        hidden = random_hidden(t, h, dev, gen)
        weights, ids = random_routing(t, routed, topk, dev, gen, held=held)
        eager = run_once(be, prepared["mxfp4"], hidden, weights, ids, SITU, ep_map)
        out = torch.full_like(hidden, float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            be.forward(prepared["mxfp4"], hidden, weights, ids, SITU, ep_map, out=out)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        chk.record(torch.equal(out, eager), check="cuda_graph", tokens=t, variant=label)

    return True


def alignment_checks(chk, dev, gen, e, topk, tokens, emap, replays: int = 30) -> None:
    """The alignment alone (both block sizes of a split stage 2), eager and as a graph replayed over
    fresh uniform and skewed routing, against a PyTorch count of every expert's rows; above 256 pairs
    its counters must be zero again after every run (they persist between forwards)."""
    from kimi_k3_moe.kernels.common import alignment
    routed = e if emap is None else emap.numel()
    for t in tokens:
        for skew in (0.0, 2.0):
            bias = torch.randn(routed, device=dev, generator=gen) * skew if skew else None

            def fresh_ids(t=t, bias=bias):
                return random_routing(t, routed, topk, dev, gen, bias=bias)[1]
            ids = fresh_ids()
            aligned, launches = alignment.align_launches(ids, emap, e, (16, 64))
            graph = None
            if dev == "cuda":
                for launch in launches:  # compiled outside the capture
                    launch()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for launch in launches:
                        launch()
            counters = alignment.counters(ids.device, e) if ids.numel() > alignment.SMALL_PAIRS else None
            bad = dirty = 0
            for rep in range(replays):
                ids.copy_(fresh_ids())
                if graph is not None and rep % 2:
                    graph.replay()
                else:
                    for launch in launches:
                        launch()
                local = ids.reshape(-1).long() if emap is None else emap[ids.reshape(-1).long()].long()
                bad += sum(alignment.misplaced(x, local) is not None for x in aligned)
                dirty += int(counters is not None and bool(counters.any()))
            chk.record(bad == 0 and dirty == 0, check="alignment", tokens=t, skew=skew, runs=replays, wrong=bad,
                       counters_left_dirty=dirty)


def int4_method_checks(chk, dev, gen, e, h, i, topk, tokens, methods, workers) -> None:
    """int4 conversions by method (search: signed scales; asym: per-group offsets) through the Triton
    int4 kernels (bf16 activations), against the float64 reference over the converted weights."""
    from kimi_k3_moe.formats import int4 as int4_format
    experts = random_experts(e, h, i, dev, gen)
    for method in methods:
        start = time.time()
        converted = requantize_experts(experts, method=method, progress=False)
        seconds = time.time() - start
        neg = int((converted.w13.scales.float() < 0).sum()) + int((converted.w2.scales.float() < 0).sum())
        be = get_backend("triton", weight_format="int4", int4_method=method)
        p = be.prepare(converted)
        log(f"int4 {method}: converted in {seconds:.1f} s, negative scales {neg}, offsets {p.has_offsets}")
        del converted
        cache = dequantized_cache(be, p, torch.float32)
        recipes = [Recipe("int4", e, h, i, t, topk, ("situv2", 4.0, 25.0), json_dumps(be.lookup(p, t).config.to_json()),
                          offsets=p.has_offsets) for t in tokens]
        recipes += [Recipe("int4", e, h, i, tokens[0], topk, ("silu", None, None),
                           json_dumps(be.lookup(p, tokens[0]).config.to_json()), offsets=p.has_offsets)]
        if dev == "cuda":
            precompile(recipes, workers)
        for t in tokens:
            hidden = random_hidden(t, h, dev, gen)
            weights, ids = random_routing(t, e, topk, dev, gen)
            outs = {}
            for act in ((SITU, SILU) if t == tokens[0] else (SITU,)):
                try:
                    out = outs[act.name] = run_once(be, p, hidden, weights, ids, act)
                    err = relative_l2(out.float(), reference(cache, hidden, weights, ids, act))
                    chk.record(bool(torch.isfinite(out).all()) and err <= TOLERANCE, check="int4.method", method=method,
                               tokens=t, act=act.name, rel_l2=err, negative_scales=neg, offsets=p.has_offsets,
                               convert_s=seconds, config=be.lookup(p, t).source)
                except Exception as exc:
                    chk.record(False, check="int4.method", method=method, tokens=t, act=act.name,
                               error=f"{type(exc).__name__}: {exc}"[:300])
                    traceback.print_exc()
            if len(outs) == 2:
                diff = relative_l2(outs["silu"].float(), outs["situv2"].float())
                chk.record(diff > MIN_ACT_DIFFERENCE, check="int4.silu!=situ", method=method, tokens=t, rel_diff=diff)
        if method in int4_format.METHODS:
            del cache, p



def validation_checks(chk, dev, gen, e, h, i) -> None:
    """The load-time scan (weights.validate) on the GPU: clean experts pass, a NaN byte and an overflowing
    byte are refused before the Triton backend sees them, and the scan's cost next to a layer copy."""
    from kimi_k3_moe.dispatch import plan_backends
    from kimi_k3_moe.platform import detect_platform
    from kimi_k3_moe.routed_experts import RoutedExperts
    from kimi_k3_moe.weights.validate import MAX_SCALE_BYTE, WeightValidationError, find_problems

    experts = random_experts(e, h, i, dev, gen)
    find_problems(experts)  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        problems = find_problems(experts, layer="clean")
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    copy = [t.clone() for t in experts.tensors()]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for t, c in zip(experts.tensors(), copy):
        c.copy_(t)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - start
    scan_s = sorted(times)[len(times) // 2]
    chk.record(problems == [], check="validate clean experts", scan_ms=scan_s * 1e3, layer_copy_ms=copy_s * 1e3,
               scan_over_copy=scan_s / copy_s, mib=experts.nbytes / 2**20)
    platform = detect_platform()
    for name, poke in (("NaN 0xFF", lambda x: x.w13_scale.__setitem__((e // 3, i + 5, 1), 0xFF)),
                       ("overflow", lambda x: x.w2_scale.__setitem__((e // 2, 7, 0), MAX_SCALE_BYTE + 1))):
        bad = experts.select(slice(None))
        bad = type(bad)(*(t.clone() for t in bad.tensors()))
        poke(bad)
        if name == "overflow":
            bad.w2_packed[e // 2, 7, :16] = 0x77
        expert = e // 3 if name.startswith("NaN") else e // 2
        try:
            RoutedExperts(SITU, platform=platform, plan=plan_backends(platform), layer_name="layer 1").load(bad)
            ok, message = False, "loaded"
        except WeightValidationError as exc:
            message = str(exc)
            ok = f"expert {expert} tensor" in message
        chk.record(ok, check=f"validate refuses {name}", message=message[:160])


if __name__ == "__main__":
    sys.exit(main())

"""One bench run: same weights and routing for every row, each row checked, then timed."""
from __future__ import annotations

import logging
import traceback
from collections.abc import Callable

import torch

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.bench.check import REL_L2_BOUND, judge
from kimi_k3_moe.bench.data import RoutingSource, expert_map_for, random_experts, random_hidden
from kimi_k3_moe.bench.peers.base import Peer, PeerUnavailable
from kimi_k3_moe.bench.routing import Routing
from kimi_k3_moe.bench.shapes import Shape
from kimi_k3_moe.bench.timing import moe_flops, mxfp4_bytes_per_expert
from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.reference import dense_moe

log = logging.getLogger(__name__)
OK, WRONG, ERROR, ABSENT = "ok", "wrong", "error", "not available"


def _reference(hidden, weights, ids, activation, expert_map, w13_of, w2_of, act_quant=None):
    return dense_moe(hidden, w13_of, w2_of, weights, ids, activation, expert_map, compute_dtype=torch.float32,
                     act_quant=act_quant)


def run_bench(peers: list[Peer], shape: Shape, tokens: list[int], activation: ActivationSpec, timer, *,
              device, seed: int, ceilings: dict, bound: float = REL_L2_BOUND, routing: Routing = Routing(),
              progress: Callable[[str], None] = lambda msg: None,
              on_row: Callable[[dict], None] = lambda partial: None) -> dict:
    """-> {"shape", "activation", "ceilings", "entries": {name: {...}}, "rows": [...]}.

    `ceilings`: {"copy_GBps": .., "bf16_TFLOPs": ..}, measured in this run by the caller.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    route = RoutingSource(routing, shape.num_experts, shape.topk, device, gen)
    experts = random_experts(shape.held_experts, shape.hidden, shape.inter, device, gen)
    emap = expert_map_for(shape.num_experts, shape.held_experts, device) if shape.is_ep else None
    mx13 = lambda e: mxfp4.dequantize(experts.w13_packed[e], experts.w13_scale[e])  # noqa: E731
    mx2 = lambda e: mxfp4.dequantize(experts.w2_packed[e], experts.w2_scale[e])  # noqa: E731
    entries, runners = {}, {}
    for peer in peers:
        ok, why = peer.probe()
        entries[peer.name] = {"label": peer.label, "role": peer.role, "found": why, "available": ok}
        if not ok:
            continue
        try:
            progress(f"preparing {peer.name}")
            runners[peer.name] = peer.build(experts, activation, shape, emap)
            entries[peer.name]["notes"] = runners[peer.name].notes
        except PeerUnavailable as exc:
            entries[peer.name].update(available=False, found=str(exc))
        except Exception as exc:  # a peer that breaks is reported, the others still run
            entries[peer.name].update(available=False, found=f"build failed: {type(exc).__name__}: {exc}")
            log.debug("build of %s failed", peer.name, exc_info=True)
    per_expert = mxfp4_bytes_per_expert(shape.hidden, shape.inter)
    rows = []
    result = {"shape": shape.to_json(), "activation": str(activation), "bound_rel_l2": bound,
              "timing": timer.method, "ceilings": ceilings, "seed": seed, "routing": str(routing),
              "entries": entries, "rows": rows}
    silu = ActivationSpec.silu()
    for t in tokens:
        progress(f"{t} tokens")
        hidden = random_hidden(t, shape.hidden, device, gen)
        weights, ids = route(t, held=shape.held_experts if shape.is_ep else None)
        held = ids[ids < shape.held_experts]
        distinct = int(torch.unique(held).numel())
        pairs = int(held.numel())
        floor_bw = distinct * per_expert / (ceilings["copy_GBps"] * 1e9) * 1e6
        floor_cmp = moe_flops(1, 1, shape.hidden, shape.inter) * pairs / (ceilings["bf16_TFLOPs"] * 1e12) * 1e6
        row = {"tokens": t, "distinct_experts": distinct, "floor_bw_us": floor_bw, "floor_compute_us": floor_cmp,
               "floor_us": max(floor_bw, floor_cmp), "results": {}}
        refs = {}

        def ref_for(act, ref_w, act_quant=None, refs=refs, hidden=hidden, weights=weights, ids=ids):
            key = (str(act), id(ref_w) if ref_w else None, act_quant.tag() if act_quant else None)
            if key not in refs:
                w13_of, w2_of = ref_w or (mx13, mx2)
                refs[key] = _reference(hidden, weights, ids, act, emap, w13_of, w2_of, act_quant)
            return refs[key]
        for name, r in runners.items():
            res = row["results"][name] = {}
            try:
                routed = r.route(weights, ids)
                out = r.run(hidden, routed)
                ref = ref_for(r.activation, r.reference_weights, r.act_quant)
                silu_ref = ref_for(silu, r.reference_weights, r.act_quant) if r.activation == activation \
                    and activation.name != silu.name else None
                verdict = judge(out, ref, silu_ref, bound)
                res["rel_l2"] = verdict.rel_l2
                if not verdict.ok:
                    res.update(status=WRONG, why=verdict.why)
                    continue
                if hasattr(r, "config_source"):
                    res["config"] = r.config_source(t)
                if r.route_in_timing:
                    res.update(timer.time(lambda r=r, hidden=hidden, weights=weights, ids=ids:
                                          r.run(hidden, r.route(weights, ids))))
                else:
                    res.update(timer.time(lambda r=r, hidden=hidden, routed=routed: r.run(hidden, routed)))
                    res["route_us"] = timer.time(
                        lambda r=r, weights=weights, ids=ids: r.route(weights, ids))["median_us"]
                res["status"] = OK
            except Exception as exc:
                res.update(status=ERROR, why=f"{type(exc).__name__}: {exc}"[:300])
                log.debug("%s at %d tokens failed:\n%s", name, t, traceback.format_exc())
        timed = {n: v["median_us"] for n, v in row["results"].items() if v.get("status") == OK}
        for n, v in row["results"].items():
            if n in timed:
                v["x_floor"] = v["median_us"] / row["floor_us"]
                others = [u for m, u in timed.items() if m != n]
                v["x_best_other"] = v["median_us"] / min(others) if others else None
        rows.append(row)
        on_row(result)
    return result

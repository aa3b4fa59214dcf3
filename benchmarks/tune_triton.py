"""Tune the Triton backend's tile configs on this GPU and write its table.

For each layer shape (K3 TP8: I 384; TP16: I 192), weight format and token
tier: time each stage's candidates alone (CUDA-graph replay, cold L2, median),
keep the best per stage for every candidate block_m, time the whole forward
of each finalist (alignment and reduction included) and of the small-batch
path, and keep the fastest. Configs that fail validation or spill registers
are skipped. Output: kimi_k3_moe/configs/tables/triton_<device>.json (or --out),
with every measurement kept beside the chosen configs.

    python benchmarks/tune_triton.py [--shapes tp8,tp16] [--formats mxfp4,int4] [--budget-s 600]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from dataclasses import replace

from _common import (SHAPES, ColdL2Timer, Recipe, _warm, env_info, log, random_experts, random_hidden,
                     random_routing, write_json)

import torch  # noqa: E402

from kimi_k3_moe.configs import triton_table as tt  # noqa: E402
from kimi_k3_moe.kernels import get_backend  # noqa: E402
from kimi_k3_moe.kernels.triton.moe import plan_moe  # noqa: E402
from kimi_k3_moe.kernels.triton.tuning_space import (ACT, QUICK, REGISTER_MARGIN, TIERS, TOPK,  # noqa: E402
                                                      candidates)
from kimi_k3_moe.loading import prepare_for  # noqa: E402


class Entry:
    """One table entry: a shape and a weight format, tuned over all tiers."""

    def __init__(self, shape_name: str, fmt: str, quick: bool = False):
        self.shape_name, self.fmt, self.quick = shape_name, fmt, quick
        s = SHAPES[shape_name]
        self.e, self.h, self.i = s["num_experts"], s["hidden"], s["inter"]
        self.key = tt.shape_key(fmt, self.e, 2 * self.i, self.h)

    def recipes(self, tiers):
        out = []
        for tier in tiers:
            for (path, bm), (s1, s2, base) in candidates(tier, self.h, self.i, self.quick).items():
                for cfg in [base, *s1, *s2]:
                    out.append(Recipe(self.fmt, self.e, self.h, self.i, 64, TOPK,
                                      (ACT.name, ACT.beta, ACT.linear_beta), json.dumps(cfg.to_json(), sort_keys=True)))
        return list(dict.fromkeys(out))


def spills(launch_result) -> int:
    return int(getattr(launch_result, "n_spills", 0) or 0)


def run_plan(launches):
    results = []
    for launch in launches:
        results.append(launch.kernel[launch.grid](**launch.args, num_warps=launch.num_warps,
                                                  num_stages=launch.num_stages))
    return results


def tune_entry(entry: Entry, tiers, deadline: float, timer: ColdL2Timer, gen, reps: int, log_rows: list,
               save=lambda chosen: None):
    experts = random_experts(entry.e, entry.h, entry.i, "cuda", gen)
    backend = get_backend("triton", weight_format=entry.fmt)
    prepared = prepare_for(backend, experts)  # converted to int4 first when the backend runs int4
    del experts
    chosen = {}
    for tier in tiers:
        if time.time() > deadline:
            cfg = tt.heuristic_config(entry.h, entry.i, tier, is_cuda=True)
            chosen[str(tier)] = {**cfg.to_json(), "tuned": False, "note": "time budget ran out: heuristic"}
            log(entry.key, tier, "UNTUNED (budget)")
            continue
        hidden = random_hidden(tier, entry.h, "cuda", gen)
        weights, ids = random_routing(tier, entry.e, TOPK, "cuda", gen)
        out = torch.empty_like(hidden)

        def plan(cfg):
            return plan_moe(prepared, hidden, weights, ids, ACT, None, out, cfg)

        finalists = []
        for (path, bm), (s1_list, s2_list, base) in candidates(tier, entry.h, entry.i, entry.quick).items():
            best = {}
            for stage, cands in (("stage1", s1_list), ("stage2", s2_list)):
                timed = []
                for cfg in cands:
                    if time.time() > deadline:
                        break
                    try:
                        launches = plan(cfg)
                        res = run_plan(launches)
                        torch.cuda.synchronize()
                        # this stage's launches (stage 1 includes putting x in word order)
                        mine = [l for l in launches if l.label.startswith(stage)]
                        main = next(i for i, l in enumerate(launches) if l.label in (f"{stage}.gemv", f"{stage}.aligned"))
                        idx = main
                        sp = spills(res[main])
                        regs = getattr(res[main], "n_regs", 0) or 0
                        if regs >= REGISTER_MARGIN:
                            # at the 255 limit another Triton release (CI compiles with its own) spills
                            sp = sp or f"{regs} registers"
                        if sp:
                            log_rows.append(dict(entry=entry.key, tier=tier, path=path, block_m=bm, stage=stage,
                                                 config=cfg.to_json()[stage], spills=sp))
                            continue
                        t = timer.time_graph(lambda: [l() for l in mine], reps=reps)["median_us"]
                        timed.append((t, cfg))
                        k = res[idx]
                        log_rows.append(dict(entry=entry.key, tier=tier, path=path, block_m=bm, stage=stage,
                                             config=cfg.to_json()[stage], us=t, regs=getattr(k, "n_regs", None)))
                    except Exception as exc:
                        log_rows.append(dict(entry=entry.key, tier=tier, path=path, block_m=bm, stage=stage,
                                             config=cfg.to_json()[stage], error=f"{type(exc).__name__}: {exc}"[:300]))
                if timed:
                    best[stage] = min(timed, key=lambda x: x[0])
            if len(best) < 2:
                continue
            cfg = replace(base, stage1=best["stage1"][1].stage1, stage2=best["stage2"][1].stage2)
            launches = plan(cfg)
            run_plan(launches)
            total = timer.time_graph(lambda: [l() for l in launches], reps=reps)["median_us"]
            finalists.append((total, cfg, best["stage1"][0], best["stage2"][0]))
            log(entry.key, f"T={tier}", path, bm, f"total {total:.1f} us (s1 {best['stage1'][0]:.1f}, "
                f"s2 {best['stage2'][0]:.1f})")
        if not finalists:
            cfg = tt.heuristic_config(entry.h, entry.i, tier, is_cuda=True)
            chosen[str(tier)] = {**cfg.to_json(), "tuned": False, "note": "no candidate finished: heuristic"}
            continue
        # correctness gate: the winner must agree with the aligned path's portable decoder
        # (interleaved dots), the combination checked against float64 on this GPU first
        ref_cfg = replace(tt.heuristic_config(entry.h, entry.i, max(tier, 64), is_cuda=True), decode="bits")
        run_plan(plan(ref_cfg))
        reference = out.clone()
        chosen_one = None
        for total, cfg, s1_us, s2_us in sorted(finalists, key=lambda x: x[0]):
            run_plan(plan(cfg))
            err = float((out.double() - reference.double()).norm() / reference.double().norm())
            if err < 2e-2 and bool(torch.isfinite(out).all()):
                chosen_one = (total, cfg, s1_us, s2_us, err)
                break
            log(entry.key, f"T={tier}", "REJECTED", cfg.path, cfg.block_m, f"rel diff {err:.3g}")
        if chosen_one is None:
            cfg = tt.heuristic_config(entry.h, entry.i, tier, is_cuda=True)
            chosen[str(tier)] = {**cfg.to_json(), "tuned": False, "note": "no finalist passed the check"}
            continue
        total, cfg, s1_us, s2_us, err = chosen_one
        # the portable decoder with the same tiles, for the record
        bits_us = None
        try:
            bits = replace(cfg, decode="bits")
            launches = plan(bits)
            run_plan(launches)
            bits_us = timer.time_graph(lambda: [l() for l in launches], reps=reps)["median_us"]
        except Exception as exc:
            log("bits decode failed:", exc)
        chosen[str(tier)] = {**cfg.to_json(), "tuned": True, "verified_rel_diff": round(err, 5),
                             "us": round(total, 2), "stage1_us": round(s1_us, 2),
                             "stage2_us": round(s2_us, 2), "bits_decode_us": bits_us and round(bits_us, 2),
                             "finalists": [{"path": c.path, "block_m": c.block_m, "us": round(t, 2)}
                                           for t, c, _, _ in finalists]}
        log(entry.key, f"T={tier}", "->", cfg.path, cfg.block_m, f"{total:.1f} us (bits decode: {bits_us})")
        save(chosen)
    return {"tiers": chosen}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tp8,tp16")
    ap.add_argument("--formats", default="mxfp4,int4")
    ap.add_argument("--tiers", default=",".join(map(str, TIERS)))
    ap.add_argument("--budget-s", type=float, default=900)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--out", default=None, help="table path (default: the package's table for this GPU)")
    ap.add_argument("--log", default="results/tune_log.json")
    ap.add_argument("--merge", action="store_true", help="keep entries of an existing table not tuned now")
    ap.add_argument("--quick-secondary", action="store_true",
                    help=f"only the first {QUICK} candidates per stage for entries other than tp8/mxfp4")
    args = ap.parse_args()
    start = time.time()
    deadline = start + args.budget_s
    info = env_info()
    dev_key = tt.device_key(info["gpu"])
    out_path = args.out or str(tt.table_path(dev_key))
    tiers = [int(t) for t in args.tiers.split(",")]
    entries = [Entry(s, f, quick=args.quick_secondary and (s, f) != ("tp8", "mxfp4"))
               for s in args.shapes.split(",") for f in args.formats.split(",")]
    log("tuning", [e.key for e in entries], "tiers", tiers, "budget", args.budget_s, "s ->", out_path)

    # Compile every candidate in the background, entry by entry, while the GPU measures.
    pool = mp.get_context("spawn").Pool(args.workers)
    pending = [pool.map_async(_warm, e.recipes(tiers), chunksize=1) for e in entries]
    timer = ColdL2Timer()
    gen = torch.Generator(device="cuda").manual_seed(1234)
    table = {"format_version": 1, "device": info["gpu"], "device_key": dev_key, "tuned_with": info,
             "tiers": tiers, "activation_tuned": str(ACT), "entries": {}}
    if args.merge:
        try:
            with open(out_path) as f:
                table["entries"].update(json.load(f).get("entries", {}))
        except FileNotFoundError:
            pass
    rows = []
    for entry, job in zip(entries, pending):
        t0 = time.time()
        errors = [e for e in job.get() if e]
        log(f"{entry.key}: candidates compiled (waited {time.time() - t0:.1f} s, {len(errors)} errors)")
        # with --merge, tiers not tuned now keep the table's entries
        kept = dict(table["entries"].get(entry.key, {}).get("tiers", {}))

        def save(chosen, key=entry.key, kept=kept):
            # partial progress: tuned tiers so far, then the kept ones, the heuristic for the rest (marked)
            tiers_now = {**kept, **chosen}
            for t in tiers:
                if str(t) not in tiers_now:
                    cfg = tt.heuristic_config(SHAPES[entry.shape_name]["hidden"], SHAPES[entry.shape_name]["inter"],
                                              t, is_cuda=True)
                    tiers_now[str(t)] = {**cfg.to_json(), "tuned": False, "note": "not reached"}
            table["entries"][key] = {"tiers": tiers_now}
            write_json(out_path, table)
            write_json(args.log, rows)
        tuned = tune_entry(entry, tiers, deadline, timer, gen, args.reps, rows, save)
        table["entries"][entry.key] = {"tiers": {**kept, **tuned["tiers"]}, "seconds": round(time.time() - t0, 1)}
        write_json(out_path, table)
        write_json(args.log, rows)
    pool.terminate()
    log(f"wrote {out_path} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

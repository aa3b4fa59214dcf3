"""Tune the packaged Triton table on this GPU: a thin caller of `kimi-k3-moe tune`.

Each (shape, weight format) runs the package's tune loop (kimi_k3_moe/tune: the
candidates of kernels/triton/tuning_space.py, the packaged config among them,
compile/spill skip, the reference check, graph timing, resumable state) into a
scratch user-table folder; the entries are then written as the packaged table
kimi_k3_moe/configs/tables/triton_<device>.json (or --out), measurements kept, as the section of the
running Triton (major.minor); the sections of other Triton versions stay as they are.

    python benchmarks/tune_triton.py [--shapes tp8,tp16] [--formats mxfp4,int4] [--budget-s 900] [--merge]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace

from _common import log, write_json

import torch  # noqa: E402

from kimi_k3_moe.activation import ActivationSpec  # noqa: E402
from kimi_k3_moe.bench.data import random_experts  # noqa: E402
from kimi_k3_moe.bench.env import run_info  # noqa: E402
from kimi_k3_moe.bench.shapes import parse_shape  # noqa: E402
from kimi_k3_moe.bench.timing import GraphTimer  # noqa: E402
from kimi_k3_moe.configs import triton_table as tt  # noqa: E402
from kimi_k3_moe.configs import user_tables  # noqa: E402
from kimi_k3_moe.kernels.triton.tuning_space import TIERS  # noqa: E402
from kimi_k3_moe.tune.command import make_target, run_with_progress  # noqa: E402

SITU = ActivationSpec.situv2(4.0, 25.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tp8,tp16")
    ap.add_argument("--formats", default="mxfp4,int4")
    ap.add_argument("--tiers", default=",".join(map(str, TIERS)))
    ap.add_argument("--budget-s", type=float, default=900)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None, help="table path (default: the package's table for this GPU)")
    ap.add_argument("--merge", action="store_true",
                    help="keep this Triton's entries of an existing table that are not tuned now")
    ap.add_argument("--quick-secondary", action="store_true",
                    help="only the first candidates per stage for entries other than tp8/mxfp4")
    ap.add_argument("--scratch", default=None, help="user-table folder for the runs (resumable; default: temp)")
    args = ap.parse_args()
    os.environ[user_tables.ENV_DIR] = args.scratch or tempfile.mkdtemp(prefix="kimi_tune_")
    user_tables.clear_cache()
    identity = user_tables.device_identity()
    out_path = args.out or str(tt.table_path(identity["key"]))
    tiers = [int(t) for t in args.tiers.split(",")]
    # the running Triton's section is (re)written; other versions' sections are kept as they are
    table = {"format_version": tt.TABLE_FORMAT, "device": identity["name"], "device_key": identity["key"],
             "activation_tuned": str(SITU), "tritons": {}}
    if os.path.exists(out_path):
        with open(out_path) as f:
            table["tritons"] = json.load(f).get("tritons", {})
    version = identity["triton"]
    kept = table["tritons"].get(version, {}).get("entries", {}) if args.merge else {}
    table["tritons"][version] = {"tuned_with": run_info(), "tiers": tiers, "entries": dict(kept)}
    section = table["tritons"][version]
    jobs = [(s, f) for s in args.shapes.split(",") for f in args.formats.split(",")]
    deadline = time.monotonic() + args.budget_s
    for n, (shape_name, fmt) in enumerate(jobs):
        shape = parse_shape(shape_name)
        budget = max(0.0, (deadline - time.monotonic()) / (len(jobs) - n))
        experts = random_experts(shape.held_experts, shape.hidden, shape.inter, "cuda",
                                 torch.Generator(device="cuda").manual_seed(1234 + n))
        quick = args.quick_secondary and (shape_name, fmt) != ("tp8", "mxfp4")
        target = make_target("triton", shape, experts, SITU, identity,
                             SimpleNamespace(weight_format=fmt, quick=quick), tiers)
        state = user_tables.table_path("triton", identity["key"]).with_suffix(f".{shape_name}.{fmt}.state.json")
        result = run_with_progress(target, SITU, GraphTimer(reps=args.reps), budget, state, seed=1234 + n)
        user, _ = user_tables.load(tt.USER_TABLE, identity)
        section["entries"][result["key"]] = user["entries"][result["key"]]
        write_json(out_path, table)
        write_json(str(state.with_suffix(".log.json")), result["outcomes"])
        log(f"{result['key']}: " + ", ".join(f"{t}: {i.get('us', float('nan')):.1f} us"
                                              for t, i in result["tiers"].items()))
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tune the packaged Triton table on this GPU: a thin caller of `kimi-k3-moe tune --packaged`.

Each (shape, weight format) is one `kimi-k3-moe tune` run (kimi_k3_moe/tune: the candidates of
kernels/triton/tuning_space.py, the packaged config among them, compile/spill skip, the reference
check, graph timing, resumable state) into a scratch user-table folder; `--packaged` merges its
tiers into the table's section of the running Triton (major.minor). Tiers not tuned now, other
entries and other Tritons' sections stay as they are. Every candidate is timed under uniform and
skewed routing by default and a tier keeps the one that loses least to either routing's best (a
packaged pick must hold wherever a router sends the tokens).

    python benchmarks/tune_triton.py [--shapes tp8,tp16,ep16] [--formats mxfp4,int4] [--budget-s 900]
                                     [--routing uniform,skewed]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from _common import log

from kimi_k3_moe import cli  # noqa: E402
from kimi_k3_moe.configs import user_tables  # noqa: E402
from kimi_k3_moe.kernels.triton import table as tt  # noqa: E402
from kimi_k3_moe.kernels.triton.tuning_space import TIERS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tp8,tp16", help="named shapes (tp8, tp16, ep16)")
    ap.add_argument("--formats", default="mxfp4,int4")
    ap.add_argument("--tiers", default=",".join(map(str, TIERS)))
    ap.add_argument("--budget-s", type=float, default=900, help="shared by every (shape, format)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None, help="table path (default: the package's table for this GPU)")
    ap.add_argument("--quick-secondary", action="store_true",
                    help="only the first candidates per stage for entries other than tp8/mxfp4")
    ap.add_argument("--routing", default="uniform,skewed", help="kimi-k3-moe tune --routing")
    ap.add_argument("--scratch", default=None, help="user-table folder for the runs (resumable; default: temp)")
    args = ap.parse_args()
    os.environ[user_tables.ENV_DIR] = args.scratch or tempfile.mkdtemp(prefix="kimi_tune_")
    user_tables.clear_cache()
    out = args.out or str(tt.table_path(user_tables.device_identity()["key"]))
    jobs = [(s, f) for s in args.shapes.split(",") for f in args.formats.split(",")]
    deadline = time.monotonic() + args.budget_s
    for n, (shape, weight_format) in enumerate(jobs):
        budget_min = max(0.0, (deadline - time.monotonic()) / (len(jobs) - n)) / 60
        quick = args.quick_secondary and (shape, weight_format) != ("tp8", "mxfp4")
        log(f"{shape} {weight_format}: {budget_min:.1f} min")
        rc = cli.main(["tune", "--backend", "triton", "--shape", shape, "--format", weight_format,
                       "--tiers", args.tiers,
                       "--budget-min", f"{max(budget_min, 1e-3):.4f}", "--reps", str(args.reps),
                       "--routing", args.routing, "--packaged", out] + (["--quick"] if quick else []))
        if rc:
            return rc
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

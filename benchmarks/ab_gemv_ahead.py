"""A/B on a GPU: the small-batch kernels loading 1 or 2 K steps ahead (`stage1.GEMV_AHEAD`).

For each shape, weight format and token count whose table entry takes the GEMV path,
times the whole Triton forward both ways (CUDA-graph replay, L2 flushed, median) and
checks both against the float64 reference.

    python benchmarks/ab_gemv_ahead.py --json ab_gemv_ahead.json
"""
from __future__ import annotations

import argparse
import json

from _common import SHAPES, ColdL2Timer, env_info, random_experts, random_hidden, random_routing
import torch  # noqa: E402

from kimi_k3_moe.activation import ActivationSpec  # noqa: E402
from kimi_k3_moe.kernels import get_backend  # noqa: E402
from kimi_k3_moe.kernels.triton import stage1, stage2  # noqa: E402
from kimi_k3_moe.reference import moe_forward, relative_l2  # noqa: E402
from kimi_k3_moe.weights.requant import requantize_experts  # noqa: E402

SITU = ActivationSpec("situv2", 4.0, 25.0)


def set_ahead(n: int) -> None:
    stage1.GEMV_AHEAD = n
    stage2.GEMV_AHEAD = n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--shapes", default="tp8,tp16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(2026)
    timer = ColdL2Timer()
    rows = []
    for shape in args.shapes.split(","):
        s = SHAPES[shape]
        experts = random_experts(s["num_experts"], s["hidden"], s["inter"], "cuda", gen)
        for fmt in ("mxfp4", "int4"):
            backend = get_backend("triton", weight_format=fmt)
            src = requantize_experts(experts, progress=False) if fmt == "int4" else experts
            prepared = backend.prepare(src)
            for t in map(int, args.tokens.split(",")):
                hidden = random_hidden(t, s["hidden"], "cuda", gen)
                weights, ids = random_routing(t, s["num_experts"], 16, "cuda", gen)
                ref = moe_forward(hidden.double(), *experts.tensors(), weights, ids, SITU) if fmt == "mxfp4" else None
                row = {"shape": shape, "fmt": fmt, "tokens": t}
                for ahead in (1, 2):
                    set_ahead(ahead)
                    out = backend.forward(prepared, hidden, weights, ids, SITU)
                    if ref is not None:
                        row[f"rel_l2_ahead{ahead}"] = float(relative_l2(out, ref))
                    row[f"us_ahead{ahead}"] = timer.time_graph(
                        lambda: backend.forward(prepared, hidden, weights, ids, SITU), reps=args.reps)["median_us"]
                row["ahead2_over_ahead1"] = row["us_ahead2"] / row["us_ahead1"]
                print(row, flush=True)
                rows.append(row)
            del prepared
    set_ahead(1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": env_info(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One forward per token count between cudaProfilerStart/Stop, for Nsight Compute.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        python benchmarks/profile_ncu.py --tokens 1,64,4096

Every kernel is compiled and run once before profiling starts, so ncu sees
only the steady-state launches of the configs the table picks (K3 TP8, MXFP4,
SiTUv2).
"""
from __future__ import annotations

import argparse
import sys

from _common import SHAPES, K3_TOPK, log, random_experts, random_hidden, random_routing

import torch  # noqa: E402

from kimi_k3_moe.activation import ActivationSpec  # noqa: E402
from kimi_k3_moe.kernels import get_backend  # noqa: E402

SITU = ActivationSpec.situv2(4.0, 25.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,64,4096")
    ap.add_argument("--shape", default="tp8")
    args = ap.parse_args()
    s = SHAPES[args.shape]
    gen = torch.Generator(device="cuda").manual_seed(7)
    backend = get_backend("triton")
    prepared = backend.prepare(random_experts(s["num_experts"], s["hidden"], s["inter"], "cuda", gen))
    runs = []
    for t in (int(x) for x in args.tokens.split(",")):
        hidden = random_hidden(t, s["hidden"], "cuda", gen)
        weights, ids = random_routing(t, s["num_experts"], K3_TOPK, "cuda", gen)
        backend.forward(prepared, hidden, weights, ids, SITU)  # compile and warm
        runs.append((t, hidden, weights, ids))
        log(t, backend.lookup(prepared, t).source)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for t, hidden, weights, ids in runs:
        torch.cuda.nvtx.range_push(f"T={t}")
        backend.forward(prepared, hidden, weights, ids, SITU)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

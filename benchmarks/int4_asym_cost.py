"""What the asymmetric int4 variant costs at run time beside the symmetric one, on one GPU.

Same backend, same TP8 per-rank layer (896 experts, H 3584, I/8 384, top-16),
same routing; weights converted with `search` (symmetric: value = q * s) and
with `asym` (value = q * s + o, one more bf16 per 32). Timing as the project
times kernels: CUDA-graph replay, L2 flushed before each replay, median of
--repeats (>= 20); HBM copy bandwidth measured in the same run; the floor is
the int4 bytes of the experts the batch touches over that bandwidth.
Target (issue 9): asym at most 15% slower than symmetric at 64-1024 tokens.

  python benchmarks/int4_asym_cost.py --json int4_asym_cost.json          # triton backend, H200
  python benchmarks/int4_asym_cost.py --backend torch --device cpu --experts 8 --tokens 4   # smoke test
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kimi_k3_moe.activation import ActivationSpec  # noqa: E402
from kimi_k3_moe.bench.timing import copy_bandwidth_gbps  # noqa: E402
from kimi_k3_moe.kernels import BackendUnavailable, get_backend  # noqa: E402
from kimi_k3_moe.weights.requant import requantize_experts  # noqa: E402
from requant_load import HIDDEN, INTER_PER_RANK, layer_experts  # noqa: E402

SITU = ActivationSpec.situv2(4.0, 25.0)
FLUSH_BYTES = 512 << 20  # > 10x the H200's 50 MB L2


def routing(tokens: int, experts: int, top_k: int, device, gen: torch.Generator):
    scores = torch.rand(tokens, experts, generator=gen)
    ids = scores.topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.sigmoid(torch.randn(tokens, top_k, generator=gen))
    return (weights / weights.sum(1, keepdim=True)).to(device), ids.to(device)


def time_gpu(fn, repeats: int, device: torch.device) -> tuple[float, str]:
    """(median seconds, how) of fn: CUDA-graph replays with L2 flushed before each."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run, how = graph.replay, "graph replay, L2 flushed"
    except Exception as exc:  # a backend that cannot be captured is still timed, and says so
        torch.cuda.synchronize(device)
        run, how = fn, f"EAGER (graph capture failed: {type(exc).__name__}: {exc})"
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), how


def time_cpu(fn, repeats: int) -> tuple[float, str]:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), "wall clock, CPU"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no GPU here; use --device cpu --backend torch for a smoke test")
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    mxfp4_experts = layer_experts(args.experts, 8, args.seed).to(device)
    prepared, backends = {}, {}
    for method in ("search", "asym"):
        try:
            backends[method] = get_backend(args.backend, weight_format="int4", int4_method=method)
            backends[method].require_available()
        except (BackendUnavailable, TypeError, ValueError) as exc:
            print(f"backend {args.backend!r} with int4_method={method!r} cannot run here: {exc}")
            return 2
        converted = requantize_experts(mxfp4_experts, method=method, progress=False)
        prepared[method] = backends[method].prepare(converted)
        del converted
    del mxfp4_experts
    bandwidth = copy_bandwidth_gbps(device) * 1e9 if device.type == "cuda" else None
    per_expert = {m: 3 * HIDDEN * INTER_PER_RANK * (0.5 + 2 / 32 + (2 / 32 if m == "asym" else 0))
                  for m in ("search", "asym")}
    setup = {"backend": args.backend, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
             else "cpu", "experts": args.experts, "top_k": args.top_k, "torch": torch.__version__,
             "copy_bandwidth_GBps": None if bandwidth is None else bandwidth / 1e9,
             "date": datetime.datetime.now().isoformat(timespec="seconds")}
    print(json.dumps(setup))
    print(f"{'tokens':>6} {'search us':>10} {'asym us':>10} {'asym/search':>11} {'floor sym':>10} "
          f"{'floor asym':>10}  timing")
    rows = []
    for tokens in args.tokens:
        hidden = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
        weights, ids = routing(tokens, args.experts, args.top_k, device, gen)
        touched = int(torch.unique(ids).numel())
        row = {"tokens": tokens, "experts_touched": touched}
        for method in ("search", "asym"):
            def fn(method=method):
                return backends[method].forward(prepared[method], hidden, weights, ids, SITU)

            seconds, how = (time_gpu(fn, args.repeats, device) if device.type == "cuda"
                            else time_cpu(fn, args.repeats))
            row[f"{method}_us"] = seconds * 1e6
            row[f"{method}_timing"] = how
            if bandwidth is not None:
                row[f"{method}_floor_us"] = touched * per_expert[method] / bandwidth * 1e6
        row["asym_over_search"] = row["asym_us"] / row["search_us"]
        rows.append(row)
        floors = (f"{row['search_floor_us']:10.1f} {row['asym_floor_us']:10.1f}" if bandwidth else
                  f"{'-':>10} {'-':>10}")
        print(f"{tokens:6d} {row['search_us']:10.1f} {row['asym_us']:10.1f} {row['asym_over_search']:11.3f} "
              f"{floors}  {row['search_timing']}", flush=True)
    target = [r for r in rows if 64 <= r["tokens"] <= 1024]
    if target:
        worst = max(r["asym_over_search"] for r in target)
        print(f"asym/search at 64-1024 tokens: worst {worst:.3f} (target <= 1.15: "
              f"{'met' if worst <= 1.15 else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": setup, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

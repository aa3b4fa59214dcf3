"""`kimi-k3-moe bench`: ours against the engine's own path on this GPU, same weights and routing."""
from __future__ import annotations

import argparse
import sys

from kimi_k3_moe.bench.routing import ROUTINGS, routing_arg
from kimi_k3_moe.bench.shapes import add_shape_arguments
from kimi_k3_moe.cli import count_list, non_negative_int, positive_int

HELP = ("time every backend that runs here and the engine's own Kimi-K3 path (Humming on Hopper, aiter on "
        "ROCm) at one per-rank shape; each row is checked against the float reference before it is timed")
DEFAULT_TOKENS = "1,4,16,64,256,1024,4096,16384"
# ROCm: every prefill chunk size the large-batch tiers serve, ours beside aiter's fused_moe at each
ROCM_EXTRA_TOKENS = (2048, 8192)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser)
    parser.add_argument("--tokens", default=None,
                        help=f"comma list of token counts (>= 1; default {DEFAULT_TOKENS}, on ROCm with "
                             f"{' and '.join(map(str, ROCM_EXTRA_TOKENS))} too)")
    parser.add_argument("--json", dest="json_out", help="write the full result here")
    parser.add_argument("--ours", default="auto",
                        help="our rows, e.g. triton,triton:int4,flydsl (auto: this platform's)")
    parser.add_argument("--peers", default="humming,aiter,triton_kernels,flashinfer,torch",
                        help="peer rows (those that cannot run here say why)")
    parser.add_argument("--peer-path", default=".peer",
                        help="folder holding the triton_kernels (and, if not installed, flashinfer) package")
    parser.add_argument("--reps", type=positive_int, default=25, help="graph replays per figure (median)")
    parser.add_argument("--seed", type=non_negative_int, default=None, help="data seed (default: fresh)")
    parser.add_argument("--routing", default="uniform", type=routing_arg,
                        help=f"{ROUTINGS}: which experts the tokens pick (recorded in the JSON)")


def default_tokens() -> str:
    import torch
    counts = {int(t) for t in DEFAULT_TOKENS.split(",")}
    if getattr(torch.version, "hip", None):
        counts |= set(ROCM_EXTRA_TOKENS)
    return ",".join(map(str, sorted(counts)))


def default_ours() -> list[str]:
    import torch
    if getattr(torch.version, "hip", None):
        return ["flydsl", "triton", "triton:int4"]
    return ["triton"]


def run(args: argparse.Namespace) -> int:
    import random

    from kimi_k3_moe.bench import report
    from kimi_k3_moe.bench.env import run_info
    from kimi_k3_moe.bench.peers import make_ours, make_peer
    from kimi_k3_moe.bench.runner import run_bench
    from kimi_k3_moe.bench.shapes import require_gpu, shape_and_activation
    from kimi_k3_moe.bench.timing import GraphTimer, bf16_matmul_tflops, copy_bandwidth_gbps
    tokens = count_list(args.tokens or default_tokens(), "--tokens")
    if args.json_out:
        report.require_writable(args.json_out)
    shape, activation = shape_and_activation(args.model, args.shape, args.tp)
    ours = default_ours() if args.ours == "auto" else [s for s in args.ours.split(",") if s]
    peers = [make_ours(s) for s in ours] + [make_peer(p, args.peer_path) for p in args.peers.split(",") if p]
    require_gpu("the bench times GPU kernels (CUDA/HIP graphs)")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    ceilings = {"copy_GBps": copy_bandwidth_gbps(), "bf16_TFLOPs": bf16_matmul_tflops()}
    info = run_info()

    def on_row(partial: dict) -> None:  # an interrupted run still leaves its finished rows
        print("  " + report.row_line(partial["rows"][-1]), file=sys.stderr, flush=True)
        if args.json_out:
            report.write_json(args.json_out, dict(partial, info=info))
    result = run_bench(peers, shape, tokens, activation, GraphTimer(reps=args.reps), device="cuda", seed=seed,
                       ceilings=ceilings, routing=args.routing,
                       progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True),
                       on_row=on_row)
    result["info"] = info
    report.render(result)
    from kimi_k3_moe.bench.verdict import record_verdicts
    from kimi_k3_moe.configs.user_tables import device_identity
    identity = device_identity()
    for path in record_verdicts(result, identity) if identity["arch"] == "gfx950" else ():
        print(f"recorded ours vs the engine's path for this layer shape on this GPU in {path} "
              "(the plugin reads it at load on gfx950)")
    if args.json_out:
        print(f"wrote {report.write_json(args.json_out, result)}")
    return 0

"""Time the Triton MoE against its floors and its peers: a thin caller of `kimi-k3-moe bench`.

The project's benchmark and the user's command are one implementation
(kimi_k3_moe/bench: one timing method, the same peers, every row checked
against the float reference before it is timed). This keeps the old flags:

    python benchmarks/bench_moe.py [--tokens 1,4,16,64,256,1024,4096,16384] [--peer-path .peer]
    python benchmarks/bench_moe.py --formats mxfp4,int4 --peers humming,triton_kernels

Humming runs where `humming-kernels` is importable (`pip install humming-kernels` on the GPU box).
"""
from __future__ import annotations

import argparse
import sys

import _common  # noqa: F401  (puts the repository on sys.path)

from kimi_k3_moe.cli import main as cli_main  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,16,64,256,1024,4096,16384")
    ap.add_argument("--shape", default="tp8")
    ap.add_argument("--formats", default="mxfp4,int4")
    ap.add_argument("--peers", default="humming,triton_kernels,torch")
    ap.add_argument("--peer-path", default=".peer")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--out", default="results/bench_moe.json")
    args = ap.parse_args()
    ours = [f"triton:{weight_format}" for weight_format in args.formats.split(",") if weight_format]
    return cli_main(["bench", "--shape", args.shape, "--tokens", args.tokens, "--ours", ",".join(ours),
                     "--peers", args.peers.replace("torch_grouped_mm", "torch"), "--peer-path", args.peer_path,
                     "--reps", str(args.reps), "--json", args.out])


if __name__ == "__main__":
    sys.exit(main())

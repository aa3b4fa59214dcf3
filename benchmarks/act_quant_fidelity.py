"""Accuracy cost of quantized activations, on the CPU (float64 reference, our format code).

Two tables for docs/FORMATS.md:
  1. one quantization of activation-like data: relative L2 of fp8 e4m3 (per 1x32 e8m0
     with our no-clip rule, per 1x32 with OCP's floor rule, per token fp32) and MXFP4
     (OCP rule, and the no-clip rule for comparison);
  2. the MoE layer (reference.moe_forward, SiTUv2 4/25, MXFP4 weights) with each
     scheme against the same layer with unquantized activations, at the tiny test
     shape and at Kimi-K3's TP8 per-rank shape (fewer experts).

    python benchmarks/act_quant_fidelity.py [--seed 0]      # prints markdown tables
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kimi_k3_moe.act_quant import ActQuant  # noqa: E402
from kimi_k3_moe.activation import ActivationSpec  # noqa: E402
from kimi_k3_moe.formats import fp8, mxfp4  # noqa: E402
from kimi_k3_moe.reference import moe_forward, relative_l2  # noqa: E402

SITU = ActivationSpec.situv2(4.0, 25.0)


def data(gen, rows=2048, cols=1024) -> dict[str, torch.Tensor]:
    g = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 2
    u = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 2
    t3 = torch.distributions.StudentT(3.0).sample((rows, cols)).double()
    return {"gaussian": torch.randn(rows, cols, generator=gen, dtype=torch.float64),
            "SiTUv2 output": SITU.apply(torch.cat([g, u], dim=1)),
            "student-t3": t3}


def fp8_ocp_rule(x: torch.Tensor) -> torch.Tensor:
    """e4m3 per 32 with OCP MX's scale rule: 2^(floor(log2 amax) - 8), elements saturated at 448."""
    blocks = x.float().unflatten(-1, (-1, 32))
    _, e = torch.frexp(blocks.abs().amax(-1, keepdim=True))
    scale = torch.ldexp(torch.ones_like(blocks[..., :1]), (e - 1 - 8).float())
    return (fp8.decode(fp8.encode(blocks / scale)) * scale).flatten(-2)


def mxfp4_noclip_rule(x: torch.Tensor) -> torch.Tensor:
    """e2m1 per 32 with the smallest power-of-two scale that clips nothing (amax / 2^s <= 6);
    elements rounded by ml_dtypes' e2m1 (round to nearest even)."""
    import ml_dtypes

    blocks = x.float().unflatten(-1, (-1, 32))
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 6.0)))
    codes = (blocks / scale).numpy().astype(ml_dtypes.float4_e2m1fn).astype("float32")
    return (torch.from_numpy(codes) * scale).flatten(-2)


SINGLE = {
    "fp8 e4m3, e8m0 per 32 (ours: no clipping)": lambda x: ActQuant("fp8").fake_quant(x, "hidden"),
    "fp8 e4m3, e8m0 per 32 (OCP floor rule)": fp8_ocp_rule,
    "fp8 e4m3, fp32 per token": lambda x: ActQuant("fp8", "token").fake_quant(x, "hidden"),
    "MXFP4 (OCP rule, ours)": lambda x: ActQuant("fp4").fake_quant(x, "hidden"),
    "MXFP4 (no-clip rule)": mxfp4_noclip_rule,
}
SCHEMES = [ActQuant("fp8"), ActQuant("fp8", "token", "token"), ActQuant("fp4")]


def layer_error(gen, experts, hidden, inter, tokens, top_k) -> dict[str, float]:
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 3 / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    weights = (*mxfp4.quantize(w13), *mxfp4.quantize(w2))
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).double()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    tw = torch.rand(tokens, top_k, generator=gen).double() + 0.1
    exact = moe_forward(x, *weights, tw, ids, SITU, compute_dtype=torch.float64)
    return {s.tag(): relative_l2(moe_forward(x, *weights, tw, ids, SITU, compute_dtype=torch.float64, act_quant=s),
                                 exact) for s in SCHEMES}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    sets = data(gen)
    print("| quantization (one pass) | " + " | ".join(sets) + " |")
    print("|---|" + "---|" * len(sets))
    for name, fn in SINGLE.items():
        print(f"| {name} | " + " | ".join(f"{relative_l2(fn(x), x):.4f}" for x in sets.values()) + " |")
    print()
    shapes = {"tiny (tests): E 8, H 256, I 128, 64 tokens, top-4": (8, 256, 128, 64, 4),
              "K3 TP8 per rank: E 16 of 896, H 3584, I 384, 64 tokens, top-4": (16, 3584, 384, 64, 4)}
    print("| MoE layer, vs unquantized activations | " + " | ".join(s.tag() for s in SCHEMES) + " |")
    print("|---|" + "---|" * len(SCHEMES))
    for name, shape in shapes.items():
        errs = layer_error(gen, *shape)
        print(f"| {name} | " + " | ".join(f"{errs[s.tag()]:.4f}" for s in SCHEMES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

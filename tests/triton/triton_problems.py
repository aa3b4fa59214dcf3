"""Tiny random MoE problems for the interpreter (K3-like magnitudes: stage-1 outputs RMS ~4)."""
from dataclasses import replace

import torch
from moe_helpers import random_experts, random_routing

from kimi_k3_moe.experts import Mxfp4Experts
from kimi_k3_moe.kernels.triton.table import KernelConfig, MoEConfig
from kimi_k3_moe.reference import dense_moe

E, H, I, TOPK = 6, 128, 64, 3

# big tiles: the interpreter's cost is per program
GEMV = MoEConfig("gemv", 16, KernelConfig(64, 128, 4, 2), KernelConfig(128, 64, 4, 2), "bits")
ALIGNED = MoEConfig("aligned", 16, KernelConfig(64, 64, 4, 2, swap=True), KernelConfig(64, 64, 4, 2, swap=True),
                    "bits")
ALIGNED_NOSWAP = replace(ALIGNED, block_m=32, stage1=replace(ALIGNED.stage1, swap=False),
                         stage2=replace(ALIGNED.stage2, swap=False))


def experts(gen, e=E, h=H, i=I) -> Mxfp4Experts:
    return random_experts(gen, e, h, i, gain=4.0)


def routing(gen, tokens, e=E, topk=TOPK):
    return random_routing(gen, tokens, e, topk, floor=0.05, normalize=True)


def hidden(gen, tokens, h=H, dtype=torch.bfloat16):
    return torch.randn(tokens, h, generator=gen).to(dtype)


def run(backend, prepared, hidden, weights, ids, act, emap=None):
    """backend.forward into a NaN-poisoned `out`: every element must be written."""
    out = torch.full_like(hidden, float("nan"))
    backend.forward(prepared, hidden, weights, ids, act, emap, out=out)
    assert torch.isfinite(out).all()
    return out


def reference(backend, prepared, hidden, weights, ids, act, emap=None):
    """The float64 MoE on the weights the prepared form encodes (each expert dequantized once)."""
    cache = {}

    def w(e, which):
        if e not in cache:
            cache[e] = backend.dequantize_prepared(prepared, e)
        return cache[e][which].double()
    return dense_moe(hidden.double(), lambda e: w(e, 0), lambda e: w(e, 1), weights, ids, act, emap,
                     compute_dtype=torch.float64)

"""Tiny random MoE problems for the interpreter (K3-like magnitudes: stage-1 outputs RMS ~4)."""
import torch

from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.experts import ExpertWeights

E, H, I, TOPK = 6, 128, 64, 3


def experts(gen, e=E, h=H, i=I) -> ExpertWeights:
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 4 / h ** 0.5
    w2 = torch.randn(e, h, i, generator=gen) / i ** 0.5
    return ExpertWeights(*mxfp4.quantize(w13), *mxfp4.quantize(w2))


def routing(gen, tokens, e=E, topk=TOPK):
    ids = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, topk, generator=gen) + 0.05
    return weights / weights.sum(1, keepdim=True), ids


def hidden(gen, tokens, h=H, dtype=torch.bfloat16):
    return torch.randn(tokens, h, generator=gen).to(dtype)

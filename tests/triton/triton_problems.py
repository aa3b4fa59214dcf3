"""Tiny random MoE problems for the interpreter (K3-like magnitudes: stage-1 outputs RMS ~4)."""
import torch

from moe_helpers import random_experts, random_routing

from kimi_k3_moe.experts import ExpertWeights

E, H, I, TOPK = 6, 128, 64, 3


def experts(gen, e=E, h=H, i=I) -> ExpertWeights:
    return random_experts(gen, e, h, i, gain=4.0)


def routing(gen, tokens, e=E, topk=TOPK):
    return random_routing(gen, tokens, e, topk, floor=0.05, normalize=True)


def hidden(gen, tokens, h=H, dtype=torch.bfloat16):
    return torch.randn(tokens, h, generator=gen).to(dtype)

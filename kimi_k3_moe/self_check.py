"""Load-time check of a kernel backend on the user's own GPU.

Nothing here has run our AMD kernels on AMD hardware, so before a backend
serves a model the plugin pushes a small slice of the real layer through it
and compares with the float reference over the same weights. A backend that
disagrees is refused (and the next one in the plan tried, or an error raised).
A backend with quantized activations (`backend.act_quant`) is compared with a
reference that quantizes the activations at the same two points with the CPU
quantizers, so the bound measures the kernels, not the format.
"""
from __future__ import annotations

import torch

from kimi_k3_moe import settings
from kimi_k3_moe.act_quant import ActQuant
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.experts import Int4Experts, Mxfp4Experts
from kimi_k3_moe.kernels.base import MoEBackend
from kimi_k3_moe.reference import dense_moe, relative_l2
from kimi_k3_moe.weights.requant import to_format

ENV_SELF_CHECK = settings.SELF_CHECK
MODES = settings.SELF_CHECK_MODES
# bf16 activations and intermediate against an fp32 reference on the same
# weights land near 4e-3; a wrong layout or a wrong activation lands above 0.1.
# Quantized activations against the same quantization in the reference: the
# same, bar the rare element whose code flips on a summation-order difference.
TOLERANCE = 3e-2


class SelfCheckFailed(RuntimeError):
    pass


def self_check_mode(env=None) -> str:
    return settings.choice(ENV_SELF_CHECK, env)


def run_self_check(
    backend: MoEBackend,
    experts: Mxfp4Experts | Int4Experts,
    activation: ActivationSpec,
    *,
    num_experts: int = 4,
    num_tokens: int = 19,
    seed: int = 1234,
) -> float:
    """Relative L2 error of `backend` on a slice of `experts`; raises SelfCheckFailed above TOLERANCE."""
    device = experts.device
    n = min(num_experts, experts.num_experts)
    picked = torch.linspace(0, experts.num_experts - 1, n).round().long().unique()
    n = picked.numel()
    sliced = to_format(experts.select(picked.to(device)), backend.format, backend.describe())
    prepared = backend.prepare(sliced)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    top_k = min(2, n)
    ids = torch.stack([torch.randperm(n, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    hidden = torch.randn(num_tokens, experts.hidden_size, generator=gen).to(torch.bfloat16)
    hidden, ids, weights = hidden.to(device), ids.to(torch.int32).to(device), weights.to(device)
    out = backend.forward(prepared, hidden, weights, ids, activation)
    cache = {}

    def w(e: int, which: int) -> torch.Tensor:
        if e not in cache:
            cache[e] = backend.dequantize_prepared(prepared, e)
        return cache[e][which]

    act_quant = getattr(backend, "act_quant", None) or ActQuant()
    expected = dense_moe(hidden.float(), lambda e: w(e, 0), lambda e: w(e, 1), weights, ids,
                         activation, compute_dtype=torch.float32, act_quant=act_quant)
    err = relative_l2(out.float(), expected)
    if not torch.isfinite(out).all() or not err <= TOLERANCE:
        raise SelfCheckFailed(
            f"backend {backend.describe()} disagrees with the reference on {n} experts x "
            f"{num_tokens} tokens ({activation}, activations {act_quant}): relative L2 {err:.3g} > {TOLERANCE}")
    return err

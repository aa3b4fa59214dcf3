"""Helpers of the FlyDSL suite (imported by its test modules).

Compile checks need flydsl and an ld.lld (toolchain.py); `make test-flydsl` installs
both and sets KIMI_K3_MOE_REQUIRE_FLYDSL=1, which turns a missing toolchain into a
failure instead of a skip.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from moe_helpers import SITU, random_experts, random_ids  # noqa: F401  (SITU: the suite imports it from here)

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.experts import Int4Experts
from kimi_k3_moe.formats import int4

REQUIRE = os.environ.get("KIMI_K3_MOE_REQUIRE_FLYDSL") == "1"
SILU = ActivationSpec.silu()


def toolchain_or_skip():
    """(rocm root) for compile tests; skip (or fail under REQUIRE) when absent."""
    from kimi_k3_moe.kernels.flydsl.toolchain import flydsl_version, rocm_root

    problems = []
    if flydsl_version() is None:
        problems.append("flydsl is not installed")
    for mod in ("ziglang", "numpy"):
        if importlib.util.find_spec(mod) is None:
            problems.append(f"{mod} is not installed")
    root = rocm_root()
    if root is None:
        problems.append("no ld.lld (set KIMI_K3_MOE_FLYDSL_ROCM, or run "
                        "`python -m kimi_k3_moe.kernels.flydsl.toolchain --shim .tools/rocm`)")
    if problems:
        if REQUIRE:
            pytest.fail("FlyDSL toolchain required but " + "; ".join(problems))
        pytest.skip("; ".join(problems))
    return root


def output_dir(tmp_path_factory) -> Path:
    out = os.environ.get("KIMI_K3_MOE_FLYDSL_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        return Path(out)
    return tmp_path_factory.mktemp("flydsl")


def random_layer(gen, *, experts=6, hidden=256, inter=256):
    """MXFP4 experts from scaled Gaussians (stage-1 outputs of a few units, like a real layer)."""
    return random_experts(gen, experts, hidden, inter)


def with_offsets(gen, experts: Int4Experts) -> Int4Experts:
    """The asymmetric int4 variant: a random bf16 offset per group on top of the codes."""
    def add(w):
        off = (torch.randn(w.scales.shape, generator=gen) * w.scales.float()).to(torch.bfloat16)
        return int4.Int4Weights(w.packed, w.scales, w.method, offsets=off)
    return Int4Experts(add(experts.w13), add(experts.w2))


def random_routing(gen, tokens, experts, top_k, hidden):
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).float()   # bf16 values, fp32 out
    ids = random_ids(gen, tokens, experts, top_k)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return x, weights, ids



def kernel_config(arch="gfx942", stage=1, weight_format="int4", N=384, K=3584, top_k=16, *, BM=16,
                  direct_experts=0, activation="silu", betas="const", beta=None, linear_beta=None, reduce="slots",
                  split_k=1, act_dtype="bf16", has_offsets=False, **tile):
    """A FlyKernelConfig from one flat list of choices (tests state many variants this way); `tile`:
    Tile's fields (schedule a config.KLoop)."""
    from kimi_k3_moe.kernels.flydsl.config import Activation, FlyKernelConfig, GemmShape, Reduction, RowBlocks, Tile
    epilogue = Activation(activation, betas, beta, linear_beta) if stage == 1 else Reduction(reduce, split_k)
    return FlyKernelConfig(arch, weight_format, GemmShape(N, K, top_k), epilogue, RowBlocks(BM, direct_experts),
                           Tile(**tile), act_dtype, has_offsets)

"""The tensor-core stage 1 with K split across programs (path "split", and direct with k_split > 1)
under the interpreter, against the float64 reference (bound: test_backend.py's TOL, 1e-2; bf16
activations and intermediate land near 3e-3)."""
from dataclasses import replace

import pytest
import torch
import triton_problems as P
from moe_helpers import SITU

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.experts import Int4Experts
from kimi_k3_moe.formats import int4
from kimi_k3_moe.kernels import get_backend
from kimi_k3_moe.kernels.triton import tickets
from kimi_k3_moe.kernels.triton.table import KernelConfig, KOrder, MoEConfig
from kimi_k3_moe.reference import relative_l2
from kimi_k3_moe.weights.requant import requantize_experts

SILU = ActivationSpec.silu()
TOL = 1e-2
# H = 128 in K steps of 32: k_split 1, 2 and 4 (one step a program); stage 2 the gemv one
SPLIT = MoEConfig("split", 16, KernelConfig(16, 32, 4, 2, k_split=2), KernelConfig(64, 32, 4, 2), "bits")
# the direct path's stage 2 reading inter in pair order, and in plain order (plain-inter)
DIRECT_PAIRS = MoEConfig("direct", 16, KernelConfig(16, 32, 4, 2, k_split=4),
                         KernelConfig(64, 32, 4, 2, order=KOrder.PAIRS), "bits")
DIRECT_PLAIN = replace(DIRECT_PAIRS, stage2=KernelConfig(32, 32, 4, 2, order=KOrder.PLAIN_INTER, n_tiles=2))
CONFIGS = {"split-k1": replace(SPLIT, stage1=replace(SPLIT.stage1, k_split=1)), "split-k2": SPLIT,
           "split-k4-n32": replace(SPLIT, stage1=replace(SPLIT.stage1, block_n=32, k_split=4)),
           "direct-pairs-k4": DIRECT_PAIRS, "direct-plain-inter-k4": DIRECT_PLAIN}


@pytest.fixture(scope="module")
def problem(module_gen):
    ex = P.experts(module_gen)
    return ex, requantize_experts(ex, progress=False), module_gen


def _tickets_clear(device="cpu"):
    return not tickets.tickets(device).any()


@pytest.mark.parametrize("weight_format", ["mxfp4", "int4"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_split_stage1_matches_the_reference_and_the_activation(weight_format, name, problem):
    """Every split config and format computes SiTUv2 and SiLU to the reference, the two differ, a
    second run gives the same bits, and every ticket is back at zero."""
    ex, conv, gen = problem
    backend = get_backend("triton", weight_format=weight_format, config=CONFIGS[name])
    prepared = backend.prepare(ex if weight_format == "mxfp4" else conv)
    hidden = P.hidden(gen, 3)
    weights, ids = P.routing(gen, 3)
    outs = {}
    for act in (SITU, SILU):
        outs[act.name] = P.run(backend, prepared, hidden, weights, ids, act)
        err = relative_l2(outs[act.name], P.reference(backend, prepared, hidden, weights, ids, act))
        assert err < TOL, f"{weight_format} {name} {act}: relative L2 {err:.3g}"
        assert _tickets_clear()
    assert relative_l2(outs["silu"], outs["situv2"].float()) > 0.05
    assert torch.equal(P.run(backend, prepared, hidden, weights, ids, SITU), outs["situv2"])


@pytest.mark.parametrize("name", ["split-k2", "direct-pairs-k4"])
def test_split_stage1_with_an_expert_map(name, problem):
    """Slots of other ranks are skipped (their programs take no ticket); a token with none here gets 0."""
    ex, _, gen = problem
    backend = get_backend("triton", config=CONFIGS[name])
    prepared = backend.prepare(ex.select(torch.tensor([0, 2, 4])))
    emap = torch.full((9,), -1, dtype=torch.int32)
    emap[torch.tensor([2, 3, 7])] = torch.arange(3, dtype=torch.int32)
    hidden = P.hidden(gen, 4)
    weights, ids = P.routing(gen, 4, e=9)
    ids[0] = torch.tensor([0, 1, 4], dtype=ids.dtype)  # no slot of token 0 is local
    out = P.run(backend, prepared, hidden, weights, ids, SITU, emap)
    assert relative_l2(out, P.reference(backend, prepared, hidden, weights, ids, SITU, emap)) < TOL
    assert not out[0].any() and _tickets_clear()


def test_split_stage1_with_int4_offsets(problem):
    ex, conv, gen = problem
    off = Int4Experts(*(int4.Int4Weights(w.packed, w.scales, "asym",
                                         (torch.randn(w.scales.shape, generator=gen) * 0.02).bfloat16())
                        for w in (conv.w13, conv.w2)))
    backend = get_backend("triton", weight_format="int4", int4_method="asym", config=SPLIT)
    prepared = backend.prepare(off)
    hidden = P.hidden(gen, 2)
    weights, ids = P.routing(gen, 2)
    out = P.run(backend, prepared, hidden, weights, ids, SITU)
    assert relative_l2(out, P.reference(backend, prepared, hidden, weights, ids, SITU)) < TOL


def test_k_split_is_checked_and_kept_out_of_other_configs_json():
    with pytest.raises(ValueError, match="k_split: only stage 1 of paths split and direct"):
        replace(P.ALIGNED, stage1=replace(P.ALIGNED.stage1, k_split=2)).validate(128, 64)
    with pytest.raises(ValueError, match=r"stage1.k_split = 3: K = 128 must split into whole block_k steps"):
        replace(SPLIT, stage1=replace(SPLIT.stage1, k_split=3)).validate(128, 64)
    assert "k_split" not in P.GEMV.to_json()["stage1"]
    assert MoEConfig.from_json(SPLIT.to_json()) == SPLIT
    with pytest.raises(ValueError, match="more than its"):
        tickets.tickets("cpu", tickets.CAPACITY + 1)

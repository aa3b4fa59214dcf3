"""The reference MoE and the torch backend against an independent float64 loop."""
import pytest
import torch
from moe_helpers import SITU, random_experts, random_routing

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.experts import Mxfp4Experts
from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.kernels import get_backend
from kimi_k3_moe.loading import prepare_for
from kimi_k3_moe.reference import moe_forward, relative_l2
from kimi_k3_moe.weights.requant import requantize_experts

SILU = ActivationSpec.silu()


def loop_float64(hidden, w13, w2, weights, ids, beta, linear_beta, silu=False):
    """Token by token, slot by slot, with the activation written out again."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    i = w2.shape[-1]
    for t in range(hidden.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            y = w13[e].double() @ hidden[t].double()
            g, u = y[:i], y[i:]
            if silu:
                act = g * torch.sigmoid(g) * u
            else:
                act = beta * torch.tanh(g / beta) * torch.sigmoid(g) * linear_beta * torch.tanh(u / linear_beta)
            out[t] += float(weights[t, s]) * (w2[e].double() @ act)
    return out


def dense(experts):
    return (mxfp4.dequantize(experts.w13_packed, experts.w13_scale),
            mxfp4.dequantize(experts.w2_packed, experts.w2_scale))


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_reference_matches_float64_loop(gen, tokens):
    experts = random_experts(gen, e=6)
    weights, ids = random_routing(gen, tokens, experts.num_experts, 3, normalize=True)
    hidden = torch.randn(tokens, experts.hidden_size, generator=gen, dtype=torch.float64)
    expected = loop_float64(hidden, *dense(experts), weights, ids, 4.0, 25.0)
    got = moe_forward(hidden, *experts.tensors(), weights, ids, SITU, compute_dtype=torch.float64)
    assert relative_l2(got, expected) < 1e-12
    got32 = moe_forward(hidden.float(), *experts.tensors(), weights, ids, SITU)
    assert relative_l2(got32, expected) < 1e-5


@pytest.mark.parametrize("weight_format", ["mxfp4", "int4"])
def test_torch_backend_matches_loop_and_honours_activation(gen, weight_format):
    experts = random_experts(gen, e=6)
    backend = get_backend("torch", weight_format=weight_format)
    prepared = prepare_for(backend, experts)
    if weight_format == "int4":
        q = requantize_experts(experts, progress=False)
        w13, w2 = q.w13.dequantize(), q.w2.dequantize()
    else:
        w13, w2 = dense(experts)
    weights, ids = random_routing(gen, 17, experts.num_experts, 2, normalize=True)
    hidden = torch.randn(17, experts.hidden_size, generator=gen).to(torch.bfloat16)
    expected = loop_float64(hidden, w13, w2, weights, ids, 4.0, 25.0)
    expected_silu = loop_float64(hidden, w13, w2, weights, ids, 4.0, 25.0, silu=True)
    out = backend.forward(prepared, hidden, weights, ids, SITU)
    assert out.dtype == torch.bfloat16
    assert relative_l2(out, expected) < 1e-2
    assert relative_l2(out, expected_silu) > 0.1  # a path ignoring the activation fails here
    assert relative_l2(backend.forward(prepared, hidden, weights, ids, SILU), expected_silu) < 1e-2


def float64_layer(gen, tokens, e=8, k=3, **shape):
    """(experts, router weights, ids, float64 hidden, the float64 MoE output of the whole layer)."""
    experts = random_experts(gen, e=e, **shape)
    weights, ids = random_routing(gen, tokens, e, k, normalize=True)
    hidden = torch.randn(tokens, experts.hidden_size, generator=gen, dtype=torch.float64)
    return experts, weights, ids, hidden, moe_forward(hidden, *experts.tensors(), weights, ids, SITU,
                                                      compute_dtype=torch.float64)


def test_tensor_parallel_partials_sum_to_full(gen):
    experts, weights, ids, hidden, full = float64_layer(gen, 9, e=6, i=64)
    tp, part = 2, experts.intermediate_size // 2
    total = torch.zeros_like(full)
    for rank in range(tp):
        rows = torch.cat([torch.arange(rank * part, (rank + 1) * part),
                          experts.intermediate_size + torch.arange(rank * part, (rank + 1) * part)])
        shard = Mxfp4Experts(experts.w13_packed[:, rows], experts.w13_scale[:, rows],
                              experts.w2_packed[..., rank * part // 2:(rank + 1) * part // 2],
                              experts.w2_scale[..., rank * part // 32:(rank + 1) * part // 32])
        total += moe_forward(hidden, *shard.tensors(), weights, ids, SITU, compute_dtype=torch.float64)
    assert relative_l2(total, full) < 1e-12


def test_expert_parallel_partials_sum_to_full(gen):
    experts, weights, ids, hidden, full = float64_layer(gen, 11)
    owned = [[0, 3, 5], [1, 2, 4, 6, 7]]
    total = torch.zeros_like(full)
    backend = get_backend("torch")
    for mine in owned:
        expert_map = torch.full((8,), -1, dtype=torch.int32)
        expert_map[mine] = torch.arange(len(mine), dtype=torch.int32)
        local = experts.select(mine)
        total += moe_forward(hidden, *local.tensors(), weights, ids, SITU, expert_map,
                             compute_dtype=torch.float64)
        part = backend.forward(backend.prepare(local), hidden.float(), weights, ids, SITU, expert_map)
        assert part.abs().sum() > 0
    assert relative_l2(total, full) < 1e-12


def test_negative_ids_are_remote_with_or_without_a_map(gen):
    """SGLang's EP dispatcher hands over local ids with -1 for experts on other ranks."""
    experts, weights, ids, hidden, full = float64_layer(gen, 9)
    backend = get_backend("torch")
    total = torch.zeros_like(full)
    for mine in ([0, 3, 5], [1, 2, 4, 6, 7]):
        global_to_local = torch.full((8,), -1, dtype=torch.int32)
        global_to_local[mine] = torch.arange(len(mine), dtype=torch.int32)
        local_ids = global_to_local[ids.long()]  # what the dispatcher passes on
        assert (local_ids < 0).any()
        local = experts.select(mine)
        part = moe_forward(hidden, *local.tensors(), weights, local_ids, SITU, compute_dtype=torch.float64)
        # An identity map over local slots must not wrap -1 round to the last expert.
        identity = torch.arange(len(mine), dtype=torch.int32)
        mapped = moe_forward(hidden, *local.tensors(), weights, local_ids, SITU, identity,
                             compute_dtype=torch.float64)
        assert relative_l2(mapped, part) < 1e-12
        torch_part = backend.forward(backend.prepare(local), hidden.float(), weights, local_ids, SITU)
        assert relative_l2(torch_part, part) < 1e-5
        total += part
    assert relative_l2(total, full) < 1e-12


def test_bad_shapes_are_refused(gen):
    experts = random_experts(gen, e=6)
    weights, ids = random_routing(gen, 4, experts.num_experts, 2, normalize=True)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_forward(torch.zeros(5, 64), *experts.tensors(), weights, ids, SITU)
    with pytest.raises(TypeError, match="topk_ids"):
        moe_forward(torch.zeros(4, 64), *experts.tensors(), weights, ids.float(), SITU)
    with pytest.raises(ValueError, match="w2_packed"):
        Mxfp4Experts(experts.w13_packed, experts.w13_scale, experts.w2_packed[:, :, :-1], experts.w2_scale)
    with pytest.raises(TypeError, match="w13_scale"):
        Mxfp4Experts(experts.w13_packed, experts.w13_scale.float(), experts.w2_packed, experts.w2_scale)

"""The FlashInfer peer's own glue, on the CPU (FlashInfer itself needs an sm_90 GPU and is not installed here):
gate/up order, padding to the SM90 scale blocks, the expert-parallel split, the activation it asks for."""
from __future__ import annotations

import pytest
import torch

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.bench.peers import PEER_NAMES, make_peer
from kimi_k3_moe.bench.peers.base import PeerUnavailable
from kimi_k3_moe.bench.peers.flashinfer import (
    FlashInferPeer,
    _activation_kwargs,
    ep_split,
    pad_to,
    padded_k,
    padded_w13,
    up_gate,
)
from kimi_k3_moe.formats import mxfp4


@pytest.fixture
def gen():
    g = torch.Generator()
    g.manual_seed(torch.seed() % (2**31))
    return g


def _codes(gen, e, n, k):
    return torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)


def _scales(gen, e, n, k):
    return torch.randint(118, 130, (e, n, k // 32), dtype=torch.uint8, generator=gen)


def test_it_is_a_named_peer():
    assert "flashinfer" in PEER_NAMES and isinstance(make_peer("flashinfer"), FlashInferPeer)


def test_fc1_is_up_then_gate(gen):
    inter = 64
    w13 = _codes(gen, 3, 2 * inter, 256)
    fc1 = up_gate(w13, inter)
    assert torch.equal(fc1[:, :inter], w13[:, inter:]) and torch.equal(fc1[:, inter:], w13[:, :inter])


def test_padding_keeps_the_function(gen):
    """TP16's I = 192 padded to 256: zero codes and zero scale bytes decode to exact zeros, so gate and up
    of the padded columns are 0 and their w2 columns multiply nothing."""
    e, h, inter = 2, 256, 192
    p = pad_to(inter, 128)
    assert p == 256 and pad_to(384, 128) == 384 and pad_to(3072, 128) == 3072
    codes, scales = _codes(gen, e, 2 * inter, h), _scales(gen, e, 2 * inter, h)
    pc, ps = padded_w13(up_gate(codes, inter), inter, p), padded_w13(up_gate(scales, inter), inter, p)
    assert pc.shape == (e, 2 * p, h // 2) and ps.shape == (e, 2 * p, h // 32)
    dense = mxfp4.dequantize(pc[0], ps[0], name="fc1")
    want = mxfp4.dequantize(up_gate(codes, inter)[0], up_gate(scales, inter)[0], name="w13")
    assert torch.equal(dense[:inter], want[:inter]) and torch.equal(dense[p:p + inter], want[inter:])
    assert not dense[inter:p].any() and not dense[p + inter:].any()
    w2c, w2s = _codes(gen, e, h, inter), _scales(gen, e, h, inter)
    d2 = mxfp4.dequantize(padded_k(w2c, p // 2)[1], padded_k(w2s, p // 32)[1], name="fc2")
    assert d2.shape == (h, p) and torch.equal(d2[:, :inter], mxfp4.dequantize(w2c[1], w2s[1], name="w2"))
    assert not d2[:, inter:].any()


def test_the_expert_map_must_be_rank_zeros_block():
    emap = torch.full((896,), -1, dtype=torch.int32)
    emap[:56] = torch.arange(56, dtype=torch.int32)
    assert ep_split(None, 896) == (1, 0) and ep_split(emap, 56) == (16, 0)
    shifted = torch.roll(emap, 56)
    with pytest.raises(PeerUnavailable, match="not rank 0's block"):
        ep_split(shifted, 56)


class _Types:
    Swiglu, Situ = "swiglu", "situ"


def test_situ_gets_k3s_betas_per_expert_and_silu_is_swiglu():
    kw = _activation_kwargs(ActivationSpec.situv2(4.0, 25.0), _Types, 56, "cpu")
    assert kw["activation_type"] == "situ" and kw["situ_beta"].shape == (56,)
    assert torch.all(kw["situ_beta"] == 4.0) and torch.all(kw["situ_linear_beta"] == 25.0)
    assert kw["situ_beta"].dtype == torch.float32
    assert _activation_kwargs(ActivationSpec.silu(), _Types, 56, "cpu") == {"activation_type": "swiglu"}
    with pytest.raises(PeerUnavailable, match="linear beta"):
        _activation_kwargs(ActivationSpec.situv2(4.0, None), _Types, 56, "cpu")


def test_the_probe_says_why_not_without_a_gpu():
    ok, why = FlashInferPeer().probe()
    assert not ok and why

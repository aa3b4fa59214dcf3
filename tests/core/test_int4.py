import pytest
import torch

from kimi_k3_moe.formats import int4, mxfp4


def random_mxfp4(gen, experts=3, rows=40, cols=128):
    w = torch.randn(experts, rows, cols, generator=gen) * 0.05
    w[..., 7] *= 20  # an outlier column, as trained weights have
    return mxfp4.quantize(w)


def test_signed_nibbles_roundtrip_all_bytes():
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    codes = int4.unpack_signed(packed)
    assert codes.min() == -8 and codes.max() == 7
    low = packed.to(torch.int16) & 15
    assert torch.equal(codes[:, 0::2].to(torch.int16), torch.where(low > 7, low - 16, low))
    assert torch.equal(int4.pack_signed(codes), packed)


def test_requantize_follows_the_amax_recipe(gen):
    packed, scales = random_mxfp4(gen)
    q = int4.requantize(packed, scales, method="amax")
    assert q.packed.shape == packed.shape and q.scales.shape == scales.shape
    dense = mxfp4.dequantize(packed, scales).unflatten(-1, (-1, 32))
    expected_scale = (dense.abs().amax(-1) / 7).to(torch.bfloat16)
    assert torch.equal(q.scales, expected_scale)
    codes = int4.unpack_signed(q.packed)
    assert codes.abs().max() <= 7
    # Each element sits within half a step (plus the bf16 rounding of the scale) of its source.
    s = q.scales.float().unsqueeze(-1)
    err = (q.dequantize().unflatten(-1, (-1, 32)) - dense).abs()
    assert (err <= s * (0.5 + 7 * 2 ** -8) + 1e-30).all()
    assert torch.equal(q.dequantize(), (codes.float().unflatten(-1, (-1, 32)) * s).flatten(-2))


def test_requantize_error_is_lossy_but_bounded(gen):
    packed, scales = random_mxfp4(gen)
    err = int4.relative_error(packed, scales, int4.requantize(packed, scales, method="amax"))
    assert 0 < err < 0.3


@pytest.mark.parametrize("chunk_bytes", [1, 40 * 128 * 4, 10**9])
def test_chunked_equals_whole_bit_for_bit(gen, chunk_bytes):
    packed, scales = random_mxfp4(gen, experts=5)
    whole = int4.requantize(packed, scales, method="amax", chunk_bytes=10**12)
    chunked = int4.requantize(packed, scales, method="amax", chunk_bytes=chunk_bytes)
    assert torch.equal(whole.packed, chunked.packed) and torch.equal(whole.scales, chunked.scales)


def test_progress_counts_every_expert(gen):
    packed, scales = random_mxfp4(gen, experts=4)
    seen = []
    int4.requantize(packed, scales, chunk_bytes=1, progress=seen.append)
    assert sum(seen) == 4


def test_zero_groups_and_errors():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    scales = torch.full((2, 1), 127, dtype=torch.uint8)
    q = int4.requantize(packed, scales)
    assert torch.equal(q.dequantize(), torch.zeros(2, 32))
    with pytest.raises(ValueError, match="unknown int4 method"):
        int4.requantize(packed, scales, method="magic")
    with pytest.raises(TypeError, match="scales must be bfloat16"):
        int4.Int4Weights(packed, scales)
    with pytest.raises(ValueError, match="NaN"):
        int4.requantize(packed, torch.full((2, 1), 255, dtype=torch.uint8))


def test_offsets_add_per_group(gen):
    packed = torch.randint(0, 256, (3, 32), generator=gen, dtype=torch.uint8)
    scales = torch.rand(3, 2, generator=gen).to(torch.bfloat16)
    offsets = torch.randn(3, 2, generator=gen).to(torch.bfloat16)
    plain = int4.Int4Weights(packed, scales)
    shifted = int4.Int4Weights(packed, scales, "asym", offsets)
    diff = (shifted.dequantize() - plain.dequantize()).unflatten(-1, (-1, 32))
    assert torch.allclose(diff, offsets.float().unsqueeze(-1).expand_as(diff))
    assert shifted.nbytes == plain.nbytes + offsets.numel() * 2
    assert shifted[1:].offsets.shape == (2, 2)
    with pytest.raises(ValueError, match="offsets shape"):
        int4.Int4Weights(packed, scales, "asym", offsets[:, :1])

"""MXFP4 against ml_dtypes' independent e2m1 / e8m0 decoders, bit for bit."""
import ml_dtypes
import numpy as np
import pytest
import torch

from kimi_k3_moe.formats import mxfp4


def ml_decode_codes(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def ml_decode_scales(scales: np.ndarray) -> np.ndarray:
    return scales.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)


def independent_dequantize(packed: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    p = packed.numpy()
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)
    values = ml_decode_codes(codes)
    return values * np.repeat(ml_decode_scales(scales.numpy()), 32, axis=-1)


def same_bits(a: torch.Tensor, b: np.ndarray) -> bool:
    b = torch.from_numpy(np.ascontiguousarray(b)).to(torch.float32)
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_all_256_bytes_decode_like_ml_dtypes():
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    scales = torch.full((16, 1), 127, dtype=torch.uint8)  # 2^0
    out = mxfp4.dequantize(packed, scales)
    assert same_bits(out, independent_dequantize(packed, scales))  # signed zeros included


def test_all_scale_bytes_decode_like_ml_dtypes():
    scales = torch.arange(255, dtype=torch.uint8)
    assert same_bits(mxfp4.e8m0_to_float(scales), ml_decode_scales(scales.numpy()))


def test_nan_scale_byte_is_refused_unless_asked_for():
    packed = torch.zeros(2, 16, dtype=torch.uint8) + 0x21
    scales = torch.tensor([[127], [255]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"w13\[3\] scales holds 1 NaN"):
        mxfp4.dequantize(packed, scales, name="w13[3]")
    out = mxfp4.dequantize(packed, scales, allow_nan=True)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()


def test_random_codes_and_scales_match_independent_decoder(gen):
    packed = torch.randint(0, 256, (8, 5, 64), generator=gen, dtype=torch.uint8)
    scales = torch.randint(90, 160, (8, 5, 4), generator=gen, dtype=torch.uint8)
    assert same_bits(mxfp4.dequantize(packed, scales), independent_dequantize(packed, scales))


def _representable(gen, shape):
    """Values decoded from random codes whose block maximum makes the OCP rule pick their scale."""
    packed = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    codes = mxfp4.unpack_nibbles(packed).unflatten(-1, (-1, 32))
    lead = torch.randint(0, 32, codes.shape[:-1], generator=gen)
    big = torch.where(torch.rand(codes.shape[:-1], generator=gen) < 0.5, 6, 7).to(torch.uint8)  # 4 or 6
    big |= (torch.rand(codes.shape[:-1], generator=gen) < 0.5).to(torch.uint8) << 3
    codes.scatter_(-1, lead.unsqueeze(-1), big.unsqueeze(-1))
    packed = mxfp4.pack_nibbles(codes.flatten(-2))
    scales = torch.randint(1, 250, (*shape[:-1], shape[-1] // 16), generator=gen, dtype=torch.uint8)
    return mxfp4.dequantize(packed, scales)


def test_quantize_inverts_dequantize_on_representable_values(gen):
    x = _representable(gen, (6, 7, 48))
    packed, scales = mxfp4.quantize(x)
    assert torch.equal(mxfp4.dequantize(packed, scales), x)


def test_quantize_rounds_like_ml_dtypes(gen):
    x = torch.randn(64, 256, generator=gen) * torch.exp(torch.randn(64, 1, generator=gen) * 3)
    x[0, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) * 0.5  # ties
    packed, scales = mxfp4.quantize(x)
    blocks = x.double().numpy().reshape(64, 8, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    shared = np.floor(np.log2(amax)) - 2
    scaled = (blocks / 2.0 ** shared).astype(np.float32)
    expected = scaled.astype(ml_dtypes.float4_e2m1fn).astype(np.float64) * 2.0 ** shared
    assert np.array_equal(mxfp4.dequantize(packed, scales).double().numpy(), expected.reshape(64, 256))
    assert np.array_equal(scales.numpy(), (shared[..., 0] + 127).astype(np.uint8))


def test_all_zero_block_and_extremes():
    x = torch.zeros(1, 64)
    x[0, 32:] = 1e-30
    packed, scales = mxfp4.quantize(x)
    assert torch.equal(mxfp4.dequantize(packed, scales)[0, :32], torch.zeros(32))
    assert torch.isfinite(mxfp4.dequantize(packed, scales)).all()


@pytest.mark.parametrize("bad,match", [
    (lambda: mxfp4.quantize(torch.ones(2, 30)), "multiple of 32"),
    (lambda: mxfp4.quantize(torch.tensor([[float("nan")] * 32])), "non-finite"),
    (lambda: mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)),
     "scales shape"),
    (lambda: mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8)),
     "uint8"),
])
def test_bad_inputs_are_named(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        bad()


def test_pack_unpack_roundtrip(gen):
    packed = torch.randint(0, 256, (3, 50), generator=gen, dtype=torch.uint8)
    codes = mxfp4.unpack_nibbles(packed)
    assert torch.equal(codes[:, 0], packed[:, 0] & 15) and torch.equal(codes[:, 1], packed[:, 0] >> 4)
    assert torch.equal(mxfp4.pack_nibbles(codes), packed)

"""FP8 e4m3fn activations against ml_dtypes' independent codec, bit for bit.

Quantized data is compared after decoding (or code for code as uint8 arrays
from two independent encoders), never by reinterpreting packed bytes as floats.
"""
import ml_dtypes
import numpy as np
import pytest
import torch

from kimi_k3_moe.formats import fp8, mxfp4


def ml_encode(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def ml_decode(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def test_all_256_codes_decode_like_ml_dtypes():
    codes = torch.arange(256, dtype=torch.uint8)
    ours = fp8.decode(codes).double().numpy()
    theirs = ml_decode(codes.numpy())
    assert np.array_equal(np.isnan(ours), np.isnan(theirs)) and np.isnan(ours).sum() == 2
    finite = ~np.isnan(ours)
    assert np.array_equal(ours[finite], theirs[finite])
    assert np.array_equal(np.signbit(ours[finite]), np.signbit(theirs[finite]))   # -0 at 0x80


def test_every_finite_code_round_trips():
    codes = torch.tensor([c for c in range(256) if c not in fp8.NAN_CODES], dtype=torch.uint8)
    assert torch.equal(fp8.encode(fp8.decode(codes)), codes)


def test_encode_rounds_like_ml_dtypes_including_ties_and_subnormals(gen):
    x = torch.randn(1 << 16, generator=gen) * torch.exp2(torch.randint(-14, 9, (1 << 16,), generator=gen).float())
    grid = fp8.decode(torch.arange(0, 0x7F, dtype=torch.uint8)).double()
    ties = ((grid[1:] + grid[:-1]) / 2).float()                   # exact midpoints (float32)
    x = torch.cat([x, ties, -ties, torch.tensor([0.0, -0.0, 2.0 ** -10, 2.0 ** -11, 447.9, 448.0, -448.0])])
    x = x[x.abs() <= fp8.E4M3_MAX]                                 # ml_dtypes turns overflow into NaN
    assert np.array_equal(fp8.encode(x).numpy(), ml_encode(x.numpy()))


def test_encode_saturates_instead_of_overflowing():
    x = torch.tensor([464.0, 1e6, -500.0, 449.0])
    assert fp8.decode(fp8.encode(x)).tolist() == [448.0, 448.0, -448.0, 448.0]
    with pytest.raises(ValueError, match="non-finite"):
        fp8.encode(torch.tensor([float("inf")]))


def test_mx_scale_is_the_smallest_power_of_two_that_clips_nothing(gen):
    amax = torch.rand(4096, generator=gen) * torch.exp2(torch.randint(-100, 100, (4096,), generator=gen).float())
    amax = torch.cat([amax, torch.tensor([448.0, 448.0 * 1.0000001, 1.75, 1.7500001, 0.0, 1e-40])])
    b = fp8.mx_scale_bytes(amax).long()
    scaled = amax.double() * 2.0 ** (127 - b.double())
    assert (scaled <= 448).all()
    normal = (amax >= 2.0 ** -126) & (b > 0)
    assert (scaled[normal] * 2 > 448).all()                      # one power of two less would clip
    assert b[-2] == 0 and b[-1] == 0                             # zero and subnormal blocks


def test_quantize_mx_matches_an_independent_encoder(gen):
    x = torch.randn(16, 256, generator=gen) * torch.exp(torch.randn(16, 1, generator=gen) * 4)
    codes, scales = fp8.quantize_mx(x)
    assert codes.shape == x.shape and scales.shape == (16, 8) and codes.dtype == scales.dtype == torch.uint8
    blocks = x.numpy().astype(np.float64).reshape(16, 8, 32)
    b = np.ceil(np.log2(np.abs(blocks).max(-1, keepdims=True) / 448.0))
    assert np.array_equal(scales.numpy().astype(np.int64), (b[..., 0] + 127).astype(np.int64))
    expected = ml_encode((blocks * 2.0 ** -b).astype(np.float32)).reshape(16, 256)
    assert np.array_equal(codes.numpy(), expected)
    values = fp8.dequantize_mx(codes, scales).double().numpy()
    assert np.array_equal(values, (ml_decode(expected).reshape(16, 8, 32) * 2.0 ** b).reshape(16, 256))


def test_quantize_per_token_matches_an_independent_encoder(gen):
    x = torch.randn(9, 96, generator=gen) * torch.exp(torch.randn(9, 1, generator=gen) * 3)
    x[3] = 0
    codes, scales = fp8.quantize_per_token(x)
    assert scales.dtype == torch.float32 and scales.shape == (9, 1) and scales[3, 0] == 1
    x32 = x.numpy()
    s = np.where(np.abs(x32).max(-1, keepdims=True) > 0, np.abs(x32).max(-1, keepdims=True) / np.float32(448),
                 np.float32(1)).astype(np.float32)
    assert np.array_equal(codes.numpy(), ml_encode(x32 / s))
    assert np.array_equal(fp8.dequantize_per_token(codes, scales).numpy(),
                          ml_decode(ml_encode(x32 / s)).astype(np.float32) * s)


@pytest.mark.parametrize("weight_format, bound", [("mx", 2 ** -4), ("token", 2 ** -4)])
def test_relative_error_per_element_within_half_an_ulp(gen, weight_format, bound):
    """Normal-range elements: |q - x| <= 2^-4 |x| (3 mantissa bits, round to nearest)."""
    x = torch.randn(64, 128, generator=gen)
    if weight_format == "mx":
        q = fp8.dequantize_mx(*fp8.quantize_mx(x))
        tiny = x.abs() < 2.0 ** -6 * fp8.e4m3_table()[0x7E] / 448   # conservative: skip near-subnormals
    else:
        q = fp8.dequantize_per_token(*fp8.quantize_per_token(x))
        tiny = x.abs() < x.abs().amax(-1, keepdim=True) * 2.0 ** -14
    rel = ((q - x).abs() / x.abs())[~tiny]
    assert rel.max() <= bound


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="hidden: last dim 30"):
        fp8.quantize_mx(torch.ones(2, 30), name="hidden")
    with pytest.raises(TypeError, match="uint8"):
        fp8.decode(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(ValueError, match="scales shape"):
        fp8.dequantize_mx(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))


def test_mxfp4_activation_rows_use_the_weight_codec(gen):
    """MXFP4 activations are formats.mxfp4.quantize per row: one e8m0 byte per 32 along K."""
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16)
    packed, scales = mxfp4.quantize(x.float())
    assert packed.shape == (5, 64) and scales.shape == (5, 4)
    err = (mxfp4.dequantize(packed, scales) - x.float()).norm() / x.float().norm()
    assert 0.05 < err < 0.2


def test_encode_does_not_trust_device_powers_of_two(gen, monkeypatch):
    """On CUDA torch.ldexp / pow(2, k) can be an ulp off; encode and the code table build their powers
    of two from bits, so codes and values are the same whatever those functions return (an H200 run
    of the reference quantizer before this was off by one code almost everywhere)."""
    x = torch.randn(64, 256, generator=gen) * 10
    want = fp8.encode(x)
    table = fp8.e4m3_table()
    real_ldexp, real_pow = torch.ldexp, torch.pow
    monkeypatch.setattr(torch, "ldexp", lambda a, e: real_ldexp(a, e) * (1 - 2.0 ** -52))
    monkeypatch.setattr(torch, "pow", lambda a, e: real_pow(a, e) * (1 - 2.0 ** -52))
    assert torch.equal(fp8.encode(x), want)
    assert torch.allclose(fp8.e4m3_table(), table, rtol=0, atol=0, equal_nan=True)

"""The error-minimising int4 conversions ("search", "asym") against the amax/7 recipe.

Every comparison here is between two conversions of the same groups, in
float64, group by group; no error is compared with a constant.
"""
import pytest
import torch

from kimi_k3_moe.formats import int4, int4_fit, mxfp4


def group_errors(packed, scales, converted):
    """Squared error of each group of 32 against the MXFP4 values, float64."""
    ref = mxfp4.dequantize(packed, scales).double()
    return ((converted.dequantize().double() - ref) ** 2).unflatten(-1, (-1, 32)).sum(-1)


def adversarial_groups(gen):
    """Rows of one group each: codes [n, 32] and scale bytes [n]."""
    rows = []
    rows.append(torch.zeros(32, dtype=torch.uint8))                 # all zero
    rows.append(torch.full((32,), 8, dtype=torch.uint8))            # all -0
    for code in range(16):
        rows.append(torch.full((32,), code, dtype=torch.uint8))     # all codes equal
    for big in (7, 15):                                             # max magnitude, either sign
        single = torch.zeros(32, dtype=torch.uint8)
        single[int(torch.randint(32, (1,), generator=gen))] = big   # a single outlier
        rows.append(single)
        small = torch.randint(0, 3, (32,), generator=gen, dtype=torch.uint8)
        small[5] = big                                              # outlier over small codes
        rows.append(small)
        rows.append(torch.full((32,), big, dtype=torch.uint8))
        alternating = torch.tensor([7, 15] * 16, dtype=torch.uint8)
        rows.append(alternating)                                    # +-6 alternating
    rows.append(torch.tensor([c for c in range(16)] * 2, dtype=torch.uint8))  # every code
    codes = torch.stack(rows)
    return codes


def pack_groups(codes, scale_bytes):
    return mxfp4.pack_nibbles(codes), scale_bytes.unsqueeze(1).to(torch.uint8)


def random_groups(gen, n):
    codes = torch.randint(0, 16, (n, 32), generator=gen, dtype=torch.uint8)
    return codes


@pytest.mark.parametrize("method", ["search", "asym"])
def test_never_worse_than_amax_on_any_group(gen, method):
    adversarial = adversarial_groups(gen)
    codes = torch.cat([adversarial, random_groups(gen, 2000)])
    # Typical exponents, and extremes that take the element-wise fallback.
    exps = torch.randint(100, 140, (codes.shape[0],), generator=gen)
    exps[: adversarial.shape[0]] = 120
    exps[-8:] = torch.tensor([0, 1, 20, 39, 201, 230, 240, 245])
    packed, scales = pack_groups(codes, exps)
    amax = int4.requantize(packed, scales, method="amax")
    fitted = int4.requantize(packed, scales, method=method)
    err_amax = group_errors(packed, scales, amax)
    err_fit = group_errors(packed, scales, fitted)
    worse = (err_fit > err_amax).nonzero().flatten().tolist()
    assert not worse, f"{method} worse than amax on groups {worse[:10]}"
    assert (err_fit < err_amax).any()  # and it does improve somewhere
    # Extreme exponents are converted by the amax recipe itself.
    assert torch.equal(fitted.packed[-8:], amax.packed[-8:]) and torch.equal(fitted.scales[-8:], amax.scales[-8:])


def test_never_worse_on_trained_like_weights(gen):
    w = torch.randn(64, 512, generator=gen) * 0.02
    w[:, 3] *= 12  # a few outlier columns
    w[::7, 100] *= 30
    packed, scales = mxfp4.quantize(w)
    errs = {m: group_errors(packed, scales, int4.requantize(packed, scales, method=m)) for m in int4.METHODS}
    assert (errs["search"] <= errs["amax"]).all()
    assert (errs["asym"] <= errs["search"]).all()  # asym includes the symmetric fit as a candidate
    assert errs["asym"].sum() < errs["search"].sum() < errs["amax"].sum()


def test_search_keeps_the_symmetric_layout_and_asym_adds_offsets(gen):
    w = torch.randn(3, 16, 256, generator=gen)
    packed, scales = mxfp4.quantize(w)
    sym = int4.requantize(packed, scales, method="search")
    asym = int4.requantize(packed, scales, method="asym")
    assert sym.offsets is None and sym.method == "search"
    assert asym.offsets is not None and asym.offsets.dtype == torch.bfloat16
    assert asym.offsets.shape == asym.scales.shape and asym.method == "asym"
    codes = int4.unpack_signed(asym.packed).float().unflatten(-1, (-1, 32))
    s, o = asym.scales.float().unsqueeze(-1), asym.offsets.float().unsqueeze(-1)
    # q * s is exact in fp32 and o sits on a grid that keeps q * s + o exact: a kernel's
    # fused multiply-add, a separate multiply and add, and float64 all agree bit for bit.
    fma = torch.addcmul(o.expand_as(codes), codes, s.expand_as(codes))
    assert torch.equal(fma, codes * s + o)
    assert torch.equal((codes.double() * s.double() + o.double()).float(), fma)
    assert torch.equal(asym.dequantize(), fma.flatten(-2))


def test_negative_scales_put_the_minus8_code_on_the_positive_side():
    # Largest element +4, the rest on a grid of 0.5 down to -3: exact only as
    # 4 = -8 * -0.5 (a positive 0.5 would need code +8, a coarser grid misses 0.5).
    codes = torch.tensor([[6] + [1, 11, 5, 13, 0] * 6 + [6]], dtype=torch.uint8)  # 4, .5, -1.5, 3, -3, 0
    packed, scales = pack_groups(codes, torch.tensor([127]))
    q = int4.requantize(packed, scales, method="search")
    assert group_errors(packed, scales, q).item() == 0
    assert q.scales.float().item() < 0 and int4.unpack_signed(q.packed)[0, 0] == -8


def test_power_of_two_groups_convert_exactly(gen):
    # Magnitudes <= 3 (positive) and <= 4 (negative) are integers times 2^(E-1).
    allowed = torch.tensor([0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13, 14], dtype=torch.uint8)
    codes = allowed[torch.randint(0, len(allowed), (200, 32), generator=gen)]
    exps = torch.randint(110, 135, (200,), generator=gen)
    packed, scales = pack_groups(codes, exps)
    for method in ("search", "asym"):
        err = group_errors(packed, scales, int4.requantize(packed, scales, method=method))
        assert torch.equal(err, torch.zeros_like(err)), method
    amax_err = group_errors(packed, scales, int4.requantize(packed, scales, method="amax"))
    assert (amax_err > 0).any()


def test_asym_fits_a_shifted_grid_that_no_symmetric_scale_fits():
    # {0.5, 2, 3, 6}: steps of 0.5 from 0.5 to 6 need 12 levels on one side of
    # zero, which a symmetric scale cannot give; an offset of 4.5 can.
    codes = torch.tensor([[1, 4, 5, 7] * 8], dtype=torch.uint8)
    packed, scales = pack_groups(codes, torch.tensor([125]))
    err = {m: group_errors(packed, scales, int4.requantize(packed, scales, method=m)).item()
           for m in int4.METHODS}
    assert err["asym"] == 0 < err["search"] <= err["amax"]


def test_methods_refuse_nan_scales_and_unknown_names():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    for method in ("search", "asym"):
        with pytest.raises(ValueError, match="w13 scales holds 1 NaN"):
            int4.requantize(packed, torch.tensor([[127], [255]], dtype=torch.uint8), method=method, name="w13")
    with pytest.raises(ValueError, match="unknown int4 method 'fancy'"):
        int4.requantize(packed, torch.ones(2, 1, dtype=torch.uint8), method="fancy")


@pytest.mark.parametrize("method", ["search", "asym"])
@pytest.mark.parametrize("chunk_bytes", [1, 3 * 128 * 700, 10**12])
def test_chunked_equals_whole_bit_for_bit(gen, method, chunk_bytes):
    w = torch.randn(5, 24, 128, generator=gen)
    packed, scales = mxfp4.quantize(w)
    whole = int4.requantize(packed, scales, method=method, chunk_bytes=10**12)
    chunked = int4.requantize(packed, scales, method=method, chunk_bytes=chunk_bytes)
    for field in ("packed", "scales", "offsets"):
        a, b = getattr(whole, field), getattr(chunked, field)
        assert (a is None and b is None) or torch.equal(a, b), field


def test_histograms_count_every_code(gen):
    codes = torch.randint(0, 16, (300, 32), generator=gen, dtype=torch.uint8)
    counts = int4_fit.histograms(mxfp4.pack_nibbles(codes))
    bins = torch.tensor(int4_fit.CODE_BIN)[codes.long()]
    expected = torch.zeros(300, int4_fit.NUM_BINS, dtype=torch.int64).scatter_add_(
        1, bins, torch.ones_like(bins))
    assert torch.equal(counts, expected.double())

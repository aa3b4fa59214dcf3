"""The word layout and the PTX decoders, bit for bit, on the CPU (no kernels run)."""
import math
import re

import pytest
import torch

from kimi_k3_moe.experts import Mxfp4Experts
from kimi_k3_moe.formats import int4, mxfp4
from kimi_k3_moe.formats.bf16 import round_once
from kimi_k3_moe.kernels.triton import layout
from kimi_k3_moe.kernels.triton._details import constants as C
from kimi_k3_moe.kernels.triton._details import decode


def all_bytes(rows=4):
    return torch.arange(256, dtype=torch.uint8).repeat(rows, 1)  # [rows, 256]: every byte, every position


@pytest.mark.parametrize("weight_format", layout.WEIGHT_FORMATS)
def test_word_layout_roundtrips(weight_format, gen):
    packed = torch.cat([all_bytes(), torch.randint(0, 256, (4, 256), generator=gen, dtype=torch.uint8)])
    words = layout.to_word_layout(packed, weight_format)
    assert words.shape == packed.shape and words.dtype == torch.uint8
    assert torch.equal(layout.from_word_layout(words, weight_format), packed)
    chunked = layout.to_word_layout(packed.reshape(2, 4, 256), weight_format, chunk_bytes=256)
    assert torch.equal(chunked.reshape(8, 256), words)


def test_word_layout_bit_positions():
    """Element j of a word, set alone to code 0xF, lands where docs/TRITON.md says."""
    mxfp4_mag, mxfp4_sign = (6, 22, 3, 19, 0, 16, 13, 29), (11, 27, 12, 28, 9, 25, 10, 26)
    for j in range(8):
        codes = torch.zeros(8, dtype=torch.uint8)
        codes[j] = 0xF
        packed = mxfp4.pack_nibbles(codes)
        for weight_format, expected in (
            ("mxfp4", (7 << mxfp4_mag[j]) | (1 << mxfp4_sign[j])),
            ("int4", 0xF << (4 * (j // 2) + 16 * (j % 2))),
        ):
            word = layout.to_word_layout(packed, weight_format).view(torch.int32).item() & 0xFFFFFFFF
            assert word == expected, (weight_format, j, hex(word), hex(expected))


# ---------------------------------------------------------------- PTX emulator
def _bf16_to_float(bits: int) -> float:
    return torch.tensor([bits << 16], dtype=torch.int64).to(torch.int32).view(torch.float32).double().item()


def _float_to_bf16(x: float) -> int:
    """PTX's .rn: rounded once (torch's float64 -> bf16 goes through float32: twice)."""
    return round_once(torch.tensor([x], dtype=torch.float64)).view(torch.int16).item() & 0xFFFF


def run_ptx(asm: str, word: int, scale_pair: int = 0, offset_pair: int = 0) -> list[int]:
    """Execute the subset of PTX the decoders use on one word ($8), a bf16x2 scale pair ($9) and
    a bf16x2 offset pair ($10, int4 only); returns the eight 16-bit outputs $0..$7."""
    regs = {"$8": word & 0xFFFFFFFF, "$9": scale_pair & 0xFFFFFFFF, "$10": offset_pair & 0xFFFFFFFF}
    written = set()

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0) & 0xFFFFFFFF

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        unpack = re.fullmatch(r"\{\s*(\$\d)\s*,\s*(\$\d)\s*\}\s*,\s*(\S+)", rest)
        if op == "mov.b32" and unpack:
            lo, hi, src = unpack.groups()
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            written |= {lo, hi}
            continue
        args = [a.strip() for a in rest.split(",")]
        d, srcs = args[0], [val(a) for a in args[1:]]
        assert not (set(a.strip() for a in args[1:]) & written), "an input read after an output was written"
        if op == "mov.b32":
            r = srcs[0]
        elif op == "shl.b32":
            r = srcs[0] << srcs[1]
        elif op == "shr.u32":
            r = srcs[0] >> srcs[1]
        elif op == "and.b32":
            r = srcs[0] & srcs[1]
        elif op == "or.b32":
            r = srcs[0] | srcs[1]
        elif op == "xor.b32":
            r = srcs[0] ^ srcs[1]
        elif op == "fma.rn.bf16x2":
            r = 0
            for half in (0, 16):
                a, b, c = ((x >> half) & 0xFFFF for x in srcs)
                exact = _bf16_to_float(a) * _bf16_to_float(b) + _bf16_to_float(c)
                r |= _float_to_bf16(exact) << half
        else:
            raise AssertionError(f"emulator lacks {op}")
        assert d not in ("$8", "$9", "$10"), "the decoder writes an input register"
        regs[d] = r & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(8)]


def _pair(bits: int) -> int:
    return bits | (bits << 16)


@pytest.mark.parametrize("wide", [False, True], ids=["scales-to-2", "wide-scales"])
def test_ptx_mxfp4_decoder_gives_every_code_exactly(wide, gen):
    """Both PTX variants against the float table, with the factor the kernel passes in $9: the
    one-multiply decoder for e8m0 bytes up to MXFP4_FOLD_MAX_SCALE, the two-multiply one for any."""
    codes = torch.cat([torch.arange(16, dtype=torch.uint8).repeat_interleave(8).reshape(16, 8),
                       torch.randint(0, 16, (48, 8), generator=gen, dtype=torch.uint8)])
    words = layout._words_from_codes(codes, "mxfp4").view(torch.int32).reshape(-1)
    top = 254 if wide else C.MXFP4_FOLD_MAX_SCALE
    edges = [0, 1, 2, 127, 128] + ([129, 200, 252, 254] if wide else [126])
    scale_bytes = torch.cat([torch.tensor(edges), torch.randint(100, top + 1, (64 - len(edges),), generator=gen)])
    asm = (decode.E2M1_WIDE_WORD_PTX if wide else decode.E2M1_WORD_PTX).value
    for word, row, b in zip(words.tolist(), codes, scale_bytes.tolist()):
        # what decode_weight_raw passes in $9
        factor = _pair(0x40 if b == 0 else b << 7) if wide else b * 0x00800080 + 0x3F003F00
        got = [_bf16_to_float(v) for v in run_ptx(asm, word, factor)]
        scale = mxfp4.e8m0_to_float(torch.tensor([b], dtype=torch.uint8)).double()
        want = (mxfp4.e2m1_table()[row.long()].double() * scale).bfloat16().double().tolist()
        assert got == want, (hex(word & 0xFFFFFFFF), b, got, want)
        assert all(math.copysign(1, g) == math.copysign(1, w) for g, w in zip(got, want) if g == 0)


def test_one_multiply_factor_is_a_normal_bf16_exactly_up_to_the_fold_limit():
    for b in range(C.MXFP4_FOLD_MAX_SCALE + 1):
        f = b * 0x00800080 + 0x3F003F00
        assert f >> 16 == f & 0xFFFF and _bf16_to_float(f & 0xFFFF) == 2.0 ** (b - 1), b
    assert (C.MXFP4_FOLD_MAX_SCALE + 127) << 7 == 0x7F80  # the next byte's factor would be inf


def test_layout_bits_tile_the_word_and_give_each_pair_its_bf16_bits():
    """Every bit of a word belongs to one element; pair j's shift puts both its magnitudes at bf16
    bits 6-8 and both signs at bit 15 (what E2M1_WORD_PTX's shifts assume)."""
    bits = sorted([m + i for m in C.MXFP4_MAG_BIT for i in range(3)] + list(C.MXFP4_SIGN_BIT))
    assert bits == list(range(32))
    mag_shift, sign_shift = (0, 3, 6, -7), (4, 3, 6, 5)  # shl, or shr when negative
    for j in range(4):
        for half, e in ((0, 2 * j), (16, 2 * j + 1)):
            assert C.MXFP4_MAG_BIT[e] + mag_shift[j] == 6 + half
            assert C.MXFP4_SIGN_BIT[e] + sign_shift[j] == 15 + half


@pytest.mark.parametrize("asym", [False, True], ids=["symmetric", "offsets"])
def test_ptx_int4_decoder_scales_every_code_with_one_rounding(asym, gen):
    """q * s (+ o) rounded once to bf16; symmetric (offset -0.0) equals the fp32 path bit for bit."""
    codes = torch.cat([torch.arange(16, dtype=torch.uint8).repeat_interleave(8).reshape(16, 8),
                       torch.randint(0, 16, (112, 8), generator=gen, dtype=torch.uint8)])
    words = layout._words_from_codes(codes, "int4").view(torch.int32).reshape(-1)
    # scales with full mantissas (q * s then needs rounding), both signs (`search` picks negative
    # scales to reach the -8 code), zeros, a subnormal
    scales = torch.cat([torch.tensor([0.0, 1e-39, 1.0, -0.0]), torch.randn(124, generator=gen) * 3e-3]).bfloat16()
    offsets = (torch.randn(128, generator=gen) * 1e-2).bfloat16() if asym else None
    neg_zero = 0x8000
    for i, (word, row) in enumerate(zip(words.tolist(), codes)):
        s_bits = scales[i:i + 1].view(torch.int16).item() & 0xFFFF
        o_bits = offsets[i:i + 1].view(torch.int16).item() & 0xFFFF if asym else neg_zero
        got = [_bf16_to_float(v) for v in run_ptx(decode.INT4_WORD_PTX.value, word, _pair(s_bits), _pair(o_bits))]
        q = int4.unpack_signed(mxfp4.pack_nibbles(row)).double()
        exact = q * scales[i].double() + (offsets[i].double() if asym else 0.0)
        want = round_once(exact).double().tolist()
        assert got == want, (hex(word & 0xFFFFFFFF), scales[i].item(), got, want)
        if not asym:  # the DECODE_BITS path: fp32 q * s, then bf16
            fp32_path = (q.float() * scales[i].float()).bfloat16().double().tolist()
            assert got == fp32_path
            assert all(math.copysign(1, g) == math.copysign(1, w) for g, w in zip(got, fp32_path) if g == 0)


def test_ptx_int4_decoder_rounds_once_where_float32_rounds_twice():
    """7 * (37 * 2^-10) = 259 * 2^-10 is a bf16 tie; an offset of -2^-30 puts the exact value below it,
    so bf16 is 258 * 2^-10. float32 cannot hold the sum (29 bits) and rounds onto the tie, which
    then goes to even, 260 * 2^-10: the portable decoder's documented double rounding."""
    word = layout._words_from_codes(torch.full((1, 8), 7, dtype=torch.uint8), "int4").view(torch.int32).item()
    s = torch.tensor([37 * 2.0 ** -10]).bfloat16()
    o = torch.tensor([-2.0 ** -30]).bfloat16()
    bits = [t.view(torch.int16).item() & 0xFFFF for t in (s, o)]
    got = [_bf16_to_float(v) for v in run_ptx(decode.INT4_WORD_PTX.value, word, _pair(bits[0]), _pair(bits[1]))]
    exact = torch.tensor([7 * 37 * 2.0 ** -10 - 2.0 ** -30], dtype=torch.float64)
    assert got == [258 * 2.0 ** -10] * 8 == round_once(exact).double().tolist() * 8
    assert exact.float().bfloat16().item() == 260 * 2.0 ** -10 == exact.bfloat16().item()


def test_prepared_experts_decode_to_their_source(gen):
    w13 = torch.randn(3, 64, 96, generator=gen)
    w2 = torch.randn(3, 96, 32, generator=gen)
    experts = Mxfp4Experts(*mxfp4.quantize(w13), *mxfp4.quantize(w2))
    prepared = layout.from_mxfp4(*experts.tensors())
    conv = int4.requantize(experts.w13_packed, experts.w13_scale), int4.requantize(experts.w2_packed, experts.w2_scale)
    off = [int4.Int4Weights(c.packed, c.scales, "test", (torch.randn(c.scales.shape, generator=gen) * 0.1).bfloat16())
           for c in conv]
    prepared_int4 = layout.from_int4(*off)
    for e in range(3):
        for got, want in zip(prepared.dequantize(e), experts.dequantize(e)):
            assert torch.equal(got, want)
        assert torch.equal(prepared_int4.dequantize(e)[0], off[0][e].dequantize())
        assert torch.equal(prepared_int4.dequantize(e)[1], off[1][e].dequantize())


def test_prepared_experts_validate_shapes():
    experts = layout.from_mxfp4(torch.zeros(2, 64, 32, dtype=torch.uint8), torch.zeros(2, 64, 2, dtype=torch.uint8),
                                torch.zeros(2, 64, 16, dtype=torch.uint8), torch.zeros(2, 64, 1, dtype=torch.uint8))
    assert experts.hidden_size == 64 and experts.intermediate_size == 32
    with pytest.raises(ValueError, match="w13_scale"):
        layout.TritonExperts("mxfp4", experts.w13, experts.w13_scale[:, :, :1], experts.w2, experts.w2_scale)
    with pytest.raises(ValueError, match="offsets"):
        layout.TritonExperts("mxfp4", experts.w13, experts.w13_scale, experts.w2, experts.w2_scale,
                             experts.w13_scale, experts.w2_scale)


def test_wide_scales_is_read_once_from_the_scales_at_prepare(gen):
    """The one-multiply decoder serves a layer only when every e8m0 byte is <= MXFP4_FOLD_MAX_SCALE;
    one byte above sends the whole layer to DECODE_PTX_WIDE; int4 and shape-only experts never."""
    from kimi_k3_moe.kernels.triton.aot import meta_experts
    from kimi_k3_moe.kernels.triton.weight_codes import decode_code
    w13, w2 = torch.randn(2, 64, 96, generator=gen), torch.randn(2, 96, 32, generator=gen)
    experts = Mxfp4Experts(*mxfp4.quantize(w13), *mxfp4.quantize(w2))
    assert int(experts.w13_scale.max()) <= C.MXFP4_FOLD_MAX_SCALE
    assert layout.from_mxfp4(*experts.tensors()).wide_scales is False
    for name in ("w13_scale", "w2_scale"):
        tensors = dict(zip(("w13_packed", "w13_scale", "w2_packed", "w2_scale"), experts.tensors()))
        tensors[name] = tensors[name].clone()
        tensors[name][1, -1, -1] = C.MXFP4_FOLD_MAX_SCALE + 1
        assert layout.from_mxfp4(*tensors.values()).wide_scales is True, name
    conv = int4.requantize(experts.w13_packed, experts.w13_scale), int4.requantize(experts.w2_packed, experts.w2_scale)
    assert layout.from_int4(*conv).wide_scales is False
    assert meta_experts("mxfp4", 4, 256, 64).wide_scales is False
    assert decode_code("ptx", False) == C.DECODE_PTX and decode_code("ptx", True) == C.DECODE_PTX_WIDE
    assert decode_code("bits", True) == C.DECODE_BITS

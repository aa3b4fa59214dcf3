"""fp8 activations in the Triton backend (Hopper's path), on the CPU.

Layout and decoders bit for bit; the activation quantization kernel against the
CPU quantizer (values decoded, never bytes compared); the whole MoE under the
interpreter against the float64 reference.

Bounds (justified in docs/FORMATS.md, "fp8 activations in the Triton backend"):
- SAME_QUANT_BOUND 1e-2 against the float64 reference that quantizes the
  activations the same way (fp8_moe.ACT_QUANT): what is left is the bf16
  rounding of the per-slot outputs and of the output (2^-9 relative each, ~3e-3
  together) and float32 accumulation; measured 1.6e-3..2.5e-3 here.
- VS_UNQUANTIZED_BOUND 2^-4 against unquantized activations: the price of
  e4m3 (three roundings of 2^-3 / sqrt(12) each); measured ~0.04. It must also
  exceed 1e-2, or the activations were not quantized at all.
"""
import re

import pytest
import torch

import triton_problems as P
from moe_helpers import SITU
from kimi_k3_moe import dispatch, kernels, platform
from kimi_k3_moe.act_quant import ActQuant, UnsupportedActDtype
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.configs.triton_table import KernelConfig, MoEConfig
from kimi_k3_moe.formats import fp8, mxfp4
from kimi_k3_moe.kernels import get_backend
from kimi_k3_moe.kernels import triton as triton_pkg
from kimi_k3_moe.kernels.triton import fp8_layout as L
from kimi_k3_moe.kernels.triton._details import fp8_decode
from kimi_k3_moe.kernels.triton.fp8_moe import ACT_QUANT, fp8_config, quantize_rows
from kimi_k3_moe.kernels.triton.probe import decode_fp8_rows
from kimi_k3_moe.reference import dense_moe, relative_l2

SILU = ActivationSpec.silu()
SAME_QUANT_BOUND = 1e-2
VS_UNQUANTIZED_BOUND = 2 ** -4
MIN_QUANT_EFFECT = 1e-2

GEMV, ALIGNED, ALIGNED_NOSWAP = P.GEMV, P.ALIGNED, P.ALIGNED_NOSWAP
PATHS = {"gemv": GEMV, "aligned": ALIGNED, "aligned-noswap": ALIGNED_NOSWAP}


# ---------------------------------------------------------------- layout
def test_word_layout_roundtrips_and_places_bits(gen):
    codes = torch.randint(0, 16, (5, 64), generator=gen, dtype=torch.uint8)
    assert torch.equal(L.codes_from_words(L.words_from_codes(codes)), codes)
    for i in range(8):
        one = torch.zeros(8, dtype=torch.uint8)
        one[i] = 0xF
        word = L.words_from_codes(one).view(torch.int32).item() & 0xFFFFFFFF
        sign = 8 * i + 7 if i < 4 else 8 * (i - 4) + 3
        assert word == (7 << 4 * i) | (1 << sign), (i, hex(word))


def test_lut_holds_exact_e2m1_multiples_up_to_shift_14():
    assert L.exact_shift_limit() == L.EXACT_SHIFTS - 1 == 14
    values = L.lut_values().double()
    mags = torch.tensor(mxfp4.E2M1_MAGNITUDES, dtype=torch.float64)
    for d in range(L.LUT_ROWS):
        want = mags * 2.0 ** (L.SHIFT_BITS - d)
        if d < L.EXACT_SHIFTS:
            assert torch.equal(values[d], want), d
        else:  # below e4m3's least subnormal: nearest even, off by at most half a step (2^-10)
            assert (values[d] - want).abs().max() <= 2.0 ** -10, d
    assert values.max() == 384 <= fp8.E4M3_MAX


def test_prepared_weights_are_the_mxfp4_weights_exactly(gen):
    ex = P.experts(gen, e=3, h=128, i=64)
    prepared = L.from_mxfp4(*ex.tensors())
    assert prepared.inexact_groups == 0
    for e in range(3):
        for got, want in zip(prepared.dequantize(e), ex.dequantize(e)):
            assert torch.equal(got, want)


def test_groups_far_below_their_row_are_counted_and_rounded(gen):
    ex = P.experts(gen, e=2, h=128, i=64)
    scale = ex.w13_scale.clone()
    codes = mxfp4.unpack_nibbles(ex.w13_packed)
    scale[0, 3, 1] = scale[0, 3].max() - 16           # 16 binades below its row's largest
    nonzero = int(((codes[0, 3, 32:64] & 7) > 0).any())
    prepared = L.from_mxfp4(ex.w13_packed, scale, ex.w2_packed, ex.w2_scale)
    assert prepared.inexact_groups == nonzero == 1
    got = prepared.dequantize(0)[0]
    want = mxfp4.dequantize(ex.w13_packed[0], scale[0])
    assert torch.equal(got[torch.arange(128) != 3], want[torch.arange(128) != 3])
    row_max = want[3].abs().max()
    assert 0 < (got[3] - want[3]).abs().max() <= row_max * 2.0 ** -12


# ---------------------------------------------------------------- PTX decoder, emulated
def _prmt(a: int, b: int, sel: int) -> int:
    pool = [(a >> 8 * k) & 0xFF for k in range(4)] + [(b >> 8 * k) & 0xFF for k in range(4)]
    out = 0
    for k in range(4):
        nib = (sel >> 4 * k) & 0xF
        assert nib < 8, "decoder never uses prmt's sign-replicate mode"
        out |= pool[nib] << 8 * k
    return out


def run_ptx(asm: str, operands: dict[int, int]) -> dict[int, int]:
    """The subset of PTX the fp8 decoder uses; `operands` maps $k to 32-bit inputs; returns all $k."""
    regs = {f"${k}": v & 0xFFFFFFFF for k, v in operands.items()}

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0) & 0xFFFFFFFF

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        dst, srcs = args[0], [val(a) for a in args[1:]]
        assert not re.fullmatch(r"\$(8|9|1\d)", dst), f"the decoder writes input {dst}"
        r = {"and.b32": lambda s: s[0] & s[1], "or.b32": lambda s: s[0] | s[1],
             "shl.b32": lambda s: s[0] << s[1], "shr.u32": lambda s: s[0] >> s[1],
             "prmt.b32": lambda s: _prmt(*s)}[op](srcs)
        regs[dst] = r & 0xFFFFFFFF
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


def test_ptx_decoder_gives_every_code_and_shift_exactly(gen):
    asm = fp8_decode.FP8_WORDS_PTX.value
    assert fp8_decode.FP8_WORDS_CONSTRAINTS.value.count("=r") == 8
    assert fp8_decode.FP8_WORDS_CONSTRAINTS.value.count(",r") == 12
    table = L.lut().to(torch.int64) & 0xFFFFFFFF
    values = L.lut_values()
    codes = torch.cat([torch.arange(16, dtype=torch.uint8).repeat_interleave(8).reshape(16, 8),
                       torch.randint(0, 16, (48, 8), generator=gen, dtype=torch.uint8)])
    words = L.words_from_codes(codes).view(torch.int32).reshape(-1).tolist()
    shifts = [0, 1, 13, 14, 15, 31] + torch.randint(0, 32, (58,), generator=gen).tolist()
    for block in range(0, len(words), 4):
        ops = {}
        for k in range(4):
            d = shifts[block + k]
            ops[8 + k], ops[12 + k], ops[16 + k] = words[block + k], int(table[d, 0]), int(table[d, 1])
        regs = run_ptx(asm, ops)
        for k in range(4):
            d, row = shifts[block + k], codes[block + k].long()
            got = fp8.decode(torch.tensor([(regs[j] >> 8 * k) & 0xFF for j in range(8)], dtype=torch.uint8))
            mag = values[d, row & 7]
            want = torch.where((row & 8) != 0, -mag, mag)
            assert torch.equal(got, want), (block + k, d, got, want)
            assert torch.equal(torch.signbit(got), (row & 8) != 0)  # -0 keeps its sign


# ---------------------------------------------------------------- kernels under the interpreter
def test_bits_decoder_kernel_matches_the_layout(gen):
    ex = P.experts(gen, e=2, h=256, i=64)
    prepared = L.from_mxfp4(*ex.tensors())
    for e in range(2):
        codes = decode_fp8_rows(prepared.w13[e], prepared.w13_shift[e], prepared.lut, "bits",
                                block_n=32, block_k=128)
        assert torch.equal(fp8.decode(codes), prepared.operands("w13", e))


def test_quantize_kernel_equals_the_cpu_quantizer(gen):
    x = torch.randn(6, 256, generator=gen) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[1] = 0.0                                           # a zero row: scale 1, codes 0
    x[2, :7] = torch.tensor([1e-9, -1e-9, 0.0, -0.0, 3e-4, -2e-5, 448.0])   # subnormals, signed zeros
    x[3] = x[3].abs().max() * torch.tensor([1.0, -1.0]).repeat(128)  # every element at the row maximum
    want_codes, want_scale = fp8.quantize_per_token(x)
    for src in (x, x.bfloat16()):
        want_codes, want_scale = fp8.quantize_per_token(src.float())
        for block_k in (0, 128):
            codes, scales, launch = quantize_rows(src, block_k)
            launch()
            assert torch.equal(scales, want_scale.squeeze(1))
            if block_k:  # word order of 128-wide tiles: column 8c + j sits at j*16 + c
                k = torch.arange(256)
                codes = codes[:, (k // 128) * 128 + (k % 8) * 16 + (k % 128) // 8]
            got, want = fp8.decode(codes), fp8.decode(want_codes)
            assert torch.equal(got, want)
            assert torch.equal(torch.signbit(got), torch.signbit(want))


def reference(prepared, hidden, weights, ids, act, act_quant=None, emap=None):
    cache = {}

    def w(e, which):
        if e not in cache:
            cache[e] = prepared.dequantize(e)
        return cache[e][which].double()
    return dense_moe(hidden.double(), lambda e: w(e, 0), lambda e: w(e, 1), weights, ids, act, emap,
                     compute_dtype=torch.float64, act_quant=act_quant)


run = P.run


@pytest.fixture(scope="module")
def problem(module_gen):
    gen = module_gen
    return P.experts(gen), gen


@pytest.mark.parametrize("path", sorted(PATHS))
def test_fp8_moe_matches_the_same_quantization_reference(path, problem):
    """Each path computes the e4m3 function (SiTUv2 and SiLU) to the reference that quantizes the same way;
    against unquantized activations it pays e4m3's price and no more; the two activations differ."""
    ex, gen = problem
    backend = get_backend("triton", act_dtype="fp8", config=PATHS[path])
    assert backend.act_quant == ACT_QUANT == ActQuant("fp8", "token", "token")
    prepared = backend.prepare(ex)
    hidden = P.hidden(gen, 5)
    weights, ids = P.routing(gen, 5)
    outs = {}
    for act in (SITU, SILU):
        out = outs[act.name] = run(backend, prepared, hidden, weights, ids, act)
        same = relative_l2(out, reference(prepared, hidden, weights, ids, act, ACT_QUANT))
        plain = relative_l2(out, reference(prepared, hidden, weights, ids, act))
        assert same < SAME_QUANT_BOUND, f"{path} {act}: {same:.3g} vs the same-quantization reference"
        assert MIN_QUANT_EFFECT < plain < VS_UNQUANTIZED_BOUND, f"{path} {act}: {plain:.3g} vs unquantized"
    assert relative_l2(outs["silu"], outs["situv2"].float()) > 0.05


def test_fp8_word_dots_and_expert_map(gen):
    """Eight word-strided e4m3 dots need BLOCK_K >= 256 (H = 256 here); remote experts contribute nothing."""
    ex = P.experts(gen, h=256, i=128)
    cfg = MoEConfig("aligned", 16, KernelConfig(64, 256, 4, 2, swap=True, interleave=False),
                    KernelConfig(64, 128, 4, 2, swap=False, interleave=False), "bits")
    assert fp8_config(cfg).stage2.interleave and not fp8_config(cfg).stage1.interleave
    local = [1, 4, 5]
    emap = torch.full((9,), -1, dtype=torch.int32)
    emap[torch.tensor([2, 3, 7])] = torch.arange(3, dtype=torch.int32)
    hidden = P.hidden(gen, 4, h=256)
    weights, ids = P.routing(gen, 4, e=9)
    for config in (cfg, GEMV):
        backend = get_backend("triton", act_dtype="fp8", config=config)
        prepared = backend.prepare(ex.select(local))
        out = run(backend, prepared, hidden, weights, ids, SITU, emap)
        err = relative_l2(out, reference(prepared, hidden, weights, ids, SITU, ACT_QUANT, emap))
        assert err < SAME_QUANT_BOUND, (config.path, err)


# ---------------------------------------------------------------- the setting
def test_triton_declares_fp8_on_sm89_and_hopper_only():
    for arch in ("sm_89", "sm_90", "sm_90a", "sm_100", "sm_120"):
        assert triton_pkg.supported_act_dtypes(arch) == ("bf16", "fp8"), arch
    for arch in ("sm_80", "sm_86", "gfx942", "gfx950", "gfx90a", None):
        assert triton_pkg.supported_act_dtypes(arch) == ("bf16",), arch
    assert triton_pkg.act_quant_for("sm_90", "fp8") == ActQuant("fp8", "token", "token")
    assert triton_pkg.act_quant_for("sm_90", "bf16") == ActQuant()


def test_triton_backend_is_made_exactly_where_its_spec_declares_the_act_dtype():
    spec = kernels.get_spec("triton")
    assert triton_pkg.supported_act_dtypes(triton_pkg.INTERPRETER_ARCH) == ("bf16", "fp8")
    for arch in (triton_pkg.INTERPRETER_ARCH, "sm_80", "sm_89", "sm_90", "gfx942", "gfx950"):
        for fmt in ("mxfp4", "int4"):
            declared = spec.act_dtypes(platform.for_arch(arch), fmt)
            for act in ("bf16", "fp8", "fp4"):
                try:
                    get_backend("triton", act_dtype=act, arch=arch, weight_format=fmt)
                except ValueError:
                    assert act not in declared, (arch, fmt, act)
                else:
                    assert act in declared, (arch, fmt, act)


def test_unsupported_combinations_are_refused_naming_arch_and_choices():
    with pytest.raises(UnsupportedActDtype, match=r"'fp8'.*triton backend on gfx942; supported there: bf16$"):
        get_backend("triton", act_dtype="fp8", arch="gfx942")
    with pytest.raises(UnsupportedActDtype, match=r"'fp4'.*sm_90; supported there: bf16, fp8"):
        get_backend("triton", act_dtype="fp4", arch="sm_90")
    with pytest.raises(ValueError, match="fp8 activations run with MXFP4 weights"):
        get_backend("triton", act_dtype="fp8", arch="sm_90", weight_format="int4")
    assert get_backend("triton", act_dtype="fp8", arch="sm_90").describe() == "triton[mxfp4, a8tok]"


def test_plan_on_hopper_keeps_triton_and_emulates_its_scheme_behind_it():
    plan = dispatch.plan_backends(dispatch.Platform("cuda", "sm_90", "H200"), {}, act_dtype="fp8")
    assert [(c.name, dict(c.options)) for c in plan] == [
        ("triton", {"weight_format": "mxfp4", "act_dtype": "fp8"}),
        ("torch", {"weight_format": "mxfp4", "act_dtype": "fp8", "act_quant": ACT_QUANT})]
    with pytest.raises(UnsupportedActDtype, match=r"sm_80.*supported on sm_80: bf16$"):
        dispatch.plan_backends(dispatch.Platform("cuda", "sm_80", "A100"), {}, act_dtype="fp8")
    with pytest.raises(UnsupportedActDtype, match=r"'fp4' is not available on cuda sm_90.*bf16, fp8$"):
        dispatch.plan_backends(dispatch.Platform("cuda", "sm_90", "H200"), {}, act_dtype="fp4")

"""The shared index/decode arithmetic and the direct layout, on the CPU."""
from __future__ import annotations

import pytest
import torch

from kimi_k3_moe.formats import int4, mxfp4
from kimi_k3_moe.kernels.flydsl import layout as L


def _bf16_halves(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., 4] -> their bf16 halves as float64 [..., 8], low half first."""
    return words.to(torch.int32).contiguous().view(torch.bfloat16).double()


@pytest.mark.parametrize("offsets", [False, True])
def test_int4_kernel_decode_is_bit_exact_for_every_code_position_and_group(gen, offsets):
    """formats/int4 packing -> the kernels' byte order -> layout.int4_bf16_words -> bf16 q + 136,
    then the fp32 group scaling the kernels do, against formats/int4's own decoder."""
    from kimi_k3_moe.kernels.flydsl.experts import Int4KernelLayout

    rows, K = 48, 512
    codes = torch.randint(-8, 8, (rows, K), generator=gen, dtype=torch.int8)
    codes[:16] = (torch.arange(16 * K).reshape(16, K) % 16 - 8 + torch.arange(16)[:, None]) % 16 - 8
    scales = (torch.randn(rows, K // 32, generator=gen) * 0.01).to(torch.bfloat16)
    offs = (torch.randn(rows, K // 32, generator=gen) * 0.01).to(torch.bfloat16) if offsets else None
    fmt = int4.Int4Weights(int4.pack_signed(codes), scales, offsets=offs)
    kernel = Int4KernelLayout().swizzle(fmt.packed, "int4")
    assert not torch.equal(kernel, fmt.packed)
    assert torch.equal(Int4KernelLayout().unswizzle(kernel, "int4"), fmt.packed)
    # every code at every element position of every lane's dword (the first 16 rows cycle all 16)
    assert all(set(codes[:16, k].tolist()) == set(range(-8, 8)) for k in range(K))
    words = kernel.view(torch.int32).reshape(rows, K // 128, 4, 4)     # [row, kb, lane group g, dword G]
    want = fmt.dequantize(torch.float64)
    for kb in range(K // 128):
        for g in range(4):
            for G in range(4):
                vals = _bf16_halves(torch.stack(L.int4_bf16_words(words[:, kb, g, G]), dim=-1))
                ks = [L.int4_k_of(kb, G, g, j) for j in range(8)]
                assert torch.equal(vals - L.INT4_BIAS, codes[:, ks].double())          # the codes, exactly
                gi = kb * 4 + G
                s = scales[:, gi].double()[:, None]
                o = offs[:, gi].double()[:, None] if offsets else 0.0
                assert torch.equal((vals - L.INT4_BIAS) * s + o, want[:, ks])       # q * s (+ o), exactly
    assert [L.int4_k_of(1, G, g, j) for G in range(4) for g in range(4) for j in range(8)] == list(range(128, 256))


def test_int4_kernel_constants_are_the_bf16_values_they_stand_for():
    w = torch.tensor([x - (1 << 32) if x >= 1 << 31 else x for x in
                      (L.INT4_WORD_HIGH, *L.INT4_NEG_BIAS_WORDS)], dtype=torch.int64)
    vals = _bf16_halves(w)
    assert vals[:2].tolist() == [128.0, 128.0]                    # 0x4300 | u = 128 + u, u = q + 8
    assert set(vals[2:].tolist()) == {-float(L.INT4_BIAS)}
    assert L.INT4_WORD_MASK == 0x000F000F and L.INT4_XOR == 0x88


def test_int4_offset_word_puts_group_gs_offset_in_both_halves(gen):
    offs = torch.randn(1000, 4, generator=gen).to(torch.bfloat16)
    pairs = offs.view(torch.int32).long()                          # the 8-byte load: 2 dwords per row
    for G in range(4):
        w = L.int4_offset_word(pairs[:, G >> 1], G) & 0xFFFFFFFF
        halves = _bf16_halves(torch.where(w >= 2**31, w - 2**32, w)[:, None])
        assert torch.equal(halves, offs[:, G:G + 1].double().expand(-1, 2))


def _v_perm_b32(src0: int, src1: int, sel: int) -> int:
    """AMD's v_perm_b32 for selector bytes 0-7: result byte i is byte sel_i of the 8 bytes src0:src1
    (src1 the low dword)."""
    both = (src0 & 0xFFFFFFFF) << 32 | (src1 & 0xFFFFFFFF)
    return sum(((both >> (8 * ((sel >> (8 * i)) & 0xFF))) & 0xFF) << (8 * i) for i in range(4))


def test_the_offset_words_v_perm_gives_int4_offset_word(gen):
    """The kernels build int4_offset_word with one v_perm_b32 (int4_offset_perm_selector); its byte
    semantics modelled here give the same word for every group on random pairs."""
    pairs = torch.randint(-2**31, 2**31, (500,), generator=gen).tolist()
    for G in range(4):
        sel = L.int4_offset_perm_selector(G)
        assert all(_v_perm_b32(p, p, sel) == L.int4_offset_word(p, G) & 0xFFFFFFFF for p in pairs)


def test_int4_kernel_loads_cover_a_block_once():
    """Lane group g's 16 bytes at w_byte_offset hold dword g of each of the block's 4 groups;
    the activations it pairs with are 16 contiguous bytes per group, covering the block once."""
    K = 3584
    ks = sorted(L.int4_k_of(3, G, g, j) for G in range(4) for g in range(4) for j in range(8))
    assert ks == list(range(3 * 128, 4 * 128))
    offs = sorted(L.int4_act_byte_offset(5, 3, G, g, K) for G in range(4) for g in range(4))
    assert offs == [(5 * K + 3 * 128) * 2 + 16 * i for i in range(16)]
    assert all(L.int4_act_byte_offset(5, 3, G, g, K) == (5 * K + L.int4_k_of(3, G, g, 0)) * 2
               for G in range(4) for g in range(4))
    assert L.int4_group_quad_index(7, 3, K) == 7 * (K // 32) + 12


def test_e2m1_bit_trick_matches_the_mxfp4_table_for_all_16_codes():
    codes = torch.arange(16, dtype=torch.int32)
    values = L.e2m1_f32_bits(codes).view(torch.float32) * L.E2M1_BIAS_FIX
    assert torch.equal(values, mxfp4.e2m1_table())


def test_e8m0_bits_are_the_scale_for_normal_bytes():
    b = torch.arange(1, 255, dtype=torch.int32)
    assert torch.equal(L.e8m0_f32_bits(b).view(torch.float32), mxfp4.e8m0_to_float(b.to(torch.uint8)))


@pytest.mark.parametrize("beta, lin_beta", [(4.0, 25.0), (2.0, 1.5), (1.0, None)])
def test_exp2_rcp_activation_matches_tanh_and_sigmoid_everywhere(beta, lin_beta):
    z = torch.linspace(-300, 300, 120001)
    g, u = z, z.flip(0)
    c_up = None if lin_beta is None else L.tanh_coef(lin_beta)
    got = L.situv2_mul(g, u, beta, L.tanh_coef(beta), lin_beta, c_up, torch.exp2, torch.reciprocal)
    gd, ud = g.double(), u.double()
    up = ud if lin_beta is None else lin_beta * torch.tanh(ud / lin_beta)
    want = beta * torch.tanh(gd / beta) * torch.sigmoid(gd) * up
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max() + 1e-5
    silu = L.silu_mul(g, u, torch.exp2, torch.reciprocal).double()
    assert torch.allclose(silu, torch.nn.functional.silu(gd) * ud, rtol=1e-5, atol=1e-4)


def test_runtime_beta_select_matches_constant_form():
    g, u = torch.linspace(-50, 50, 1001), torch.linspace(60, -60, 1001)
    for lin_beta in (25.0, 0.0):
        lb = torch.tensor(lin_beta)
        c = torch.tensor(-2 * L.LOG2E) / lb
        runtime = L.situv2_mul(g, u, torch.tensor(4.0), L.tanh_coef(4.0), lb, c, torch.exp2, torch.reciprocal,
                               select=torch.where)
        const = L.situv2_mul(g, u, 4.0, L.tanh_coef(4.0), lin_beta or None,
                             L.tanh_coef(lin_beta) if lin_beta else None, torch.exp2, torch.reciprocal)
        assert torch.allclose(runtime, const, rtol=1e-6, atol=1e-6)


def test_lds_staging_covers_each_tile_byte_once_and_reads_stay_inside():
    for U in (1, 2, 4):
        for BM in (16, 32, 64):
            c = torch.arange(BM * 16 * U)
            row, cc = L.lds_chunk_coords(c, U)
            offs = L.lds_byte_offset(row, cc * 8, U)
            assert offs.unique().numel() == c.numel() and int(row.max()) == BM - 1
            assert int(offs.max()) + 16 <= BM * L.lds_row_bytes(U)
            assert torch.equal(L.staged_act_byte_offset(row, 0, cc, 128 * U), (row * 128 * U + cc * 8) * 2)


# ------------------------------------------------------------------ direct layout
def test_direct_layout_puts_pair_b_alone_on_the_first_row_of_block_b():
    pairs, sentinel = 37, 37 * 4
    p = torch.arange(pairs * L.MFMA_TILE)
    slots = L.direct_row_slot(p, sentinel)
    first = p % L.MFMA_TILE == 0
    assert torch.equal(slots[first], torch.arange(pairs)) and bool((slots[~first] == sentinel).all())
    assert L.direct_row_slot(5 * L.MFMA_TILE, 99) == 5 and L.direct_row_slot(5 * L.MFMA_TILE + 15, 99) == 99


# ------------------------------------------------------------------ quantized activations (gfx950)
def _scaled_inputs(gen, limit):
    """float32 values over the whole range of a format: random, exact ties, signed zeros, past the max."""
    from kimi_k3_moe.formats import fp8
    x = torch.randn(1 << 15, generator=gen) * torch.exp2(torch.randint(-14, 10, (1 << 15,), generator=gen).float())
    if limit == 6.0:
        grid = mxfp4.e2m1_table()[:8].double()
    else:
        grid = fp8.decode(torch.arange(0, 0x7F, dtype=torch.uint8)).double()
    ties = ((grid[1:] + grid[:-1]) / 2).float()
    extra = torch.tensor([0.0, -0.0, limit, -limit, limit * 1.04, -limit * 1.2, 1e-30, -1e-30])
    return torch.cat([x.clamp(-limit * 1.3, limit * 1.3), ties, -ties, extra])   # e2m1: stays below 8


def test_minifloat_codes_equal_the_cpu_codecs_bit_for_bit(gen):
    from k3lab.flydsl.emulator import TorchOps
    from kimi_k3_moe.formats import fp8

    x = _scaled_inputs(gen, 448.0)
    assert torch.equal(L.minifloat_code(x, "fp8", TorchOps).to(torch.uint8), fp8.encode(x))
    x = _scaled_inputs(gen, 6.0)
    # mxfp4.quantize with a unit scale: one block per 32 values whose amax is forced into [4, 8)
    blocks = x[: x.numel() // 32 * 32].view(-1, 32).clone()
    blocks[:, 0] = 4.0
    packed, scales = mxfp4.quantize(blocks)
    assert (scales == 127).all()
    want = mxfp4.unpack_nibbles(packed)
    assert torch.equal(L.minifloat_code(blocks, "fp4", TorchOps).to(torch.uint8), want)


def test_e8m0_rules_equal_the_cpu_quantizers(gen):
    from k3lab.flydsl.emulator import TorchOps
    from kimi_k3_moe.formats import fp8

    amax = torch.rand(8192, generator=gen) * torch.exp2(torch.randint(-130, 120, (8192,), generator=gen).float())
    amax = torch.cat([amax, torch.tensor([0.0, 448.0, 448.0 * (1 + 2 ** -23), 6.0, 8.0, 1e-45])])
    bits = TorchOps.bits(amax)
    assert torch.equal(L.e8m0_from_amax_bits(bits, "fp8", TorchOps).to(torch.uint8), fp8.mx_scale_bytes(amax))
    blocks = torch.zeros(amax.numel(), 32)
    blocks[:, 0] = amax
    assert torch.equal(L.e8m0_from_amax_bits(bits, "fp4", TorchOps).to(torch.uint8), mxfp4.quantize(blocks)[1][:, 0])
    b = torch.arange(1, 254)
    assert torch.equal(TorchOps.f32(L.e8m0_reciprocal_bits(b)).double(), torch.exp2(127.0 - b.double()))


def test_quantized_operand_loads_follow_the_scaled_mfma_abi():
    K = 3584
    # e2m1 activations: the same 16-byte chunk per lane group as the e2m1 weights
    assert all(L.qact_byte_offset(5, 3, g, 0, K, "fp4") == L.w_byte_offset(5, 3, g, K) for g in range(4))
    # e4m3: two 16-byte halves 64 bytes apart, lane groups 16 bytes apart, the row's K128 block at 128 kb
    offs = [L.qact_byte_offset(2, 1, g, h, K, "fp8") - 2 * K - 128 for g in range(4) for h in range(2)]
    assert offs == [0, 64, 16, 80, 32, 96, 48, 112]
    # lane group g supplies the scales of group 4 kb + g for activations and weights alike
    assert [L.act_scale_index(7, 2, g, K) for g in range(4)] == [L.group_index(7, 2, g, K) for g in range(4)]
    assert L.amax_partner_lanes(torch.arange(64))[0].tolist() == [(l + 16) % 32 + 32 * (l // 32) for l in range(64)]


def test_valu_per_1k_weights_counts_the_k_loop_body_only():
    from fly_helpers import kernel_config

    from k3lab.flydsl.artifacts import valu_per_1k_weights, weights_per_iteration

    isa = "\n".join(["\tv_mov_b32 v0, 0", ".LBB0_1:", "\tbuffer_load_dwordx4 v[0:3], v4, s[0:3], 0 offen",
                     "\tv_and_or_b32 v5, v0, s2, v9", "\tv_pk_fma_f32 v[6:7], v[6:7], v[8:9], v[6:7]",
                     "\tv_mfma_f32_16x16x16_bf16 v[10:13], v[0:1], v[2:3], 0", "\ts_cbranch_scc1 .LBB0_1",
                     "\tv_add_f32 v1, v1, v1", "\ts_endpgm"])
    cfg = kernel_config("gfx942", 2, "int4", N=3584, K=384, top_k=16, n_rep=2)
    assert weights_per_iteration(cfg) == 2 * 16 * 128
    assert valu_per_1k_weights(isa, cfg) == 2 * 1024 / 4096      # and-or + pk_fma; not the MFMA, not outside

"""The decoders and the token alignment, run under the interpreter."""
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
import triton_problems as _data

from kimi_k3_moe.formats import int4
from kimi_k3_moe.kernels.common import alignment
from kimi_k3_moe.kernels.triton import layout
from kimi_k3_moe.kernels.triton._details.decode import pair_order
from kimi_k3_moe.kernels.triton.probe import decode_rows


@triton.jit
def _pair_order_probe(out_ptr, N: tl.constexpr):
    k = tl.arange(0, N)
    tl.store(out_ptr + k, pair_order(k))


@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("weight_format", ["mxfp4", "int4", "int4+offsets"])
def test_bits_decoder_matches_the_format(weight_format, pairs, gen):
    ex = _data.experts(gen, e=1, h=256, i=32)
    if weight_format == "mxfp4":
        prepared = layout.from_mxfp4(*ex.tensors())
    else:
        conv = [int4.requantize(ex.w13_packed, ex.w13_scale), int4.requantize(ex.w2_packed, ex.w2_scale)]
        if weight_format == "int4+offsets":
            conv = [int4.Int4Weights(c.packed, c.scales, "test",
                                     (torch.randn(c.scales.shape, generator=gen) * 0.05).bfloat16()) for c in conv]
        prepared = layout.from_int4(*conv)
    got = decode_rows(prepared.w13[0], prepared.w13_scale[0],
                      None if prepared.w13_offset is None else prepared.w13_offset[0],
                      "mxfp4" if weight_format == "mxfp4" else "int4", "bits", block_n=16, block_k=128, pairs=pairs)
    want = prepared.dequantize(0)[0]
    # the kernels feed bf16 to the dot: MXFP4 is exact there, int4 rounds to nearest
    assert torch.equal(got, want.bfloat16().float())
    if weight_format == "mxfp4":
        assert torch.equal(got, want)


@pytest.mark.parametrize("small", [True, False])  # one launch, or two
@pytest.mark.parametrize("block_ms", [(16,), (32, 16)])
@pytest.mark.parametrize("with_map", [False, True])
def test_alignment_groups_every_pair_once(with_map, block_ms, small, gen, monkeypatch):
    tokens, e, topk = 37, 6, 3
    if not small:
        monkeypatch.setattr(alignment, "SMALL_PAIRS", 0)
        monkeypatch.setattr(alignment, "BLOCK", 16)  # 7 programs: the last ticket is not the first
    _, ids = _data.routing(gen, tokens, e, topk)
    emap = None
    if with_map:
        emap = torch.full((e,), -1, dtype=torch.int32)
        local = torch.randperm(e, generator=gen)[:4]
        emap[local] = torch.arange(4, dtype=torch.int32)
    aligned, launches = alignment.align_launches(ids, emap, e if emap is None else 4, block_ms)
    assert [x.block_m for x in aligned] == list(block_ms) and len(launches) == (1 if small else 2)
    flat = ids.reshape(-1).long()
    want_local = flat if emap is None else emap[flat].long()
    for _ in range(2):  # replayable: a second run (as a CUDA graph replay would) gives the same rows
        for x in aligned:
            x.sorted_pairs.fill_(-7)  # poisoned: every row must be written
            x.block_expert.fill_(-7)
        for launch in launches:
            launch()
        for x in aligned:
            _check_aligned(x, want_local)
        if not small:  # the counters and the ticket are zero again for the next forward
            assert not alignment.counters(ids.device, e if emap is None else 4).any()
    if len(aligned) == 2:  # one slot per pair: its place among its expert's rows is the same in both
        slots = [_slots(x, flat.numel()) for x in aligned]
        assert slots[0] == slots[1]


@pytest.mark.parametrize("small", [True, False])
def test_the_alignment_zeroes_the_rest_of_a_book_it_is_given(gen, monkeypatch, small):
    """`book`: local experts at its start, zeros after them (the FlyDSL stage 2's counters and fp32
    accumulator), from every program of the two-launch alignment; a wrong book is refused."""
    if not small:
        monkeypatch.setattr(alignment, "SMALL_PAIRS", 0)
        monkeypatch.setattr(alignment, "BLOCK", 16)
    _, ids = _data.routing(gen, 37, 6, 3)
    book = torch.full((ids.numel() + 3000,), 7, dtype=torch.int32)
    (pairs,), launches = alignment.align_launches(ids, None, 6, (16,), book)
    for launch in launches:
        launch()
    assert torch.equal(book[:ids.numel()], ids.reshape(-1).int()) and pairs.local.data_ptr() == book.data_ptr()
    assert not book[ids.numel():].any()
    for wrong in (book.long(), book[:ids.numel() - 1], book.view(-1, 1)):
        with pytest.raises(ValueError, match="book must be"):
            alignment.align_launches(ids, None, 6, (16,), wrong)


def test_dirty_counters_give_wrong_rows_but_no_write_outside(gen, monkeypatch):
    """Counters a stopped forward left non-zero (the ticket never reaching the last program, so the
    first rows are never written): the placing launch keeps every row inside the buffers."""
    monkeypatch.setattr(alignment, "SMALL_PAIRS", 0)
    monkeypatch.setattr(alignment, "BLOCK", 16)
    e = 7
    _, ids = _data.routing(gen, 37, e, 3)
    (pairs,), launches = alignment.align_launches(ids, None, e, (16,))
    state = alignment.counters(ids.device, e)
    try:
        state[-1] = 1000                          # the ticket: no program is the last one
        pairs.offsets.fill_(2**30)                # first rows far past the buffer
        for launch in launches:
            launch()
        assert torch.all(pairs.sorted_pairs == ids.numel())   # nothing placed, nothing outside
    finally:
        state.zero_()


def test_the_backend_makes_the_counters_when_it_prepares_a_layer(gen):
    """Made at load, eagerly: made first inside a graph capture their zeroing would belong to that graph."""
    from kimi_k3_moe.kernels import get_backend
    ex = _data.experts(gen, e=5, h=256, i=32)
    alignment._COUNTERS.pop((str(ex.device), 5), None)
    get_backend("triton").prepare(ex)
    assert not alignment._COUNTERS[(str(ex.device), 5)].any()


def _slots(pairs, num_pairs):
    rows = pairs.sorted_pairs[:int(pairs.num_rows.item())].tolist()
    return {p: r - pairs.offsets[pairs.local[p]].item() for r, p in enumerate(rows) if p < num_pairs}


def _check_aligned(pairs, want_local):
    assert torch.equal(pairs.local.long(), want_local)
    assert alignment.misplaced(pairs, want_local) is None


def test_the_alignment_checker_names_each_kind_of_misplaced_row(gen):
    """misplaced() is what the GPU check trusts: every kind of wrong alignment must be named."""
    _, ids = _data.routing(gen, 37, 6, 3)
    (good,), launches = alignment.align_launches(ids, None, 6, (16,))
    for launch in launches:
        launch()
    local = ids.reshape(-1).long()
    assert alignment.misplaced(good, local) is None
    n = int(good.num_rows.item())
    counts = torch.bincount(local, minlength=6)
    a = int(good.offsets[local[0]])
    b = next(int(good.offsets[e]) for e in range(6) if e != int(local[0]) and counts[e] > 0)

    def mutated(name, change):
        x = replace(good, **{name: getattr(good, name).clone()})
        change(getattr(x, name))
        return alignment.misplaced(x, local)

    def swap(t):
        t[a], t[b] = t[b].clone(), t[a].clone()
    assert "another expert" in mutated("sorted_pairs", swap)
    assert "exactly once" in mutated("sorted_pairs", lambda t: t.__setitem__(a, t[b]))
    assert "padding" in mutated("sorted_pairs", lambda t: t.__setitem__(n, 0))
    assert "first row" in mutated("offsets", lambda t: t.__setitem__(1, t[1] + 16))
    assert "num_rows" in mutated("num_rows", lambda t: t.add_(16))
    assert "names an expert" in mutated("block_expert", lambda t: t.__setitem__(n // 16, 0))


def test_pair_order_is_the_wgmma_register_order():
    """Position 32g + 8p + 2q + b of the pair order holds K = 32g + 8q + 2p + b (pair p of word q),
    and the order is its own inverse, so stage 1 writes what stage 2 reads with one function."""
    n = 128
    got = torch.empty(n, dtype=torch.int32)
    _pair_order_probe[(1,)](got, N=n)
    want = [32 * (c // 32) + 8 * ((c >> 1) & 3) + 2 * ((c >> 3) & 3) + (c & 1) for c in range(n)]
    assert got.tolist() == want
    assert got[got.long()].tolist() == list(range(n))


@pytest.mark.parametrize("rows,k", [(37, 96), (16, 3584)])
def test_pair_order_copy_of_the_activations(rows, k, gen):
    """stage1.pair_order's copy (contiguous tiles, the 4 x 4 swap in registers) puts x[:, K] where
    the pair order wants it, for row counts and K that are not multiples of its tile."""
    from kimi_k3_moe.kernels.triton.stage1 import pair_order as pair_order_copy
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    out, launch = pair_order_copy(x)
    launch()
    c = torch.arange(k)
    src = 32 * (c // 32) + 8 * ((c >> 1) & 3) + 2 * ((c >> 3) & 3) + (c & 1)
    assert torch.equal(out, x[:, src])


def test_pdl_chains_every_launch_after_the_first():
    """With MoEConfig.pdl every kernel of a forward gets PDL (it waits before reading what the launch
    before it wrote) and every launch but the first is started as a programmatic dependent; without
    it nothing changes. Planned on meta tensors (the interpreter cannot run griddepcontrol)."""
    from dataclasses import replace

    from kimi_k3_moe.activation import ActivationSpec
    from kimi_k3_moe.kernels.triton import aot
    from kimi_k3_moe.kernels.triton.table import KernelConfig, KOrder, MoEConfig
    act = ActivationSpec.situv2(4.0, 25.0)
    ex = aot.meta_experts("mxfp4", 8, 256, 64)
    direct = MoEConfig("direct", 16, KernelConfig(32, 64, order=KOrder.PAIRS),
                       KernelConfig(64, 64, order=KOrder.PAIRS), "ptx")
    for cfg in (direct, replace(direct, path="aligned"), MoEConfig("gemv", 16, KernelConfig(16, 128),
                                                                      KernelConfig(8, 64), "ptx")):
        plain = aot.plan_for_shape(ex, 3, 4, act, cfg)
        chained = aot.plan_for_shape(ex, 3, 4, act, replace(cfg, pdl=True))
        assert [lc.label for lc in plain] == [lc.label for lc in chained]
        assert not any(lc.pdl or lc.args["PDL"] or "launch_pdl" in lc.options() for lc in plain)
        assert all(lc.args["PDL"] for lc in chained)
        assert [lc.pdl for lc in chained] == [False] + [True] * (len(chained) - 1)
        assert all(lc.options()["launch_pdl"] for lc in chained[1:])
    assert [lc.label for lc in aot.plan_for_shape(ex, 3, 4, act, direct)] == [
        "stage1.pair_order", "stage1.aligned", "stage2.aligned", "stage2.reduce"]  # no alignment launches

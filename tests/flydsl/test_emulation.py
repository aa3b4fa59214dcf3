"""The kernels' address logic played on the CPU, through the backend's own forward pass.

This stands in for running the FlyDSL kernels (no AMD GPU here): `emulator.launch`
evaluates the index and decode functions the kernels call at trace time, gathers
the bytes each lane would load from the packed weights, computes the tiles in
torch and stores them where the kernel would. It checks addressing, layout,
decode formulas and the surrounding pipeline, not FlyDSL's code generation or the
hardware's instruction semantics (the load-time self-check covers those).

Bounds: against the float reference on the same (prepared) weights, relative L2 <
1.5e-2 (bf16 activations, bf16 weights on gfx942's int4 path, bf16 intermediate
and slot outputs; measured 2e-3..4e-3). Against a reference rounding at exactly
the kernels' points, < 1e-3 (measured 1e-5..1.5e-4: summation order flips a few
bf16 roundings). A single mis-addressed scale group, row or lane moves the second
figure by far more than that (test_wrong_indices_are_caught).
"""
from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources

import pytest
import torch
from fly_helpers import SILU, SITU, kernel_config, random_layer, random_routing, with_offsets

from k3lab.flydsl import emulator
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.formats import int4
from kimi_k3_moe.kernels.flydsl import layout, pipeline, tiles
from kimi_k3_moe.kernels.flydsl.backend import FlyDSLBackend
from kimi_k3_moe.kernels.flydsl.config import KLoop, RowBlocks
from kimi_k3_moe.kernels.flydsl.experts import FlyDSLExperts
from kimi_k3_moe.reference import dense_moe, relative_l2
from kimi_k3_moe.weights.requant import requantize_experts

REF_BOUND = 1.5e-2
FAITHFUL_BOUND = 1e-3
E, H, I, T, K = 6, 256, 128, 40, 4


def raw_tiers(arch):
    data = json.loads(resources.files("kimi_k3_moe.configs").joinpath("tables", tiles.TABLE).read_text())
    return data[arch]


def only_tier(arch, index):
    """A table whose single tier is the real table's tier `index`: reaches its tiles at any token count."""
    return tiles.load_table({arch: [{**raw_tiers(arch)[index], "max_tokens": None}]})


def prepared_layer(gen, arch, *, offsets=False, inter=I, experts=E, hidden=H):
    layer = random_layer(gen, experts=experts, hidden=hidden, inter=inter)
    backend = FlyDSLBackend(arch=arch)
    if arch == "gfx942":
        int4 = requantize_experts(layer, progress=False)
        return backend.prepare(with_offsets(gen, int4) if offsets else int4)
    return backend.prepare(layer)


def float_reference(prep, x, tw, ids, act, expert_map=None):
    w = {}

    def weights(e):
        if e not in w:
            w[e] = prep.dequantize(e)
        return w[e]
    return dense_moe(x, lambda e: weights(e)[0], lambda e: weights(e)[1], tw, ids, act, expert_map)


def faithful_reference(prep, x, tw, ids, act, reduce):
    """Rounds where the kernels round: bf16 intermediate and slot outputs (the deterministic sums), the
    output in x's dtype; MXFP4 weights in bf16 (gfx950's convert), int4 weights exact (the kernels
    scale fp32 sums of the raw codes)."""
    out = torch.zeros(x.shape[0], prep.hidden_size, dtype=torch.float64)
    for e in range(prep.num_experts):
        t, s = torch.nonzero(ids == e, as_tuple=True)
        if prep.weight_format == "int4":
            w13, w2 = prep.dequantize(e, torch.float64)
        else:
            w13, w2 = (w.to(torch.bfloat16).double() for w in prep.dequantize(e))
        inter = act.apply((x[t].double() @ w13.T).float()).to(torch.bfloat16).double()
        y = (inter @ w2.T) * tw[t, s, None].double()
        out.index_add_(0, t, y if reduce == "atomic" else y.to(torch.bfloat16).double())
    return out.to(x.dtype).float()


def emulate(prep, arch, x, tw, ids, act, **kw):
    return pipeline.moe_forward(prep, x, tw, ids, act, kw.pop("expert_map", None), arch=arch,
                                launch=emulator.launch, **kw)


def check(prep, arch, x, tw, ids, act, reduce="slots", **kw):
    out = emulate(prep, arch, x, tw, ids, act, reduce=reduce, **kw)
    err = relative_l2(out, float_reference(prep, x.float(), tw, ids, act))
    err_faithful = relative_l2(out, faithful_reference(prep, x, tw, ids, act, reduce))
    print(f"{arch} {act} reduce={reduce}: rel L2 vs float reference {err:.2e}, vs kernel-rounding reference "
          f"{err_faithful:.2e}")
    assert err < REF_BOUND and err_faithful < FAITHFUL_BOUND
    return out


# ------------------------------------------------------------------ every tile of the table
@pytest.mark.parametrize("tier", range(8))
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_every_table_tile_matches_the_reference(gen, arch, tier):
    if tier >= len(raw_tiers(arch)):
        pytest.skip(f"{arch} has {len(raw_tiers(arch))} tiers")
    prep = prepared_layer(gen, arch)
    x, tw, ids = random_routing(gen, T, E, K, H)
    reduce = raw_tiers(arch)[tier].get("reduce", "slots")    # the tier's own top-k sum ("auto")
    if reduce == "fused":   # bf16 rows, as the engines pass them: float rows would take the slots sum
        x = x.to(torch.bfloat16)
    check(prep, arch, x, tw, ids, SITU, reduce=reduce, table=only_tier(arch, tier))
    if raw_tiers(arch)[tier].get("direct"):   # int64 ids take the aligned layout with the same tiles
        check(prep, arch, x, tw, ids.long(), SITU, reduce=reduce, table=only_tier(arch, tier))


def direct_table(arch):
    return only_tier(arch, next(i for i, t in enumerate(raw_tiers(arch)) if t.get("direct")))


def aligned_table(arch):
    return only_tier(arch, next(i for i, t in enumerate(raw_tiers(arch)) if not t.get("direct")))


# the forward's own PyTorch calls may allocate and view, nothing else: no fill, copy, sort or arithmetic
ALLOCATE_OR_VIEW = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::view", "aten::reshape",
                    "aten::_reshape_alias", "aten::slice", "aten::select", "aten::as_strided", "aten::to",
                    "aten::contiguous", "aten::alias", "aten::unsqueeze", "aten::expand", "aten::detach"}


class LaunchRecorder:
    """One forward's launches, recorded and not run: the FlyDSL stages through `launch`, the Triton
    glue through Launch.__call__."""

    def __init__(self, monkeypatch):
        from kimi_k3_moe.kernels.common import launch as glue_launch
        self.labels = []
        monkeypatch.setattr(glue_launch.Launch, "__call__", lambda launch: self.labels.append(launch.label))

    def flydsl(self, cfg, args):
        self.labels.append(cfg.name)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("reduce", ["auto", "fused"])
@pytest.mark.parametrize("tokens", [1, 3, 16, 40, 65])
def test_a_forward_is_three_launches_up_to_256_pairs_and_four_above_fused(gen, arch, tokens, reduce, monkeypatch):
    """bf16 rows (what the engines pass): a direct tier is stage 1, stage 2 and the top-k sum; an
    aligned one the alignment (one launch up to alignment.SMALL_PAIRS pairs, else two), the two
    stages and the top-k sum, which reduce "fused" folds into stage 2. No PyTorch op computes."""
    prep = prepared_layer(gen, arch)
    x, tw, ids = random_routing(gen, tokens, E, K, H)
    x = x.to(torch.bfloat16)
    # twice: the second forward finds the two-launch alignment's counters as the first left them
    for _ in range(2):
        assert relative_l2(emulate(prep, arch, x, tw, ids, SITU, reduce=reduce).float(),
                           float_reference(prep, x.float(), tw, ids, SITU)) < REF_BOUND
    rec = LaunchRecorder(monkeypatch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipeline.moe_forward(prep, x, tw, ids, SITU, None, arch=arch, launch=rec.flydsl, reduce=reduce)
    direct = tokens <= max(t["max_tokens"] for t in raw_tiers(arch) if t.get("direct"))
    fused = reduce == "fused" and not direct
    want = ([] if direct else ["align.small"] if tokens * K <= 256 else ["align.count", "align.scatter"])
    want += ["s1", "s2"] + ([] if fused else ["stage2.reduce"])
    got = [label if label.startswith(("align", "stage2.")) else label.split("_")[1] for label in rec.labels]
    assert got == want, rec.labels
    assert len(got) <= (3 if tokens * K <= 256 else 4) or not fused
    ops = {e.name for e in prof.events() if e.name.startswith("aten::")}
    assert ops <= ALLOCATE_OR_VIEW, ops - ALLOCATE_OR_VIEW


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_the_atomic_top_k_sum_is_one_launch_more_and_no_pytorch_op(gen, arch, monkeypatch):
    """reduce="atomic" (the table's choice at gfx950's largest tier, or KIMI_K3_MOE_REDUCE=atomic): the
    fp32 accumulator is zeroed and converted by Triton launches, not PyTorch ops, around stage 2
    (the slots sum's one launch becomes two)."""
    prep = prepared_layer(gen, arch)
    x, tw, ids = random_routing(gen, T, E, K, H)
    x = x.to(torch.bfloat16)
    ref = float_reference(prep, x.float(), tw, ids, SITU)
    for rows in (x, x.t().contiguous().t()):                 # row-major and column-major hidden
        auto = emulate(prep, arch, rows, tw, ids, SITU, table=aligned_table(arch), reduce="atomic")
        assert auto.is_contiguous() and relative_l2(auto.float(), ref) < REF_BOUND
    rec = LaunchRecorder(monkeypatch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipeline.moe_forward(prep, x, tw, ids, SITU, None, arch=arch, launch=rec.flydsl, reduce="atomic",
                             table=aligned_table(arch))
    assert rec.labels[0] == "align.small" and rec.labels[2] == "stage2.zero" and rec.labels[-1] == "stage2.cast" \
        and len(rec.labels) == 5, rec.labels
    ops = {e.name for e in prof.events() if e.name.startswith("aten::")}
    assert ops <= ALLOCATE_OR_VIEW, ops - ALLOCATE_OR_VIEW


ALIGNED_TIERS = [(arch, i) for arch in ("gfx942", "gfx950") for i, t in enumerate(raw_tiers(arch))
                 if not t.get("direct")]


@pytest.mark.parametrize("arch,tier", ALIGNED_TIERS)
def test_the_fused_top_k_sum_matches_the_sum_kernel_bit_for_bit_in_any_workgroup_order(gen, arch, tier):
    """reduce "fused" (each token written by the stage-2 workgroup that completes it) equals the separate
    top-k sum kernel's output bit for bit whatever order the workgroups finish in: every slot here,
    slots on other ranks and tokens with none here (expert map: the alignment zeroes their rows), the
    two-launch alignment (it zeroes the counters, so a second forward gives the same bits). SiLU and
    SiTUv2 differ. Outputs that are not bf16 take the separate sum."""
    prep = prepared_layer(gen, arch)
    tiles_ = only_tier(arch, tier)
    expert_map = torch.full((2 * E,), -1, dtype=torch.int32)
    expert_map[torch.randperm(2 * E, generator=gen)[:E]] = torch.arange(E, dtype=torch.int32)
    results = {}
    for tokens, emap, act in ((9, None, SITU), (70, expert_map, SITU), (9, None, SILU)):
        x, tw, ids = random_routing(gen, tokens, 2 * E if emap is not None else E, K, H)
        x = x.to(torch.bfloat16)
        kw = dict(expert_map=emap, table=tiles_)
        separate = emulate(prep, arch, x, tw, ids, act, reduce="slots", **kw)
        for order in (None, gen, gen):
            launch = emulator.launch if order is None else (
                lambda cfg, args, order=order: emulator.launch(cfg, args, shuffle=order))
            fused = pipeline.moe_forward(prep, x, tw, ids, act, emap, arch=arch, launch=launch, table=tiles_,
                                         reduce="fused")
            assert torch.equal(fused, separate), (tokens, relative_l2(fused.float(), separate.float()))
        assert relative_l2(fused.float(), float_reference(prep, x.float(), tw, ids, act, emap)) < REF_BOUND
        results[tokens, act.name] = fused
    assert relative_l2(results[9, "silu"].float(), results[9, "situv2"].float()) > 0.05
    c2 = tiles.stage_configs(arch, prep.weight_format, hidden=H, inter=I, top_k=K, num_tokens=9, activation=SITU,
                             reduce="fused", table=tiles_, bf16_out=False)[1]
    assert c2.reduction.kind == "slots"


def test_asymmetric_int4_offsets_are_honoured(gen):
    prep = prepared_layer(gen, "gfx942", offsets=True)
    assert prep.has_offsets
    x, tw, ids = random_routing(gen, T, E, K, H)
    out = check(prep, "gfx942", x, tw, ids, SITU)
    # the offsets matter: dropping them moves the result far outside the bound
    no_ofs = replace(prep, w13_offset=None, w2_offset=None)
    assert relative_l2(emulate(no_ofs, "gfx942", x, tw, ids, SITU), out) > 0.05


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_kernel_variants_runtime_betas_atomic_split_k_and_unroll(gen, arch):
    prep = prepared_layer(gen, arch, inter=256)
    x, tw, ids = random_routing(gen, T, E, K, H)
    weight_format = prep.weight_format
    c1, c2 = tiles.stage_configs(arch, weight_format, hidden=H, inter=256, top_k=K, num_tokens=T, activation=SITU)
    variants = [
        (c1.with_activation(SITU, betas="runtime"), c2.with_reduction("atomic", split_k=2)),
        (replace(c1, rows=RowBlocks(32), tile=replace(c1.tile, kb_unroll=2, waves=2, schedule=KLoop.LDS)),
         replace(c2, rows=RowBlocks(32), tile=replace(c2.tile, kb_unroll=2, schedule=KLoop.LDS))),
    ]
    for v1, v2 in variants:
        check(prep, arch, x, tw, ids, SITU, reduce=v2.reduction.kind, configs=(v1, v2))


def _k_block_ignoring_wave(bid_k, wave_k, it, u, k_waves, iters, U, _orig=layout.k_block):
    return _orig(bid_k, 0, it, u, k_waves, iters, U)


def _partials_on_one_slot(wave_k, wave_n, a, lane, waves, n_acc, _orig=layout.reduce_lds_byte_offset):
    return _orig(0, wave_n, a, lane, waves, n_acc)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_k_split_over_waves_matches_the_reference_and_its_indices_are_checked(gen, arch, monkeypatch):
    """Stage 1 with K over 2 and 4 waves (partials summed through LDS in wave order), direct and
    aligned, int4 with offsets on gfx942; SiLU and SiTUv2 differ; a wave walking the wrong K slice
    or partials on one LDS slot are caught."""
    hidden = 512                                         # 4 K blocks: k_waves 4 has one each
    prep = prepared_layer(gen, arch, offsets=arch == "gfx942", hidden=hidden)
    x, tw, ids = random_routing(gen, 3, E, K, hidden)
    weight_format = prep.weight_format
    results = {}
    for direct in (E, None):
        c1, c2 = tiles.stage_configs(arch, weight_format, hidden=hidden, inter=I, top_k=K, num_tokens=3,
                                     activation=SITU, has_offsets=prep.has_offsets, direct_experts=direct)
        for waves, k_waves in ((1, 4), (2, 2)):
            v1 = c1.with_tile(waves=waves, k_waves=k_waves, schedule=c1.tile.schedule.with_staging(False))
            use = ids if direct else ids.long()          # int64 ids take the aligned layout
            results[direct, k_waves] = check(prep, arch, x, tw, use, SITU, configs=(v1, c2))
            silu = check(prep, arch, x, tw, use, SILU, configs=(v1.with_activation(SILU), c2))
            assert relative_l2(results[direct, k_waves], silu) > 0.05
    v1 = c1.with_tile(waves=1, k_waves=4, schedule=c1.tile.schedule.with_staging(False))
    for name, wrong in (("k_block", _k_block_ignoring_wave), ("reduce_lds_byte_offset", _partials_on_one_slot)):
        with monkeypatch.context() as m:
            m.setattr(layout, name, wrong)
            try:
                bad = emulate(prep, arch, x, tw, ids.long(), SITU, configs=(v1, c2))
            except emulator.EmulatorError:
                continue
        assert not relative_l2(bad, results[None, 4]) <= 10 * FAITHFUL_BOUND, name


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_silu_and_situv2_differ_through_the_emulated_kernels(gen, arch):
    prep = prepared_layer(gen, arch)
    x, tw, ids = random_routing(gen, T, E, K, H)
    situ = check(prep, arch, x, tw, ids, SITU)
    silu = check(prep, arch, x, tw, ids, SILU)
    other = check(prep, arch, x, tw, ids, ActivationSpec.situv2(2.0, 1.5))
    assert relative_l2(situ, silu) > 0.05 and relative_l2(situ, other) > 0.05


def test_expert_parallel_rank_sums_its_own_experts(gen):
    prep = prepared_layer(gen, "gfx950")                        # this rank holds E of 2E global experts
    x, tw, ids = random_routing(gen, T, 2 * E, K, H)
    expert_map = torch.full((2 * E,), -1, dtype=torch.int32)
    mine = torch.randperm(2 * E, generator=gen)[:E]
    expert_map[mine] = torch.arange(E, dtype=torch.int32)
    out = emulate(prep, "gfx950", x, tw, ids, SITU, expert_map=expert_map)
    ref = float_reference(prep, x, tw, ids, SITU, expert_map)
    assert relative_l2(out, ref) < REF_BOUND


@pytest.mark.parametrize("reduce", ["slots", "fused"])
def test_token_chunks_give_the_same_result(gen, reduce):
    """Per chunk its own alignment (and, fused, its own counters and output rows zeroed)."""
    prep = prepared_layer(gen, "gfx942")
    x, tw, ids = random_routing(gen, T, E, K, H)
    x = x.to(torch.bfloat16) if reduce == "fused" else x
    whole = emulate(prep, "gfx942", x, tw, ids, SITU, reduce=reduce)
    chunked = emulate(prep, "gfx942", x, tw, ids, SITU, chunk_tokens=7, reduce=reduce)
    assert torch.allclose(whole.float(), chunked.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout_", ["direct", "aligned"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_expert_ids_out_of_range_contribute_nothing_and_read_nothing(gen, layout_, dtype, monkeypatch):
    """Ids E, -1, 10^6 (and 2^32 + 1 as int64) are pairs on no rank: no kernel reads an expert for them
    (the emulator's buffers refuse any read past W) and the result is the reference without them. Every
    float buffer the forward allocates starts as NaN, so a slot row nobody wrote that the top-k sum
    read would show."""
    real_empty = torch.empty

    def nan_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", nan_empty)
    prep = prepared_layer(gen, "gfx950")
    tokens = 3 if layout_ == "direct" else T
    x, tw, ids = random_routing(gen, tokens, E, K, H)
    ids = ids.to(dtype)
    wild = [E, -1, 10**6] + ([2**32 + 1] if dtype == torch.int64 else [])
    bad = torch.zeros(ids.shape, dtype=torch.bool)
    bad[torch.arange(tokens), torch.randint(0, K, (tokens,), generator=gen)] = True
    ids[bad] = torch.tensor(wild, dtype=dtype)[torch.randint(0, len(wild), (tokens,), generator=gen)]
    table = direct_table("gfx950") if layout_ == "direct" else aligned_table("gfx950")
    out = emulate(prep, "gfx950", x, tw, ids, SITU, table=table)
    kept_tw = torch.where(bad, torch.zeros_like(tw), tw)
    ref = float_reference(prep, x, kept_tw, torch.where(bad, torch.zeros_like(ids), ids), SITU)
    assert torch.isfinite(out).all() and relative_l2(out, ref) < REF_BOUND


# ------------------------------------------------------------------ the check has teeth
def _shifted_group(row, kb, g, K, _orig=layout.group_index):
    return _orig(row, kb, (g + 1) & 3, K)          # each lane reads its neighbour's scale


def _transposed_d(g, r, e, _orig=layout.d_row_col):
    i, c = _orig(g, r, e)
    return c, i                                     # wrong MFMA output layout


def _int4_next_groups_scales(row, kb, K, _orig=layout.int4_group_quad_index):
    return _orig(row, kb, K) + 1                    # int4: each group takes its neighbour's scale (offset)


def _int4_swapped_nibbles(w, high=layout.INT4_WORD_HIGH, _orig=layout.int4_bf16_words):
    a, b, c, d = _orig(w, high)
    return [a, c, b, d]                             # int4: elements 2..3 and 4..5 decoded from each other's nibbles


def _swapped_gate_up(n_col, is_up, N, _orig=layout.gate_up_row):
    return _orig(n_col, 1 - is_up, N)


def _token_for_slot_off_by_one(slot, top_k, _orig=layout.slot_token):
    return _orig(slot + 1, top_k)


@pytest.mark.parametrize("arch, name, wrong", [
    ("gfx950", "group_index", _shifted_group), ("gfx942", "int4_group_quad_index", _int4_next_groups_scales),
    ("gfx942", "int4_bf16_words", _int4_swapped_nibbles), ("gfx942", "d_row_col", _transposed_d),
    ("gfx950", "d_row_col", _transposed_d), ("gfx942", "gate_up_row", _swapped_gate_up),
    ("gfx942", "slot_token", _token_for_slot_off_by_one)])
def test_wrong_indices_are_caught(gen, monkeypatch, arch, name, wrong):
    prep = prepared_layer(gen, arch, offsets=name == "int4_group_quad_index")
    x, tw, ids = random_routing(gen, T, E, K, H)
    good = emulate(prep, arch, x, tw, ids, SITU)
    monkeypatch.setattr(layout, name, wrong)
    try:
        bad = emulate(prep, arch, x, tw, ids, SITU)
    except emulator.EmulatorError:
        return
    assert not relative_l2(bad, good) <= 10 * FAITHFUL_BOUND      # NaN (a never-written output) counts too


def test_out_of_bounds_reads_are_reported(gen):
    prep = prepared_layer(gen, "gfx950")
    x, tw, ids = random_routing(gen, 3, E, K, H)
    ids[:, 0] = E - 1                                    # touch the last expert: its last bytes get read

    def one_byte_short(cfg, args):                       # W one byte shorter than the layer
        args = list(args)
        args[1] = args[1][:-1]
        emulator.launch(cfg, tuple(args))

    with pytest.raises(emulator.EmulatorError, match="W: access up to byte"):
        pipeline.moe_forward(prep, x, tw, ids, SITU, None, arch="gfx950", launch=one_byte_short)


# ------------------------------------------------------------------ int4: fp32 cancellation
INT4_FP32_BOUND = 4e-6


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("x_mean", [0.0, 4.0])
def test_int4_group_scaling_in_fp32_loses_little_to_cancellation(gen, offsets, x_mean):
    """The int4 MFMAs sum (q + 136) x in fp32 and then remove 136 sum(x) (the chains' start, or
    the offset term): an fp32 cancellation. One stage-2 launch with fp32 atomics (no bf16 output
    rounding) at K3's K = 3584, against float64 on the same bf16 activations and int4 weights.
    Activations with a mean of 4 sigma make sum(x) large, the adverse case. Bound: relative L2
    4e-6, 1000x below the bf16 figures above (fp32 sums of 3584 terms cost ~sqrt(K) 6e-8 before
    any cancellation); measured 1.5e-7..4.4e-7 symmetric, 6.5e-7..9.1e-7 with offsets. The
    emulator sums each MFMA in fp32 (torch); the hardware's order inside one MFMA is not modelled."""
    Kd, N, T_ = 3584, 128, 32
    codes = torch.randint(-8, 8, (1, N, Kd), generator=gen, dtype=torch.int8)
    scales = (torch.rand(1, N, Kd // 32, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    offs = (torch.randn(1, N, Kd // 32, generator=gen) * 0.01).to(torch.bfloat16) if offsets else None
    w = int4.Int4Weights(int4.pack_signed(codes), scales, offsets=offs)
    packed = FlyDSLExperts.layout.swizzle(w.packed, "int4")
    x = (torch.randn(T_, Kd, generator=gen) + x_mean).to(torch.bfloat16)
    cfg = kernel_config("gfx942", 2, "int4", N=N, K=Kd, top_k=1, BM=16, waves=4, n_rep=2, reduce="atomic",
                        has_offsets=offsets)
    y = torch.zeros(T_ * N)
    args = (x.reshape(-1), packed.reshape(-1), scales.reshape(-1),
            (offs if offsets else torch.zeros(1, dtype=torch.bfloat16)).reshape(-1),
            torch.arange(T_, dtype=torch.int32), torch.zeros(T_ // 16, dtype=torch.int32), torch.ones(T_),
            y, T_, T_, 0.0, 0.0)
    emulator.launch(cfg, args)
    want = x.double() @ w.dequantize(torch.float64)[0].T
    err = relative_l2(y.view(T_, N).double(), want)
    print(f"int4 fp32 scaling, offsets={offsets}, x mean {x_mean}: rel L2 {err:.2e}")
    assert 0 < err < INT4_FP32_BOUND


def _one_lds_buffer(it, BM, U, buffers, _orig=layout.lds_tile_byte_base):
    return _orig(0, BM, U, buffers)


@pytest.mark.parametrize("arch, BM", [("gfx942", 64), ("gfx950", 128)])
def test_double_buffered_lds_schedule_matches_the_reference(gen, arch, BM, monkeypatch):
    """KLoop.LDS_DB (the large-batch tiers): the emulator stores iteration it+1's tile into the other
    buffer before iteration it reads its own (the order another wave may see), over 3 K iterations on
    stage 1 (the parity comes back to buffer 0) and 2 on stage 2; SiLU and SiTUv2 differ; both tiles
    in one buffer is caught."""
    hidden, inter, tokens = 384, 256, 24
    prep = prepared_layer(gen, arch, hidden=hidden, inter=inter)
    x, tw, ids = random_routing(gen, tokens, E, K, hidden)
    c1, c2 = tiles.stage_configs(arch, prep.weight_format, hidden=hidden, inter=inter, top_k=K,
                                 num_tokens=tokens, activation=SITU)
    v1 = replace(c1, rows=RowBlocks(BM), tile=replace(c1.tile, waves=4, n_rep=2, schedule=KLoop.LDS_DB))
    v2 = replace(c2, rows=RowBlocks(BM), tile=replace(c2.tile, waves=4, n_rep=2, schedule=KLoop.LDS_DB))
    use = ids.long()
    situ = check(prep, arch, x, tw, use, SITU, configs=(v1, v2))
    silu = check(prep, arch, x, tw, use, SILU, configs=(v1.with_activation(SILU), v2))
    assert relative_l2(situ, silu) > 0.05
    monkeypatch.setattr(layout, "lds_tile_byte_base", _one_lds_buffer)
    try:
        bad = emulate(prep, arch, x, tw, use, SITU, configs=(v1, v2))
    except emulator.EmulatorError:
        return
    assert not relative_l2(bad, situ) <= 10 * FAITHFUL_BOUND

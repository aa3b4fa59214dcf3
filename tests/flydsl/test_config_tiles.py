"""Kernel configs are refused when made, never at launch; every token count gets one tile."""
from __future__ import annotations

import copy
import json
from importlib import resources

import pytest
from fly_helpers import SILU, SITU, kernel_config

from k3lab.flydsl.sweep import K3_HIDDEN, K3_INTER_TP8, K3_TOP_K, ci_configs
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.kernels import get_backend
from kimi_k3_moe.kernels.flydsl import tiles
from kimi_k3_moe.kernels.flydsl.build import config_from_json, config_to_json
from kimi_k3_moe.kernels.flydsl.config import KLoop, QuantConfig, Tile, UnsupportedArchError

K3 = dict(hidden=K3_HIDDEN, inter=K3_INTER_TP8, top_k=K3_TOP_K)


def raw_table():
    return json.loads(resources.files("kimi_k3_moe.configs").joinpath("tables", tiles.TABLE).read_text())


def s1(**kw):
    return kernel_config(**kw)


# ------------------------------------------------------------------ tiers
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_every_token_count_gets_exactly_the_first_tier_that_serves_it(arch):
    tiers = tiles.default_table()[arch]
    bounds = [t.max_tokens for t in tiers[:-1]]
    counts = (set(range(1, 5000)) | {b + d for b in bounds for d in (-1, 0, 1) if b + d >= 1}
              | {16384, 32768, 10**6, 2**31})
    for n in sorted(counts):
        tier = tiles.tier_for(arch, n)
        first = next(t for t in tiers if t.max_tokens is None or n <= t.max_tokens)
        assert tier is first, n
        s1_cfg, s2_cfg = tiles.stage_configs(arch, "int4" if arch == "gfx942" else "mxfp4",
                                             num_tokens=n, activation=SITU, **K3)
        assert s1_cfg.BM == s2_cfg.BM == tier.BM
    assert tiles.tier_for(arch, bounds[0]) is tiers[0] and tiles.tier_for(arch, bounds[0] + 1) is tiers[1]
    assert tiles.tier_for(arch, bounds[-1] + 1) is tiers[-1]


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, None])
def test_token_count_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="num_tokens"):
        tiles.tier_for("gfx942", bad)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t["gfx942"].__setitem__(-1, {**t["gfx942"][-1], "max_tokens": 99999}), "last tier"),
    (lambda t: t["gfx942"][0].__setitem__("max_tokens", 4096), "strictly increasing"),
    (lambda t: t["gfx942"][0]["stage1"].pop("schedule"), "stage1: a tile must set"),
    (lambda t: t["gfx942"][0]["stage1"].__setitem__("schedule", "lds_sometimes"), "schedule 'lds_sometimes' is not"),
    (lambda t: t["gfx942"][0]["stage1"].__setitem__("a_lds", True), "stage1: a tile sets either schedule or"),
    (lambda t: t["gfx942"][0]["stage1"].__setitem__("waves", 0), "Tile.waves must be a positive int"),
    (lambda t: t["gfx950"][1].__setitem__("BM", 128), "BM=128"),
    (lambda t: t.__setitem__("gfx90a", t["gfx942"]), "gfx90a"),
])
def test_bad_tables_are_refused_when_loaded(edit, message):
    table = copy.deepcopy(raw_table())
    edit(table)
    with pytest.raises(ValueError, match=message):
        tiles.load_table(table)


@pytest.mark.parametrize("hidden, inter", [(3584, 384), (7168, 3072), (3584, 768), (256, 128), (384, 256)])
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_tiles_fit_every_shape_the_kernels_can_serve(arch, hidden, inter):
    weight_format = "int4" if arch == "gfx942" else "mxfp4"
    for n in (1, 129, 2049):
        c1, c2 = tiles.stage_configs(arch, weight_format, hidden=hidden, inter=inter, top_k=8, num_tokens=n,
                                     activation=SITU)
        assert (c1.shape.N, c1.shape.K, c2.shape.N, c2.shape.K) == (inter, hidden, hidden, inter)


def test_shapes_the_kernels_cannot_tile_are_refused_by_name():
    with pytest.raises(ValueError, match="K % 128"):
        tiles.stage_configs("gfx942", "int4", hidden=3584, inter=192, top_k=8, num_tokens=1, activation=SITU)


# ------------------------------------------------------------------ config validation
@pytest.mark.parametrize("kw, message", [
    (dict(stage=2, N=3584, K=384, split_k=2), "needs reduce='atomic'"),
    (dict(stage=2, N=3584, K=384, reduce="atomic", split_k=2), "does not divide the 3 K"),
    (dict(stage=2, N=3584, K=384, reduce="sum"), "reduce 'sum' not in"),
    (dict(activation="gelu"), "'gelu' is not implemented"),
    (dict(activation=None), "None is not implemented"),
    (dict(activation="situv2"), "beta"),
    (dict(activation="situv2", betas="runtime", beta=4.0), "bakes in no beta"),
    (dict(weight_format="mxfp4"), "not built for gfx942"),
    (dict(N=400), "not a multiple of the tile width"),
    (dict(K=3600), "not a multiple of 128"),
    (dict(BM=24), "multiple of 16"),
    (dict(BM=16, schedule=KLoop.LDS, waves=8, n_rep=1), "split evenly"),
    (dict(BM=32, direct_experts=8), "one pair in each block of 16 rows"),
    (dict(has_offsets=True, arch="gfx950", weight_format="mxfp4"), "int4 weights only"),
    (dict(waves_per_eu=9), "waves_per_eu"),
    (dict(act_dtype="fp8"), "act_dtype 'fp8' has no kernel on gfx942"),
    (dict(arch="gfx950", weight_format="int4", act_dtype="fp4"), "runs on MXFP4 weights"),
    (dict(arch="gfx950", weight_format="mxfp4", act_dtype="fp8", n_rep=1), "n_rep must be even"),
    (dict(arch="gfx950", weight_format="mxfp4", act_dtype="fp8", n_rep=2, schedule=KLoop.LDS, BM=32),
     "no LDS schedule"),
    (dict(arch="gfx950", weight_format="mxfp4", act_dtype="fp8", n_rep=2, direct_experts=8), "direct layout"),
    (dict(arch="gfx950", weight_format="mxfp4", act_dtype="int8"), "'int8' has no kernel on gfx950"),
    (dict(schedule="lds"), "Tile.schedule must be one of"),
    (dict(k_waves=3), "k_waves=3 does not divide the 28 K iterations"),
    (dict(k_waves=2, schedule=KLoop.LDS_PREFETCH, BM=32), "an LDS schedule takes k_waves=1"),
    (dict(k_waves=8, waves=4), "at most 16 waves"),
])
def test_invalid_configs_are_refused_when_made(kw, message):
    with pytest.raises(ValueError, match=message):
        s1(**kw)


def test_valid_split_k_for_the_atomic_stage_2():
    cfg = kernel_config("gfx942", 2, "int4", 3584, 384, 16, reduce="atomic", split_k=3)
    assert cfg.k_iters == 1 and cfg.name.endswith("red_atomic_sk3")


@pytest.mark.parametrize("arch", ["gfx90a", "gfx1100", "sm_90"])
def test_unsupported_arch_names_itself_and_the_supported_ones(arch):
    with pytest.raises(UnsupportedArchError, match=f"{arch}.*gfx942.*gfx950|gfx942.*gfx950.*{arch}"):
        get_backend("flydsl", arch=arch)
    with pytest.raises(UnsupportedArchError, match=arch):
        s1(arch=arch)


def test_only_silu_and_situv2_reach_a_kernel():
    with pytest.raises(ValueError, match="ActivationSpec"):
        s1().with_activation("gelu")
    with pytest.raises(ValueError, match="not supported"):
        ActivationSpec("gelu")


# ------------------------------------------------------------------ names = cache identity
def test_names_carry_activation_and_exact_beta_bits():
    base = s1()
    names = {
        "silu": base.with_activation(SILU).name,
        "k3": base.with_activation(SITU).name,
        "other": base.with_activation(ActivationSpec.situv2(2.0, 1.5)).name,
        "k3 up unchanged": base.with_activation(ActivationSpec.situv2(4.0, None)).name,
        "one ulp off": base.with_activation(ActivationSpec.situv2(4.000000000000001, 25.0)).name,
        "runtime": base.with_activation(SITU, betas="runtime").name,
    }
    assert len(set(names.values())) == len(names), names
    assert "situv2_b4010000000000000_lb4039000000000000" in names["k3"]
    assert names["runtime"].endswith("situv2_rtbeta")
    # runtime betas: one binary serves every beta pair (they are kernel arguments)
    assert base.with_activation(SITU, betas="runtime") == base.with_activation(
        ActivationSpec.situv2(2.0, 1.5), betas="runtime")


def test_names_are_pinned_for_every_field_that_enters_them():
    """Names are FlyDSL's cache folders and kernel symbols: a change here must be deliberate."""
    tile = dict(N=384, K=3584, top_k=16, BM=32, waves=4, n_rep=2)
    down = dict(stage=2, N=3584, K=384, top_k=16)
    got = [
        kernel_config("gfx942", 1, "int4", **tile).with_activation(SITU).name,
        kernel_config("gfx942", 1, "int4", has_offsets=True, **tile).name,
        kernel_config("gfx950", 1, "mxfp4", act_dtype="fp8", **tile).with_activation(SITU, betas="runtime").name,
        kernel_config("gfx950", weight_format="mxfp4", act_dtype="fp4", reduce="atomic", split_k=3, **down).name,
        kernel_config("gfx950", weight_format="int4", waves_per_eu=2, schedule=KLoop.LDS, **down).name,
        kernel_config("gfx942", 1, "int4", k_waves=7, waves=1, n_rep=1, schedule=KLoop.GLOBAL_PREFETCH,
                      direct_experts=896, N=384, K=3584).name,
        kernel_config("gfx942", 2, "int4", 3584, 384, BM=64, schedule=KLoop.LDS_LOAD_FIRST).name,
        QuantConfig("gfx950", "fp4").name,
        QuantConfig("gfx950", "fp8", waves=2).name,
    ]
    assert got == [
        "k3moe_s1_gfx942_int4_n384_k3584_top16_bm32_w4x2_u1_situv2_b4010000000000000_lb4039000000000000",
        "k3moe_s1_gfx942_int4ofs_n384_k3584_top16_bm32_w4x2_u1_silu",
        "k3moe_s1_gfx950_mxfp4_a8_n384_k3584_top16_bm32_w4x2_u1_situv2_rtbeta",
        "k3moe_s2_gfx950_mxfp4_a4_n3584_k384_top16_bm16_w4x2_u1_red_atomic_sk3",
        "k3moe_s2_gfx950_int4_n3584_k384_top16_bm16_w4x2_u1_lds_wpe2_red_slots",
        "k3moe_s1_gfx942_int4_n384_k3584_top16_bm16_w1x1_kw7_u1_pf_dir896_silu",
        "k3moe_s2_gfx942_int4_n3584_k384_top16_bm64_w4x2_u1_lds_lf_red_slots",
        "k3moe_q_gfx950_fp4_w4",
        "k3moe_q_gfx950_fp8_w2",
    ]


def test_every_ci_config_has_a_unique_plain_symbol_name():
    configs = ci_configs()
    names = [c.name for c in configs]
    assert len(names) == len(set(names)) == len(configs)
    assert all(n.isidentifier() for n in names)
    for arch in ("gfx942", "gfx950"):
        acts = {c.activation_tag() for c in configs if c.arch == arch and c.stage == 1}
        assert {"silu", "situv2_rtbeta", SITU.cache_tag(), ActivationSpec.situv2(2.0, 1.5).cache_tag()} <= acts


def test_sweep_covers_every_tier_tile():
    configs = set(ci_configs())
    for arch, weight_format in (("gfx942", "int4"), ("gfx950", "mxfp4")):
        for tier in tiles.default_table()[arch]:
            n = tier.max_tokens or 10**6
            for act in (SILU, SITU):
                assert set(tiles.stage_configs(arch, weight_format, num_tokens=n, activation=act, **K3)) <= configs
    assert any(c.has_offsets for c in configs if c.arch == "gfx942")


@pytest.mark.parametrize("act_dtype", ["fp8", "fp4"])
@pytest.mark.parametrize("hidden, inter", [(3584, 384), (7168, 3072), (256, 128), (384, 256)])
def test_quantized_tiles_keep_scale_groups_whole(act_dtype, hidden, inter):
    for n in (1, 129, 2049, 100000):
        c1, c2 = tiles.stage_configs("gfx950", "mxfp4", hidden=hidden, inter=inter, top_k=8, num_tokens=n,
                                     activation=SITU, act_dtype=act_dtype)
        assert c1.tile.n_rep % 2 == 0 and not c1.tile.schedule.staged and not c2.tile.schedule.staged
        assert c1.act_dtype == c2.act_dtype == act_dtype
        assert c1.BN == c1.tile.waves * c1.tile.n_rep * 16 and inter % c1.BN == 0


def test_quantized_names_differ_from_bf16_and_from_each_other():
    names = {a: tiles.stage_configs("gfx950", "mxfp4", num_tokens=1, activation=SITU, act_dtype=a, **K3)[0].name
             for a in ("bf16", "fp8", "fp4")}
    assert len(set(names.values())) == 3 and "_a8_" in names["fp8"] and "_a4_" in names["fp4"]
    assert all(n.endswith(SITU.cache_tag()) for n in names.values())


# ------------------------------------------------------------------ the K-loop schedule and the table's schema
def test_the_schedule_is_one_of_the_legal_combinations_of_the_three_old_flags():
    """Every schedule but the double buffer (newer than the flags) is one combination of them."""
    flagged = [s for s in KLoop if not s.double_buffered]
    legal = {(s.staged, s.prefetch, s.load_first) for s in flagged}
    assert len(legal) == len(flagged) == 6 and not any(pf and lf for _, pf, lf in legal)
    for s in flagged:
        assert KLoop.from_flags(s.staged, s.prefetch, s.load_first) is s
        assert s.with_staging(not s.staged).with_staging(s.staged) is s
    db = KLoop.LDS_DB
    assert db.staged and db.prefetch and not db.load_first and db.lds_buffers == 2 and db.name_suffix == "_lds_db"
    assert db.with_staging(True) is db and db.with_staging(False) is KLoop.GLOBAL_PREFETCH
    assert [s.lds_buffers for s in flagged] == [int(s.staged) for s in flagged]
    with pytest.raises(ValueError, match="load_first .* choose one"):
        KLoop.from_flags(True, prefetch=True, load_first=True)


def test_tables_written_before_the_schedule_are_read_as_the_same_tiles():
    """User tables from `kimi-k3-moe tune` before KLoop spell it as a_lds/prefetch/load_first."""
    legacy = copy.deepcopy(raw_table())
    for arch in ("gfx942", "gfx950"):
        for row in legacy[arch]:
            for stage in ("stage1", "stage2"):
                tile = row[stage]
                if KLoop(tile["schedule"]).double_buffered:   # newer than the flags: no legacy spelling
                    continue
                schedule = KLoop(tile.pop("schedule"))
                tile["a_lds"] = schedule.staged
                if schedule.prefetch or schedule.load_first:
                    tile["prefetch" if schedule.prefetch else "load_first"] = True
    assert tiles.load_table(legacy) == tiles.default_table()
    assert Tile.from_row({"waves": 4, "n_rep": 2, "kb_unroll": 1, "a_lds": False}) == Tile()
    with pytest.raises(ValueError, match="either schedule or a_lds"):
        Tile.from_row({"waves": 4, "n_rep": 2, "kb_unroll": 1, "prefetch": True})


def test_every_tier_row_reads_back_as_itself():
    for arch, tiers in tiles.default_table().items():
        assert tiles.load_table({arch: [tiles.tier_row(t) for t in tiers]})[arch] == tiers


def test_configs_cross_the_compile_process_boundary_unchanged():
    for cfg in ci_configs():
        assert config_from_json(config_to_json(cfg)) == cfg

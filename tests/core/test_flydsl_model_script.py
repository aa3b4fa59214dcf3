"""benchmarks/flydsl_model.py's pure parts: routing statistics, bytes, the forward's other launches."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import flydsl_model as fm  # noqa: E402


def test_routing_statistics():
    assert fm.routes.distinct_experts(1) == pytest.approx(fm.TOP_K)
    assert fm.routes.expected_blocks(1, 16) == pytest.approx(fm.TOP_K)          # one row per touched expert
    assert fm.routes.distinct_experts(16384) == pytest.approx(fm.E, rel=1e-6)
    # many tokens: T*k/BM blocks plus less than one block of padding per expert
    blocks = fm.routes.expected_blocks(16384, 64)
    assert 16384 * fm.TOP_K / 64 < blocks < 16384 * fm.TOP_K / 64 + fm.E


def test_weight_bytes_per_format():
    assert fm.weight_bytes("mxfp4", 32, 32) == 32 * 16 + 32        # nibbles + one e8m0 byte per 32
    assert fm.weight_bytes("int4", 32, 32) == 32 * 16 + 32 * 2     # nibbles + one bf16 scale per 32


def test_aiter_tiles_are_read_as_aiters_host_reads_its_table_names():
    s1 = fm.PeerSpec.from_tile("gfx950", 1, "t32x32x256_w4_xcd4_kw2")
    assert (s1.BM, s1.tile_n, s1.tile_k, s1.k_wave, s1.b_cache_mod, s1.xcd) == (32, 32, 256, 2, 2, 4)
    s2 = fm.PeerSpec.from_tile("gfx950", 2, "t16x128x128_atomic_persist")    # stage 2: no _bnt means 0
    assert (s2.BM, s2.tile_n, s2.tile_k, s2.k_wave, s2.b_cache_mod, s2.xcd) == (16, 128, 128, 1, 0, 0)
    # waves per EU and persist are not passed to this kernel at run time: same kernel, same key
    assert fm.PeerSpec.from_tile("gfx950", 1, "t32x128x128_w3_xcd4").key == \
        fm.PeerSpec.from_tile("gfx950", 1, "t32x128x128_xcd4").key
    for bad in ("t32x128", "t32x128x128_reduce", "t32x128x128_gui"):
        with pytest.raises(ValueError, match="aiter tile"):
            fm.PeerSpec.from_tile("gfx950", 2, bad)


def test_aiters_rows_are_whole_and_their_tiles_fit_the_shape():
    pre, retune = fm.aiter_rows.PRE_RETUNE, fm.aiter_rows.RETUNE_5118
    assert [r[0] for r in pre] == [1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert all(r[0] <= 512 for r in retune) and len(retune) == 11
    # the published totals quoted in docs: pre-retune 26.77 / 103.28 / 338.34 / 407.48 / 3096.31 us
    totals = {r[0]: r[2] + r[4] for r in pre}
    assert [round(totals[t], 2) for t in (1, 16, 128, 1024, 16384)] == [26.77, 103.28, 338.34, 407.48, 3096.31]
    for tokens, tile1, _, tile2, _ in pre + retune:
        s1, s2 = fm.peer_pair(tile1, tile2)
        assert s1.BM == s2.BM == (16 if (tokens, tile1) in [(r[0], r[1]) for r in retune] else 32)
        assert fm.I % s1.tile_n == 0 and fm.H % s2.tile_n == 0 and fm.I % s2.tile_k == 0
    specs = fm.all_peer_specs()
    assert len(specs) == len({s.key for s in specs})
    for measured in (fm.aiter_rows.A8W4, fm.aiter_rows.A4W4):
        assert set(measured) == set(fm.TIERS)
    # no stored copy of the newest a16w4 table holds 2048 / 8192-token rows: those cells stay empty
    for measured in (fm.aiter_rows.NEWEST_A16W4, fm.aiter_rows.GFX942_A16W4):
        assert set(measured) == set(fm.TIERS) - {2048, 8192}


def test_floors():
    # 2 x 16 x (3584 x 768 + 384 x 3584) = 132.1 MFLOP a token
    assert fm.flop_per_token() == 2 * 16 * (3584 * 768 + 384 * 3584) == pytest.approx(132.1e6, rel=1e-3)
    # each arch's dense bf16 MFMA rate from its traits: AMD's published 1307 (MI300X) and ~2.5 PFLOP/s (MI355X)
    assert fm.bf16_tflops("gfx942") == pytest.approx(1307.4, rel=1e-3)
    assert fm.bf16_tflops("gfx950") == pytest.approx(2516.6, rel=1e-3)
    # MI355X 16384 tokens: 860 us, MI300X 4096: 414 us
    assert fm.compute_floor_us("gfx950", 16384) == pytest.approx(860, rel=0.01)
    assert fm.compute_floor_us("gfx942", 4096) == pytest.approx(414, rel=0.01)
    # all 896 experts' int4 weights and bf16 scales at MI300X's 5.3 TB/s
    every = fm.E * (fm.weight_bytes("int4", 2 * fm.I, fm.H) + fm.weight_bytes("int4", fm.H, fm.I))
    assert fm.hbm_floor_us("gfx942", 16384) == pytest.approx(every / 5.3e12 * 1e6, rel=1e-6)
    assert fm.hbm_floor_us("gfx950", 1) < fm.hbm_floor_us("gfx942", 1)


@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_glue_launches_are_traced_without_memory(arch):
    """The forward's launches besides the two stages, recorded on meta tensors (16384 tokens costs
    nothing): the top-k sum alone on a direct tier, the alignment's one or two launches before it
    above (none after stage 2 with the fused sum), and never a PyTorch op that computes."""
    def names(tokens, reduce):
        return [name for name, _ in fm.glue_ops(arch, tokens, reduce)]
    assert names(1, "auto") == ["stage2.reduce"]
    assert names(16, "auto") == ["align.small", "stage2.reduce"]
    assert names(4096, "slots") == ["align.count", "align.scatter", "stage2.reduce"]
    assert names(4096, "fused") == ["align.count", "align.scatter"]
    # the top-k sum reads T x k x H bf16 slot rows and writes T x H
    big = dict(fm.glue_ops(arch, 16384, "slots"))
    assert big["stage2.reduce"] >= 16384 * fm.TOP_K * fm.H * 2 + 16384 * fm.H * 2
    # the atomic sum (the table's choice on gfx950 above 8192 tokens): an fp32 [T, H] zeroed, then converted
    atomic = fm.glue_ops(arch, 16384, "atomic")
    assert [name for name, _ in atomic][-2:] == ["stage2.zero", "stage2.cast"]
    assert dict(atomic)["stage2.cast"] == 16384 * fm.H * (4 + 2)


def test_quantized_forward_adds_the_quantization_launch():
    ops = fm.glue_ops("gfx950", 16, act_dtype="fp8")
    assert [name for name, _ in ops] == ["align.small", "k3moe_q_gfx950_fp8_w4", "stage2.reduce"]
    # it reads the bf16 rows and writes one byte a code and an e8m0 scale per 32
    assert dict(ops)["k3moe_q_gfx950_fp8_w4"] >= 16 * fm.H * (2 + 1 + 1 / 32)


def test_skewed_routing_is_the_benchs_draw():
    """The model's skewed histogram is one draw of the bench's own generator (seed and sigma stated):
    every (token, slot) lands somewhere, a few hot experts hold most rows, and the row blocks at a BM
    are the per-expert ceilings."""
    import torch

    from kimi_k3_moe.bench.data import RoutingSource
    from kimi_k3_moe.bench.routing import Routing

    rows = fm.RoutingModel("skewed").rows(512)
    assert sum(rows) == 512 * fm.TOP_K and len(rows) == fm.E
    gen = torch.Generator().manual_seed(0)
    _, ids = RoutingSource(Routing("skewed", 1.0), fm.E, fm.TOP_K, "cpu", gen)(512)
    assert tuple(torch.bincount(ids.flatten().long(), minlength=fm.E).tolist()) == rows
    skewed, uniform = fm.RoutingModel("skewed"), fm.UNIFORM
    assert skewed.blocks(512, 64) == sum(-(-c // 64) for c in rows)
    assert skewed.distinct(512) == sum(1 for c in rows if c) < uniform.distinct(512)
    summary = skewed.summary(4096, 64)
    assert summary["top5pct_share"] > 0.3 > 0.05          # uniform: 5 % of the experts hold ~5 % of the rows
    assert summary["max_rows"] <= 4096 and summary["max_blocks"] == -(-summary["max_rows"] // 64)
    blocks = fm.routes.expected_blocks(4096, 64)
    assert uniform.summary(4096, 64)["padding"] == pytest.approx(1 - 4096 * 16 / (blocks * 64), abs=1e-3)
    with pytest.raises(ValueError, match="routing 'zipf'"):
        fm.RoutingModel("zipf")


def test_the_grids_tail_and_what_balancing_it_would_save():
    """A stage whose workgroups fill 2.25 rounds of the GPU: the last round is a quarter full, and its
    work spread over every slot would spend 2.25 rounds' compute instead of 3 (memory-bound: nothing;
    a launch within one round: nothing claimed)."""
    from k3lab.flydsl.isa_model import Kernel, LaunchTime, Params

    device = fm.isa_model.MI300X
    kernel = Kernel("k", (), {}, vgpr=128, agpr=0, accum_offset=None, lds_bytes=0, waves_per_workgroup=4)
    slots = fm._slots(fm.Launch("s", kernel, 1, 0.0, 1), device)
    assert slots == device.cus * 4    # 128 VGPRs: 4 waves a SIMD, 16 a CU, four 4-wave workgroups
    launch = fm.Launch("s", kernel, int(2.25 * slots), 0.0, 1)
    params = Params(t0_us=1.0)
    detail = fm._detail(launch, LaunchTime(301.0, 300.0, 10.0, 3, 4, 1.0), device, params)
    assert detail["last_round_fill"] == pytest.approx(0.25, abs=1e-3)
    assert detail["balanced_tail_us"] == pytest.approx(1.0 + 300.0 * 2.25 / 3, rel=1e-3)
    hbm_bound = fm._detail(launch, LaunchTime(401.0, 300.0, 400.0, 3, 4, 1.0), device, params)
    assert hbm_bound["balanced_tail_us"] == pytest.approx(401.0)
    small = fm.Launch("s", kernel, slots // 2, 0.0, 1)
    assert fm._detail(small, LaunchTime(51.0, 50.0, 1.0, 1, 4, 1.0), device, params)["balanced_tail_us"] == 51.0


def test_targets_say_met_or_missed_with_the_figure(capsys):
    row = {"tokens": 4096, "ours_all_over_compute_floor": 2.4, "ours_all_over_compute_floor_band": [2.2, 2.9],
           "skewed_over_uniform": 1.1, "skewed_over_uniform_band": [1.0, 1.2]}
    fm.print_targets({"gfx942 int4 bf16-act vs aiter": [row]})
    out = capsys.readouterr().out
    assert "| ours all over compute floor | <= 2.0 | 2.40 (2.20-2.90) MISSED |" in out
    assert "| skewed over uniform | <= 1.25 | 1.10 (1.00-1.20) met |" in out

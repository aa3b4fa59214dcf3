"""benchmarks/flydsl_model.py's pure parts: routing statistics, bytes, the forward's other launches."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import flydsl_model as fm  # noqa: E402


def test_routing_statistics():
    assert fm.distinct_experts(1) == pytest.approx(fm.TOP_K)
    assert fm.expected_blocks(1, 16) == pytest.approx(fm.TOP_K)          # one row per touched expert
    assert fm.distinct_experts(16384) == pytest.approx(fm.E, rel=1e-6)
    # many tokens: T*k/BM blocks plus less than one block of padding per expert
    blocks = fm.expected_blocks(16384, 64)
    assert 16384 * fm.TOP_K / 64 < blocks < 16384 * fm.TOP_K / 64 + fm.E


def test_weight_bytes_per_format():
    assert fm.weight_bytes("mxfp4", 32, 32) == 32 * 16 + 32        # nibbles + one e8m0 byte per 32
    assert fm.weight_bytes("int4", 32, 32) == 32 * 16 + 32 * 2     # nibbles + one bf16 scale per 32


def test_peer_tiles_follow_aiters_table():
    s1, s2 = fm.peer_specs("gfx950", 1)
    assert (s1.BM, s1.tile_n, s1.tile_k, s1.k_wave) == (16, 32, 256, 2)
    s1, _ = fm.peer_specs("gfx950", 1024)
    assert (s1.BM, s1.tile_n, s1.tile_k, s1.k_wave) == (32, 128, 128, 1)
    assert fm.I % s2.tile_k == 0 and fm.H % s2.tile_n == 0


@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_glue_launches_are_traced_without_memory(arch):
    """The forward's launches besides the two stages, recorded on meta tensors (16384 tokens costs
    nothing): the top-k sum alone on a direct tier, the alignment's one or two launches before it
    above, and never a PyTorch op that computes."""
    tiers = {t: [name for name, _ in fm.glue_ops(arch, t)] for t in (1, 16, 4096)}
    assert tiers[1] == ["stage2.reduce"]
    assert tiers[16] == ["align.small", "stage2.reduce"]
    assert tiers[4096] == ["align.count", "align.scatter", "stage2.reduce"]
    # the top-k sum reads T x k x H bf16 slot rows and writes T x H
    big = dict(fm.glue_ops(arch, 16384, "slots"))
    assert big["stage2.reduce"] >= 16384 * fm.TOP_K * fm.H * 2 + 16384 * fm.H * 2
    # the atomic sum (the table's choice on gfx950 above 8192 tokens): an fp32 [T, H] zeroed, then converted
    atomic = fm.glue_ops(arch, 16384, "atomic")
    assert [name for name, _ in atomic][-2:] == ["stage2.zero", "stage2.cast"]
    assert dict(atomic)["stage2.cast"] == 16384 * fm.H * (4 + 2)
"""`kimi-k3-moe tune --backend flydsl` at prefill sizes: from 2048 tokens the packaged large-batch rows
and the tier's tiles on the LDS double buffer compete with the tier's own tiles, so the first run on
an AMD GPU keeps the measured faster one.

No AMD GPU and no compiler here: the tuner's compile step and its timing are FAKED (every kernel
"compiles"; the fake clock makes the largest-BM large-batch row the fastest), and each candidate's
run is the float reference itself, so the reference check passes. What is tested is the candidate
set and the loop's choice from it, not a kernel.
"""
from __future__ import annotations

import pytest
import torch

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.bench.data import random_experts
from kimi_k3_moe.bench.shapes import Shape
from kimi_k3_moe.bench.timing import FakeClock
from kimi_k3_moe.configs import user_tables
from kimi_k3_moe.kernels.flydsl import tiles
from kimi_k3_moe.kernels.flydsl.config import KLoop
from kimi_k3_moe.reference import dense_moe
from kimi_k3_moe.tune import flydsl_target
from kimi_k3_moe.tune.flydsl_target import LARGE_BATCH, FlyDSLTarget, double_buffered, large_batch_tiles
from kimi_k3_moe.tune.loop import TIMED, tune
from kimi_k3_moe.weights.requant import requantize_experts

SHAPE = Shape("fly_tiny", 256, 128, 6, topk=4)
SITU = ActivationSpec.situv2(beta=4.0, linear_beta=0.25)


def _rows_for_prefill(arch):
    return [r for r in tiles.default_table()[arch] if not r.direct and (r.max_tokens or 1 << 30) >= LARGE_BATCH]


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_large_batch_rows_are_candidates_from_2048_tokens(arch):
    assert LARGE_BATCH == 2048 and {2048, 4096, 8192, 16384} <= set(flydsl_target.TIERS)
    assert large_batch_tiles(arch, 1024) == []
    for tier in (2048, 4096, 16384):
        base = tiles.tier_for(arch, tier, tiles.default_table())
        got = large_batch_tiles(arch, tier)
        rows = _rows_for_prefill(arch)
        assert [(t.BM, t.stage1, t.stage2) for t in got] == [(r.BM, r.stage1, r.stage2) for r in rows]
        assert all(t.max_tokens == tier and t.reduce == base.reduce for t in got)   # the table's top-k sum
        db = double_buffered(tier, base)
        assert [(t.BM, t.stage1.schedule, t.stage2.schedule) for t in db] == [
            (base.BM, KLoop.LDS_DB, base.stage2.schedule), (base.BM, base.stage1.schedule, KLoop.LDS_DB),
            (base.BM, KLoop.LDS_DB, KLoop.LDS_DB), (128, KLoop.LDS_DB, KLoop.LDS_DB)]
        assert all(t.stage1.waves_per_eu <= 2 for t in db if t.stage1.schedule is KLoop.LDS_DB)
    assert double_buffered(1024, tiles.tier_for(arch, 1024, tiles.default_table())) == []


def _target(arch, gen, tables, tiers):
    experts = random_experts(SHAPE.num_experts, SHAPE.hidden, SHAPE.inter, "cpu", gen)
    if arch == "gfx942":
        experts = requantize_experts(experts, progress=False)

    done: dict = {}

    class FakedRuns(FlyDSLTarget):
        def runner(self, cand):   # FAKED: the float reference stands in for the kernels (no AMD GPU here)
            w13_of, w2_of = self.reference_weights()

            def run(h, w, i, emap):   # one reference per routing draw, whichever candidate asks
                key = (id(h), id(i))
                if key not in done:
                    done[key] = dense_moe(h, w13_of, w2_of, w, i, SITU, emap, compute_dtype=torch.float32)
                return done[key]
            return run

    # the packaged tier and the large-batch candidates only (the search around them is the FlyDSL suite's)
    rounds = 1 + len(_rows_for_prefill(arch)) + 4
    return FakedRuns(SHAPE, experts, SITU, arch=arch, identity=user_tables.device_identity(), out_dir=tables / "b",
                     tiers=tiers, compiler=lambda cfg: (True, "compile FAKED"), max_per_round=rounds)


def fake_time(label: str) -> float:
    """FAKED timing: a large-batch row is faster the larger its BM; everything else 100 us."""
    if "large-batch" not in label:
        return 100.0
    return 100.0 - int(label.split(" BM")[1].split()[0]) / 4


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_tune_keeps_the_faster_large_batch_row(arch, gen, seed, tables):
    target = _target(arch, gen, tables, [1024, 4096])
    labels = {t: [c.label for c in target.candidates(t, {})] for t in (1024, 4096)}
    assert not any("large-batch" in x for x in labels[1024])
    assert labels[4096][0] == target.candidates(4096, {})[0].label and "large-batch" not in labels[4096][0]
    assert len({c.key for c in target.candidates(4096, {})}) == len(labels[4096])
    result = tune(target, SITU, FakeClock(fake_time), budget_s=1e9, state_path=tables / "state.json", device="cpu",
                  seed=seed)
    timed = {o["label"]: o["us"] for o in result["outcomes"]["4096"].values() if o["status"] == TIMED}
    assert any("large-batch" in x for x in timed)
    # a candidate with the packaged tier's tiles is that candidate (one key): the others compete with it
    base = tiles.tier_for(arch, 4096, tiles.default_table())
    best_bm = max(t.BM for t in large_batch_tiles(arch, 4096) + double_buffered(4096, base)
                  if (t.BM, t.stage1, t.stage2) != (base.BM, base.stage1, base.stage2))
    assert any("lds_db" in x for x in timed)
    assert result["tiers"][4096]["us"] == pytest.approx(100.0 - best_bm / 4)
    assert result["tiers"][1024]["us"] == 100.0
    # the written user table serves 4096 tokens with the winning row's BM
    s1, _ = tiles.stage_configs(arch, target.weight_format, hidden=SHAPE.hidden, inter=SHAPE.inter, top_k=SHAPE.topk,
                                num_tokens=4096, activation=SITU)
    assert s1.BM == best_bm

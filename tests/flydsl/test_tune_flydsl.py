"""`kimi-k3-moe tune --backend flydsl` end to end without an AMD GPU.

Every candidate's kernels are really compiled (compile-only, in subprocesses,
for gfx942); the CPU emulator runs them; a fake clock times them (no GPU here)
and makes the deliberately wrong candidate the fastest, so only the reference
check can keep it out. One candidate is built against a missing linker (a real
compile failure) and one asks for an impossible tile (refused before building).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from fly_helpers import SITU, random_layer, toolchain_or_skip

from k3lab.flydsl import emulator
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.bench.shapes import Shape
from kimi_k3_moe.bench.timing import FakeClock
from kimi_k3_moe.configs import user_tables
from kimi_k3_moe.kernels.flydsl import tiles
from kimi_k3_moe.kernels.flydsl.tiles import Tier
from kimi_k3_moe.tune.flydsl_target import FlyDSLTarget
from kimi_k3_moe.tune.loop import FAILED, REJECTED, SKIPPED, TIMED, Candidate, tune
from kimi_k3_moe.weights.requant import requantize_experts

SHAPE = Shape("fly_tiny", 256, 128, 6, topk=4)
TIERS = [4, 32]


class Rigged(FlyDSLTarget):
    def candidates(self, tier, done):
        real = super().candidates(tier, done)[:2]
        base = real[0].config
        no_linker = Tier(tier, base.BM, replace(base.stage1, kb_unroll=2), base.stage2)
        impossible = Tier(tier, tiles.MAX_BM + 16, base.stage1, base.stage2)   # past the largest BM
        wrong = Tier(tier, base.BM, base.stage1, replace(base.stage2, n_rep=1))
        return real + [Candidate(tier, "nolink", no_linker, f"T{tier} no-linker"),
                       Candidate(tier, "bm_past_max", impossible, f"T{tier} impossible-tile"),
                       Candidate(tier, "wrong", wrong, f"T{tier} wrong-activation")]

    def _build(self, cfg):
        if cfg.tile.kb_unroll == 2 and cfg.stage == 1:
            saved, self.rocm = self.rocm, "/nonexistent/rocm"  # no ld.lld there: the link step fails
            try:
                return super()._build(cfg)
            finally:
                self.rocm = saved
        return super()._build(cfg)

    def runner(self, cand):
        if "wrong-activation" in cand.label:  # a kernel that ignores the activation (defect class 1)
            from kimi_k3_moe.kernels.flydsl import pipeline
            silu = ActivationSpec.silu()
            s = self.shape
            cfgs = tiles.stage_configs(self.arch, self.weight_format, hidden=s.hidden, inter=s.inter, top_k=s.topk,
                                       num_tokens=cand.tier, activation=silu,
                                       table={self.arch: (replace(cand.config, max_tokens=None),)})
            return lambda h, w, i, emap: pipeline.moe_forward(self.prepared, h, w, i, silu, emap, arch=self.arch,
                                                        launch=emulator.launch, configs=cfgs)
        return super().runner(cand)


def fake_time(label):
    return 3.0 if "wrong" in label else 40.0 + len(label) % 5


def test_flydsl_tune_loop_against_compile_only_builds(tables, gen, seed):
    rocm = toolchain_or_skip()
    layer = requantize_experts(random_layer(gen, experts=SHAPE.num_experts, hidden=SHAPE.hidden, inter=SHAPE.inter),
                               progress=False)
    identity = user_tables.device_identity()
    target = Rigged(SHAPE, layer, SITU, arch="gfx942", identity=identity, launch=emulator.launch,
                    out_dir=tables / "build", rocm=rocm, tiers=TIERS)
    state = tables / "state.json"
    result = tune(target, SITU, FakeClock(fake_time), budget_s=1e9, state_path=state, device="cpu", seed=seed)
    for tier in TIERS:
        outcomes = {o["label"]: o for o in result["outcomes"][str(tier)].values()}
        print(tier, {k: (v["status"], v.get("why", "")[:60]) for k, v in outcomes.items()})
        assert outcomes[f"T{tier} no-linker"]["status"] == SKIPPED
        assert "does not compile" in outcomes[f"T{tier} no-linker"]["why"]
        assert outcomes[f"T{tier} impossible-tile"]["status"] == SKIPPED
        assert "invalid" in outcomes[f"T{tier} impossible-tile"]["why"]
        assert outcomes[f"T{tier} wrong-activation"]["status"] == REJECTED
        assert "SiLU" in outcomes[f"T{tier} wrong-activation"]["why"]
        assert all(o["status"] != FAILED for o in outcomes.values())
        assert sum(o["status"] == TIMED for o in outcomes.values()) >= 2
        assert result["tiers"][tier]["us"] >= 40.0
    # dispatch reads it back: the tile lookup for this arch and shape takes the tuned tiers
    winner = {t: next(c for c in target.candidates(t, result["outcomes"][str(t)])
                      if result["outcomes"][str(t)].get(c.key, {}).get("us") == result["tiers"][t]["us"]).config
              for t in TIERS}
    for t in TIERS:
        s1, s2 = tiles.stage_configs("gfx942", "int4", hidden=SHAPE.hidden, inter=SHAPE.inter, top_k=SHAPE.topk,
                                     num_tokens=t, activation=SITU)
        assert s1.BM == winner[t].BM
    assert user_tables.describe(tiles.USER_TABLE).startswith("user table ")
    # resume: nothing is compiled, run or timed again
    calls = []
    again = Rigged(SHAPE, layer, SITU, arch="gfx942", identity=identity, launch=emulator.launch,
                   out_dir=tables / "build", rocm=rocm, tiers=TIERS,
                   compiler=lambda cfg: calls.append(cfg.name) or (True, ""))
    second = tune(again, SITU, FakeClock(fake_time), budget_s=1e9, state_path=state, device="cpu", seed=seed + 1)
    assert second["resumed"] == sum(len(v) for v in result["outcomes"].values()) and calls == []
    assert torch.get_num_threads() == 1

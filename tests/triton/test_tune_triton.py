"""`kimi-k3-moe tune --backend triton` end to end under the interpreter at a tiny shape.

The loop is the real one (candidates from tuning_space, the reference check,
the table writer, dispatch reading the table back); the GPU timer is replaced
by a fake clock (no GPU here) that makes the deliberately wrong candidate the
fastest, so only the reference check can keep it out of the table.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.bench.data import random_experts
from kimi_k3_moe.bench.shapes import NAMED
from kimi_k3_moe.bench.timing import FakeClock
from kimi_k3_moe.configs import user_tables
from kimi_k3_moe.kernels import get_backend
from kimi_k3_moe.kernels.triton import table as tt
from kimi_k3_moe.kernels.triton import tuning_space
from kimi_k3_moe.tune.loop import REJECTED, SKIPPED, TIMED, Candidate, tune
from kimi_k3_moe.tune.triton_target import TritonTarget

SITU = ActivationSpec.situv2(4.0, 25.0)
SHAPE = NAMED["tiny"]
TIERS = [1, 4]


class Rigged(TritonTarget):
    """The real target, limited to a few candidates, plus one that does not compile (block_k does not
    divide K) and one that ignores the activation (runs SiLU: defect class 1)."""

    def candidates(self, tier, done):
        real = super().candidates(tier, done)[:2]
        base = real[0].config
        bad = replace(base, stage1=replace(base.stage1, block_k=96))
        wrong = replace(base, stage2=replace(base.stage2, num_warps=2 if base.stage2.num_warps != 2 else 4))
        return real + [Candidate(tier, "bad-" + real[0].key, bad, f"T{tier} does-not-compile"),
                       Candidate(tier, "wrong-" + real[0].key, wrong, f"T{tier} wrong-activation")]

    def runner(self, cand):
        if "wrong-activation" in cand.label:
            be = get_backend("triton", weight_format=self.weight_format, config=cand.config)
            return lambda h, w, i, emap: be.forward(self.prepared, h, w, i, ActivationSpec.silu(), emap)
        return super().runner(cand)


def fake_time(label: str) -> float:
    return 5.0 if "wrong" in label else 50.0 + len(label) % 7


def make_target(seed, **kw):
    experts = random_experts(SHAPE.num_experts, SHAPE.hidden, SHAPE.inter, "cpu", torch.Generator().manual_seed(seed))
    return Rigged(SHAPE, experts, SITU, identity=user_tables.device_identity(), tiers=TIERS, **kw)


def test_tune_skips_rejects_writes_and_dispatch_reads_back_then_resumes(tables, seed):
    state = tables / "state.json"
    target = make_target(seed)
    result = tune(target, SITU, FakeClock(fake_time), budget_s=1e9, state_path=state, device="cpu", seed=seed)
    for tier in TIERS:
        outcomes = {o["label"]: o for o in result["outcomes"][str(tier)].values()}
        assert outcomes[f"T{tier} does-not-compile"]["status"] == SKIPPED
        assert "block_k" in outcomes[f"T{tier} does-not-compile"]["why"]
        wrong = outcomes[f"T{tier} wrong-activation"]
        assert wrong["status"] == REJECTED and "SiLU" in wrong["why"], wrong
        assert sum(o["status"] == TIMED for o in outcomes.values()) == 2
        assert result["tiers"][tier]["tuned"] and result["tiers"][tier]["us"] >= 50.0  # not the wrong one

    # dispatch: the backend's own lookup now takes the user table for this shape
    from kimi_k3_moe.kernels.triton import backend as tb
    tb._cached_lookup_inner.cache_clear()
    be = get_backend("triton")
    prepared = be.prepare(target.experts)
    found = be.lookup(prepared, 3)
    assert found.source.startswith(f"user table {user_tables.table_path('triton', 'interpreter')}"), found.source
    assert found.source.endswith("tier 4")
    assert user_tables.describe(tt.USER_TABLE).startswith("user table ")

    # resume: a second run measures nothing again
    calls = []
    again = make_target(seed)
    run = again.runner
    again.runner = lambda cand: calls.append(cand.label) or run(cand)
    second = tune(again, SITU, FakeClock(fake_time), budget_s=1e9, state_path=state, device="cpu", seed=seed + 1)
    assert second["resumed"] == 8 and calls == []
    tb._cached_lookup_inner.cache_clear()


def test_budget_zero_leaves_packaged_configs_marked_untuned(tables, seed):
    target = make_target(seed)
    result = tune(target, SITU, FakeClock(fake_time), budget_s=-1, state_path=tables / "s.json", device="cpu",
                  seed=seed)
    assert result["out_of_time"]
    table, _ = user_tables.load(tt.USER_TABLE)
    entry = table["entries"][result["key"]]
    for tier in TIERS:
        row = entry["tiers"][str(tier)]
        assert row["tuned"] is False and row["note"] == "budget ran out"
        packaged = tt.MoEConfig.from_json(target.packaged(tier)["config"])
        assert tt.MoEConfig.from_json(row) == packaged


class FirstFour(TritonTarget):
    def candidates(self, tier, done):
        return super().candidates(tier, done)[:4]


class WallClock:
    """The loop's clock, in fake seconds: each timed candidate costs `cost` (what a GPU spends compiling,
    checking and replaying one); nothing else moves it."""

    def __init__(self, cost: float):
        self.now, self.cost = 0.0, cost

    def __call__(self) -> float:
        return self.now

    def timer(self) -> FakeClock:
        def timed(label):
            self.now += self.cost
            return 50.0 + len(label) % 7
        return FakeClock(timed)


def test_a_small_budget_is_shared_by_every_tier_and_exceeded_by_at_most_one_candidate(tables, seed):
    """Before, the first tier spent the whole budget and the later tiers kept the packaged config untimed.
    With 45 s at 10 s per candidate over three tiers: tier 1 has 15 s (2 candidates), tier 2 (45 - 20) / 2
    (2), tier 3 the last 5 s (its packaged one, started before the budget ends). The real target, its
    candidates cut to the first four (the packaged one first) to keep the interpreter's time down."""
    tiers, cost, budget = [1, 2, 3], 10.0, 45.0
    experts = random_experts(SHAPE.num_experts, SHAPE.hidden, SHAPE.inter, "cpu", torch.Generator().manual_seed(seed))
    target = FirstFour(SHAPE, experts, SITU, identity=user_tables.device_identity(), tiers=tiers)
    wall, state = WallClock(cost), tables / "fair.json"
    result = tune(target, SITU, wall.timer(), budget_s=budget, state_path=state, device="cpu", seed=seed, clock=wall)
    timed = {t: [o["label"] for o in result["outcomes"][str(t)].values() if o["status"] == TIMED] for t in tiers}
    for tier in tiers:
        assert timed[tier][0].endswith(" packaged"), timed  # the bar to beat, always measured
        info = result["tiers"][tier]
        assert info["tuned"] and info["partial"] and info["timed"] == len(timed[tier]) < info["candidates"]
    assert [len(timed[t]) for t in tiers] == [2, 2, 1], timed
    assert result["out_of_time"] and wall.now <= budget + cost

    # resumed with 15 s: nothing measured again; tier 1 gets 5 s, tier 2 what is left of 15 after it, tier 3
    # nothing (the budget has passed), and the table still says which tiers are partial
    calls = []
    run = target.runner
    target.runner = lambda cand: calls.append(cand.label) or run(cand)
    wall.now = 0.0
    again = tune(target, SITU, wall.timer(), budget_s=15.0, state_path=state, device="cpu", seed=seed + 1,
                 clock=wall)
    assert again["resumed"] == sum(len(v) for v in result["outcomes"].values())
    assert len(calls) == 2 and not set(calls) & {label for labels in timed.values() for label in labels}, calls
    assert [again["tiers"][t]["timed"] for t in tiers] == [3, 3, 1] and wall.now <= 15.0 + cost
    assert again["out_of_time"] and all(again["tiers"][t].get("partial") for t in tiers)


def test_the_packaged_config_keeps_its_label_when_a_variant_equals_it(seed, monkeypatch):
    """On the H200 the packaged 4096-token config equals a stage-1 variant; the summary's
    "x packaged" column found no packaged row because the variant's label had replaced it."""
    target = make_target(seed)
    tier = TIERS[-1]
    variant = TritonTarget.candidates(target, tier, {})[-1]  # a variant, not the packaged config
    monkeypatch.setattr(target, "packaged", lambda t: {"config": variant.config.to_json(), "source": "test"})
    cands = TritonTarget.candidates(target, tier, {})
    same = [c for c in cands if c.key == variant.key]
    assert len(same) == 1 and same[0].label.endswith(" packaged"), [c.label for c in same]
    assert len({c.key for c in cands}) == len(cands)


def test_small_tiers_try_the_best_aligned_tiles_with_pdl_toggled(seed):
    """The H200's aligned entries at 4-64 tokens won with pdl when timed on the H200: the tuner must be
    able to find them, so its round 2 tries the best stage 1 + best stage 2 both ways."""
    target = make_target(seed)
    target.is_cuda = True  # pdl survives for_target (no GPU is run: candidates only)
    tier = 4
    first = TritonTarget.candidates(target, tier, {})
    done = {c.key: {"status": TIMED, "us": 10.0 + n} for n, c in enumerate(first)}
    cands = TritonTarget.candidates(target, tier, done)
    toggled = [c.config for c in cands if c.label.startswith(f"T{tier} aligned bm16 best s1 + best s2 pdl ")]
    # (the combination itself may equal a round-1 candidate and keep that one's label)
    assert len(toggled) == 1 and replace(toggled[0], pdl=not toggled[0].pdl) in [c.config for c in cands]
    big = min(t for t in tuning_space.TIERS if t > tuning_space.PDL_MAX_TOKENS)
    first = TritonTarget.candidates(target, big, {})
    done = {c.key: {"status": TIMED, "us": 10.0 + n} for n, c in enumerate(first)}
    assert not any(" pdl " in c.label for c in TritonTarget.candidates(target, big, done))


def test_an_expert_parallel_slice_is_tuned_under_its_own_routing_and_keyed_by_its_held_experts(tables, seed):
    """EP: routing over all experts with this rank holding the first few (as `bench` times it), every
    candidate checked through the expert map against the reference, the entry keyed by the held count."""
    from kimi_k3_moe.bench.shapes import Shape
    ep = Shape("tiny_ep", SHAPE.hidden, SHAPE.inter, 8, topk=2, local_experts=4)
    experts = random_experts(ep.held_experts, ep.hidden, ep.inter, "cpu", torch.Generator().manual_seed(seed))
    target = FirstFour(ep, experts, SITU, identity=user_tables.device_identity(), tiers=[4])
    result = tune(target, SITU, FakeClock(fake_time), budget_s=1e9, state_path=tables / "ep.json", device="cpu",
                  seed=seed)
    assert result["key"] == tt.shape_key("mxfp4", 4, 2 * ep.inter, ep.hidden), result["key"]
    outcomes = list(result["outcomes"]["4"].values())
    assert outcomes and all(o["status"] == TIMED for o in outcomes), outcomes
    assert result["tiers"][4]["tuned"]

    # a maintainer's `tune --packaged PATH`: the same entry lands in that table's running-Triton section
    import json

    from kimi_k3_moe.tune.command import merge_packaged
    identity = user_tables.device_identity()
    merge_packaged(str(tables / "packaged.json"), result, identity, SITU)
    packaged = json.loads((tables / "packaged.json").read_text())
    tiers = packaged["tritons"][identity["triton"]]["entries"][result["key"]]["tiers"]
    assert tt.MoEConfig.from_json(tiers["4"]) == tt.MoEConfig.from_json(
        user_tables.load(tt.USER_TABLE, identity)[0]["entries"][result["key"]]["tiers"]["4"])


def test_off_a_terminal_each_candidate_is_one_flushed_line(tables, seed):
    """A tune whose output goes to a log (a remote job, CI) shows its progress as it goes: one line
    per candidate, not a live display that prints nothing until it ends."""
    import io

    from kimi_k3_moe.tune.command import run_with_progress
    out = io.StringIO()
    target = make_target(seed)
    target._tiers = [1]
    result = run_with_progress(target, SITU, FakeClock(fake_time), 1e9, tables / "p.json", seed, device="cpu",
                               stream=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == len(result["outcomes"]["1"]) and all(ln.startswith("tune triton [") for ln in lines), lines


class FirstTwo(TritonTarget):
    def candidates(self, tier, done):
        return super().candidates(tier, done)[:2]


def skew_sensitive_time(label: str) -> float:
    """The packaged config fastest under uniform routing but 1.6x slower under skewed; the other 2 %
    slower under uniform and the best under skewed."""
    packaged = " packaged" in label
    if "@skewed" in label:
        return 80.0 if packaged else 50.0
    return 50.0 if packaged else 51.0


def test_under_several_routings_a_tier_keeps_the_candidate_that_loses_least_under_any(tables, seed):
    from kimi_k3_moe.bench.routing import Routing
    experts = random_experts(SHAPE.num_experts, SHAPE.hidden, SHAPE.inter, "cpu", torch.Generator().manual_seed(seed))

    def run(routing, state):
        target = FirstTwo(SHAPE, experts, SITU, identity=user_tables.device_identity(), tiers=[4])
        return tune(target, SITU, FakeClock(skew_sensitive_time), budget_s=1e9, state_path=tables / state,
                    device="cpu", seed=seed, routing=routing)

    alone = run(Routing(), "uniform.json")
    chosen = [o for o in alone["outcomes"]["4"].values() if o["us"] == alone["tiers"][4]["us"]]
    assert alone["tiers"][4]["us"] == 50.0 and " packaged" in chosen[0]["label"]
    both = run((Routing(), Routing("skewed")), "both.json")
    info = both["tiers"][4]
    assert info["us"] == 51.0 and info["us_by_routing"] == {"uniform": 51.0, "skewed:1": 50.0}, info
    assert info["worst_x_best"] == pytest.approx(51.0 / 50.0) and info["worst_routing"] == "uniform"
    outcomes = list(both["outcomes"]["4"].values())
    assert len(outcomes) == 2 and all(set(o["us_by_routing"]) == {"uniform", "skewed:1"} for o in outcomes)
    entry = user_tables.load(tt.USER_TABLE)[0]["entries"][both["key"]]["tiers"]["4"]
    assert entry["worst_routing"] == "uniform" and entry["us_by_routing"]["skewed:1"] == 50.0


def test_a_candidate_wrong_under_one_routing_is_rejected(tables, seed):
    from kimi_k3_moe.bench.routing import Routing
    target = make_target(seed)
    target._tiers = [4]
    result = tune(target, SITU, FakeClock(fake_time), budget_s=1e9, state_path=tables / "r.json", device="cpu",
                  seed=seed, routing=(Routing(), Routing("skewed", 2.0)))
    wrong = [o for o in result["outcomes"]["4"].values() if "wrong-activation" in o["label"]]
    assert wrong[0]["status"] == REJECTED and wrong[0]["routing"] == "uniform"
    assert result["tiers"][4]["us"] >= 50.0

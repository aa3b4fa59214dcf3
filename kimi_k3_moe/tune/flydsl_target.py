"""The FlyDSL backend as a tune target.

Candidates per token tier: the packaged tier's tiles; at LARGE_BATCH tokens and above, every
packaged large-batch row's tiles too, and the tier's tiles on the LDS double buffer (each stage,
both, and both at BM 128), which no packaged tier takes on the model's word alone: the first run on
an AMD GPU keeps the measured faster one, not the modelled; then
alignment blocks and per-stage tiles around the packaged tier's, then the best stage 1 with the best stage 2, and that
pair with the other deterministic top-k sum (reduce "fused" where the tier's is "slots",
and back). Each
candidate's two kernels are compiled in a subprocess (an LLVM abort loses one
config, not the run); a kernel that does not compile, or uses scratch
(spills), is skipped. On an AMD GPU the candidates run there; without one the
caller passes the CPU emulator (k3lab.flydsl.emulator) as `launch` (and a fake clock to the loop),
which is how CI runs the whole loop against compile-only builds.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from kimi_k3_moe.kernels.flydsl import pipeline, tiles
from kimi_k3_moe.kernels.flydsl.backend import FlyDSLBackend
from kimi_k3_moe.kernels.flydsl.config import KLoop
from kimi_k3_moe.kernels.flydsl.tiles import Tier, tier_row
from kimi_k3_moe.loading import prepare_for
from kimi_k3_moe.tune.loop import TIMED, Candidate

TIERS = (1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384)
LARGE_BATCH = 2048   # prefill chunks: from here each packaged row serving such counts is a candidate
BMS = (16, 32, 64)
# per-stage tiles tried around the tier's: (waves, n_rep, kb_unroll, activations staged through LDS); the
# tier's K-loop order (load_first, prefetch), k_waves and waves_per_eu are kept
STAGE1 = ((4, 1, 1, False), (4, 2, 1, True), (2, 2, 2, False), (4, 1, 2, True))
STAGE2 = ((4, 2, 1, False), (4, 4, 1, True), (2, 2, 1, True), (4, 1, 1, False))


def _around(tile, choices) -> list:
    """The tiles of `choices` around `tile`; one the tile refuses (LDS staging with k_waves) is left out."""
    out = []
    for waves, n_rep, kb_unroll, staged in choices:
        try:
            out.append(replace(tile, waves=waves, n_rep=n_rep, kb_unroll=kb_unroll,
                               schedule=tile.schedule.with_staging(staged)))
        except ValueError:
            continue
    return out


def large_batch_tiles(arch: str, tier: int) -> list[Tier]:
    """The packaged rows of `arch` that serve LARGE_BATCH tokens or more, as candidates at `tier` (none
    below LARGE_BATCH), each with the tier's own top-k sum: the tiles compete, the sum stays the table's."""
    if tier < LARGE_BATCH:
        return []
    base = tiles.tier_for(arch, tier, tiles.default_table())
    return [Tier(tier, row.BM, row.stage1, row.stage2, reduce=base.reduce) for row in tiles.default_table()[arch]
            if not row.direct and (row.max_tokens is None or row.max_tokens >= LARGE_BATCH)]


def double_buffered(tier: int, base: Tier) -> list[Tier]:
    """`base`'s tiles with the LDS double buffer on stage 1, stage 2, both, and both at BM 128 (at most 2
    waves per EU: its carried registers need them); a tile the schedule refuses is left out."""
    if tier < LARGE_BATCH:
        return []

    schedule = next(k for k in KLoop if k.double_buffered)

    def db(tile):
        return replace(tile, schedule=schedule, waves_per_eu=min(tile.waves_per_eu or 2, 2), k_waves=1)
    out = []
    for bm, s1, s2 in ((base.BM, db(base.stage1), base.stage2), (base.BM, base.stage1, db(base.stage2)),
                       (base.BM, db(base.stage1), db(base.stage2)), (128, db(base.stage1), db(base.stage2))):
        try:
            out.append(Tier(tier, bm, s1, s2, reduce=base.reduce))
        except ValueError:
            continue
    return out


def _key(t: Tier) -> str:
    row = tier_row(t)
    return json.dumps({k: row[k] for k in ("BM", "stage1", "stage2", "reduce")}, sort_keys=True)


class FlyDSLTarget:
    backend = "flydsl"
    bound = 1.5e-2  # bf16 weights on gfx942's int4 path, bf16 intermediate (tests/flydsl/test_emulation.py)

    def __init__(self, shape, experts, activation, *, arch: str, identity: dict, launch=None,
                 out_dir: str | Path, rocm=None, tiers=None, compiler=None, max_per_round: int | None = None):
        """`launch(cfg, args)` runs a kernel (default: the GPU's); `compiler(cfg) -> (ok, why)` overrides the
        subprocess build (tests use the real one)."""
        self.shape, self.activation, self.arch, self.identity = shape, activation, arch, identity
        self.backend_obj = FlyDSLBackend(arch=arch)
        self.weight_format = self.backend_obj.weight_format
        self.prepared = prepare_for(self.backend_obj, experts)
        self.launch = launch or self.backend_obj._launch
        self.out_dir, self.rocm = Path(out_dir), rocm
        self._tiers = list(tiers or TIERS)
        self.compiler, self.max_per_round = compiler, max_per_round
        self._compiled: dict[str, tuple[bool, str]] = {}

    def tiers(self) -> list[int]:
        return self._tiers

    def table_extra(self) -> dict:
        return {"target_arch": self.arch, "weight_format": self.weight_format}

    def _configs(self, tier: int, t: Tier):
        s = self.shape
        return tiles.stage_configs(self.arch, self.weight_format, hidden=s.hidden, inter=s.inter, top_k=s.topk,
                                   num_tokens=tier, activation=self.activation, has_offsets=self.prepared.has_offsets,
                                   table=tiles.load_table({self.arch: [tier_row(replace(t, max_tokens=None))]}))

    def candidates(self, tier: int, done: dict) -> list[Candidate]:
        base = tiles.tier_for(self.arch, tier, tiles.default_table())
        r = base.reduce
        first = [Tier(tier, base.BM, base.stage1, base.stage2, reduce=r)]
        large = large_batch_tiles(self.arch, tier) + double_buffered(tier, base)
        first += [Tier(tier, bm, base.stage1, base.stage2, reduce=r) for bm in BMS if bm != base.BM]
        first += [Tier(tier, base.BM, s1, base.stage2, reduce=r) for s1 in _around(base.stage1, STAGE1)]
        first += [Tier(tier, base.BM, base.stage1, s2, reduce=r) for s2 in _around(base.stage2, STAGE2)]
        cands = [Candidate(tier, _key(t), t, f"T{tier} BM{t.BM} s1 {_tag(t.stage1)} s2 {_tag(t.stage2)}")
                 for t in first[:1]]
        cands += [Candidate(tier, _key(t), t, f"T{tier} BM{t.BM} large-batch s1 {_tag(t.stage1)} "
                          f"{t.stage1.schedule.value} s2 {_tag(t.stage2)} {t.stage2.schedule.value}") for t in large]
        cands += [Candidate(tier, _key(t), t, f"T{tier} BM{t.BM} s1 {_tag(t.stage1)} s2 {_tag(t.stage2)}")
                  for t in first[1:]]
        cands = list({c.key: c for c in cands}.values())[:self.max_per_round or None]
        timed = sorted((done[c.key]["us"], i) for i, c in enumerate(cands)
                       if done.get(c.key, {}).get("status") == TIMED)
        if timed:
            best = cands[timed[0][1]].config
            b1 = min(((done[c.key]["us"], c.config.stage1) for c in cands if c.config.BM == best.BM
                      and c.config.stage2 == best.stage2 and done.get(c.key, {}).get("status") == TIMED),
                     key=lambda x: x[0])[1]
            b2 = min(((done[c.key]["us"], c.config.stage2) for c in cands if c.config.BM == best.BM
                      and c.config.stage1 == best.stage1 and done.get(c.key, {}).get("status") == TIMED),
                     key=lambda x: x[0])[1]
            t = Tier(tier, best.BM, b1, b2, reduce=r)
            cands.append(Candidate(tier, _key(t), t, f"T{tier} BM{t.BM} best s1 + best s2"))
            other = {"slots": "fused", "fused": "slots"}.get(r)
            if other:
                t = Tier(tier, best.BM, b1, b2, reduce=other)
                cands.append(Candidate(tier, _key(t), t, f"T{tier} BM{t.BM} best s1 + best s2, reduce {other}"))
        return cands

    def compile(self, cand: Candidate) -> tuple[bool, str]:
        try:
            configs = self._configs(cand.tier, cand.config)
        except ValueError as exc:
            return False, f"invalid: {exc}"
        for cfg in configs:
            if cfg.name not in self._compiled:
                self._compiled[cfg.name] = (self.compiler or self._build)(cfg)
            ok, why = self._compiled[cfg.name]
            if not ok:
                return False, f"{cfg.name}: {why}"
        return True, "compiled"

    def _build(self, cfg) -> tuple[bool, str]:
        from kimi_k3_moe.kernels.flydsl.build import compile_in_subprocess
        res = compile_in_subprocess(cfg, self.out_dir, rocm=self.rocm)
        if not res.ok:
            return False, f"does not compile ({res.status}): {(res.llvm_errors or [res.log_tail[-200:]])[0]}"
        scratch = res.report["isa"]["scratch_instructions"]
        private = res.report["metadata"].get("private_segment_fixed_size", 0)
        if scratch or private:
            return False, f"spills: {scratch} scratch instructions, {private} B private segment"
        return True, "compiled"

    def runner(self, cand: Candidate):
        configs = self._configs(cand.tier, cand.config)
        return lambda hidden, weights, ids, expert_map: pipeline.moe_forward(
            self.prepared, hidden, weights, ids, self.activation, expert_map, arch=self.arch, launch=self.launch,
            configs=configs)

    def reference_weights(self):
        p = self.prepared
        return lambda e: p.dequantize(e)[0], lambda e: p.dequantize(e)[1]

    def packaged(self, tier: int) -> dict:
        base = tiles.tier_for(self.arch, tier, tiles.default_table())
        row = tier_row(base)
        return {"config": {k: row[k] for k in ("BM", "stage1", "stage2", "reduce")}}

    def entries(self, chosen: dict) -> tuple[str, dict]:
        rows = []
        tiers = sorted(chosen)
        for n, tier in enumerate(tiers):
            cand, info = chosen[tier]
            cfg = tier_row(cand.config) if cand is not None else info["config"]
            rows.append({"max_tokens": tier if n < len(tiers) - 1 else None, "BM": cfg["BM"],
                         "stage1": cfg["stage1"], "stage2": cfg["stage2"], "reduce": cfg.get("reduce", "slots"),
                         "tuned_at_tokens": tier,
                         **{k: v for k, v in info.items() if k != "config"}})
        s = self.shape
        return tiles.shape_key(self.weight_format, s.hidden, s.inter, s.topk), {"tiers": rows}


def _tag(tile) -> str:
    return f"w{tile.waves}n{tile.n_rep}u{tile.kb_unroll}{'L' if tile.schedule.staged else ''}"

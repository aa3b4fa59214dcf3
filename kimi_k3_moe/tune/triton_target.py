"""The Triton backend as a tune target: tiles from kernels/triton/tuning_space.py (its public functions only)."""
from __future__ import annotations

import json
from dataclasses import replace

import torch

from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.kernels import get_backend
from kimi_k3_moe.kernels.triton import table as tt
from kimi_k3_moe.kernels.triton import tuning_space
from kimi_k3_moe.loading import prepare_for
from kimi_k3_moe.tune.loop import PACKAGED, TIMED, Candidate, is_packaged

REGISTER_MARGIN = getattr(tuning_space, "REGISTER_MARGIN", 250)


def _key(cfg) -> str:
    return json.dumps(cfg.to_json(), sort_keys=True)


class TritonTarget:
    backend = "triton"

    def __init__(self, shape, experts, activation, *, identity: dict, weight_format: str = "mxfp4",
                 tiers=None, quick: bool = False, max_per_round: int | None = None):
        self.shape, self.identity, self.activation = shape, identity, activation
        self.weight_format, self.quick, self.max_per_round = weight_format, quick, max_per_round
        self._tiers = list(tiers or tuning_space.TIERS)
        self.experts = experts
        self.is_cuda = experts.device.type == "cuda" and not getattr(torch.version, "hip", None)
        self.prepared = prepare_for(get_backend("triton", weight_format=weight_format), experts)

    def tiers(self) -> list[int]:
        return self._tiers

    def table_extra(self) -> dict:
        return {"weight_format": self.weight_format, "quick": self.quick}

    def _cand(self, tier, cfg, label) -> Candidate:
        cfg = cfg.for_target(self.is_cuda)
        return Candidate(tier, _key(cfg), cfg, f"T{tier} {label}")

    def candidates(self, tier: int, done: dict) -> list[Candidate]:
        """Round 1: the base and each stage's variants; round 2: best stage 1 with best stage 2."""
        h, i = self.shape.hidden, self.shape.inter
        packaged = tt.MoEConfig.from_json(self.packaged(tier)["config"])
        out = [self._cand(tier, packaged, f"{packaged.path} bm{packaged.block_m} {PACKAGED}")]  # the bar to beat
        for (path, bm), (s1, s2, base) in tuning_space.candidates(tier, h, i, self.quick).items():
            tag = f"{path} bm{bm}"
            first = [self._cand(tier, base, f"{tag} base")]
            first += [self._cand(tier, c, f"{tag} s1 {c.stage1.block_n}x{c.stage1.block_k}") for c in s1]
            first += [self._cand(tier, c, f"{tag} s2 {c.stage2.block_n}x{c.stage2.block_k}"
                                           + (f"x{c.stage2.n_tiles}t" if c.stage2.n_tiles > 1 else "")
                                           + (f"@bm{c.stage2_block_m}" if c.stage2_block_m else "")) for c in s2]
            if self.max_per_round:
                first = first[:self.max_per_round]
            out += first

            def best(cands, stage):
                timed = [(done[c.key]["us"], c) for c in cands
                         if done.get(c.key, {}).get("status") == TIMED and c.label.split()[3] in ("base", stage)]
                return min(timed, key=lambda x: x[0])[1].config if timed else None
            b1, b2 = best(first, "s1"), best(first, "s2")
            if b1 is not None and b2 is not None:
                combo = replace(b1, stage2=b2.stage2, stage2_block_m=b2.stage2_block_m)
                out.append(self._cand(tier, combo, f"{tag} best s1 + best s2"))
                if tier <= tuning_space.PDL_MAX_TOKENS and path == "aligned":
                    out.append(self._cand(tier, replace(combo, pdl=not combo.pdl), f"{tag} best s1 + best s2 pdl "
                                          + ("off" if combo.pdl else "on")))
        unique: dict[str, Candidate] = {}
        for c in out:  # the first label wins: the packaged config stays "packaged" when a variant equals it
            unique.setdefault(c.key, c)
        return list(unique.values())

    def compile(self, cand: Candidate) -> tuple[bool, str]:
        """Build the launch plan (and, on a GPU, compile and run it once): invalid or spilling configs fail."""
        h, i = self.shape.hidden, self.shape.inter
        try:
            cand.config.validate(h, i)
        except ValueError as exc:
            return False, f"invalid: {exc}"
        dev = self.experts.device
        be = get_backend("triton", weight_format=self.weight_format, config=cand.config)
        hidden = torch.randn(4, h, device=dev).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(self.shape.held_experts, device=dev)[:self.shape.topk] for _ in range(4)])
        weights = torch.full(ids.shape, 1.0 / self.shape.topk, device=dev)
        try:
            launches = be.plan(self.prepared, hidden, weights, ids.to(torch.int32), self.activation, None,
                               torch.empty_like(hidden))
            if dev.type != "cuda":
                return True, "planned (interpreter: no compiler to ask about registers)"
            for launch in launches:
                k = launch.kernel[launch.grid](**launch.args, **launch.options())
                spills, regs = int(getattr(k, "n_spills", 0) or 0), int(getattr(k, "n_regs", 0) or 0)
                # the packaged config runs today whatever its registers: it is always the bar to beat
                if (spills or regs >= REGISTER_MARGIN) and not is_packaged(cand.label):
                    return False, f"{launch.label}: {spills} spills, {regs} registers"
            torch.cuda.synchronize()
        except Exception as exc:
            return False, f"does not compile: {type(exc).__name__}: {exc}"[:300]
        return True, "compiled"

    def runner(self, cand: Candidate):
        be = get_backend("triton", weight_format=self.weight_format, config=cand.config)
        return lambda hidden, weights, ids, expert_map: be.forward(self.prepared, hidden, weights, ids,
                                                                   self.activation, expert_map)

    def reference_weights(self):
        if self.weight_format == "mxfp4":
            e = self.experts
            return (lambda x: mxfp4.dequantize(e.w13_packed[x], e.w13_scale[x]),
                    lambda x: mxfp4.dequantize(e.w2_packed[x], e.w2_scale[x]))
        p = self.prepared
        return lambda x: p.dequantize(x)[0], lambda x: p.dequantize(x)[1]

    def packaged(self, tier: int) -> dict:
        s = self.shape
        found = tt.lookup(self.identity["key"], self.weight_format, s.held_experts, s.hidden, s.inter, tier,
                          is_cuda=self.is_cuda, arch=self.identity.get("arch"), user_table=False)
        return {"config": found.config.to_json(), "source": found.source}

    def entries(self, chosen: dict) -> tuple[str, dict]:
        s = self.shape
        tiers = {}
        for tier, (cand, info) in chosen.items():
            cfg = cand.config.to_json() if cand is not None else info["config"]
            tiers[str(tier)] = {**cfg, **{k: v for k, v in info.items() if k != "config"}}
        return tt.shape_key(self.weight_format, s.held_experts, 2 * s.inter, s.hidden), {"tiers": tiers}

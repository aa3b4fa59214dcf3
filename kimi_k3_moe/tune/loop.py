"""The tune loop, the same for every backend.

Per token tier: ask the target for candidates (in rounds: a target may propose
combinations of the best so far), skip those that do not compile or spill,
check each survivor on fresh random data against the float reference (the
model's SiTUv2, which must differ from SiLU), time it with the bench's one
method, and keep the fastest. Given several routings (uniform and skewed, say), every
candidate is checked and timed under each, and the pick is the one whose worst ratio to
each routing's best is smallest: a tier's config then loses least wherever the router
sends its tokens (the fastest under uniform routing can read the same expert twice
when a skewed router sends it many tokens). Every outcome goes to a state file after each
candidate, so an interrupted run resumes where it stopped; the whole run is
bounded by a budget, shared out so that the first tiers cannot spend it all:
tier i of n may start candidates until now + (what is left) / (n - i), time a
tier leaves unused goes to the ones after it, and a tier's first candidate (for
Triton the packaged config, the bar to beat) is timed even past its share, but
never past the budget. Tiers left untuned take the packaged table's config and
say so. The table is written by `configs.user_tables.write`, the one writer.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kimi_k3_moe import __version__
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.bench.check import REL_L2_BOUND, judge
from kimi_k3_moe.bench.data import RoutingSource, expert_map_for, random_hidden
from kimi_k3_moe.bench.routing import Routing
from kimi_k3_moe.reference import dense_moe

SKIPPED, REJECTED, TIMED, FAILED = "skipped", "rejected", "timed", "failed"
PACKAGED = "packaged"  # last word of the label of a tier's packaged config, the bar its candidates must beat


def is_packaged(label: str) -> bool:
    return label.endswith(f" {PACKAGED}")


@dataclass(frozen=True)
class Candidate:
    tier: int
    key: str        # stable text of the config (state and table key)
    config: Any
    label: str


class Target(Protocol):
    backend: str
    shape: Any
    identity: dict

    def tiers(self) -> list[int]: ...
    def candidates(self, tier: int, done: dict[str, dict]) -> list[Candidate]: ...
    def compile(self, cand: Candidate) -> tuple[bool, str]: ...
    # run(hidden, weights, ids, expert_map): expert_map is None unless the shape is an expert-parallel slice
    def runner(self, cand: Candidate) -> Callable[..., torch.Tensor]: ...
    def reference_weights(self) -> tuple[Callable, Callable]: ...
    def packaged(self, tier: int) -> dict: ...
    def entries(self, chosen: dict[int, tuple[Candidate | None, dict]]) -> tuple[str, Any]: ...
    def table_extra(self) -> dict: ...


class _Case:
    """One routing's draw for a tier, and its references (computed once, on the first candidate run)."""

    def __init__(self, name: str, weights: torch.Tensor, ids: torch.Tensor):
        self.name, self.weights, self.ids = name, weights, ids
        self._refs = None

    def references(self, hidden, w13_of, w2_of, activation, silu, emap):
        if self._refs is None:
            self._refs = tuple(dense_moe(hidden, w13_of, w2_of, self.weights, self.ids, act, emap,
                                         compute_dtype=torch.float32) for act in (activation, silu))
        return self._refs


class State:
    """Outcomes per tier and candidate key, on disk after every candidate (resume)."""

    def __init__(self, path: Path, fingerprint: dict):
        self.path, self.fingerprint = Path(path), fingerprint
        self.results: dict[str, dict[str, dict]] = {}
        self.resumed = 0
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                data = None  # a broken state file only costs a fresh start
            results = data.get("results") if isinstance(data, dict) else None
            if isinstance(results, dict) and data.get("fingerprint") == fingerprint \
                    and all(isinstance(v, dict) for v in results.values()):
                self.results = results
                self.resumed = sum(len(v) for v in results.values())

    def tier(self, tier: int) -> dict[str, dict]:
        return self.results.setdefault(str(tier), {})

    def record(self, cand: Candidate, outcome: dict) -> None:
        self.tier(cand.tier)[cand.key] = outcome
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "results": self.results}, indent=1))
        tmp.replace(self.path)


def pick(outcomes: dict[str, dict], routings: list[str]) -> tuple[str, float, str]:
    """The timed candidate to keep, its worst ratio to a routing's best, and that routing: the
    smallest worst ratio, then the fastest under the first routing (with one routing: the fastest)."""
    def times(o: dict) -> dict[str, float]:  # a single routing's outcomes keep their one time in "us"
        return o.get("us_by_routing", {routings[0]: o["us"]})
    best = {r: min(times(o)[r] for o in outcomes.values()) for r in routings}

    def worst(k: str) -> tuple[float, str]:
        return max((times(outcomes[k])[r] / best[r], r) for r in routings)
    key = min(outcomes, key=lambda k: (worst(k)[0], outcomes[k]["us"], k))
    return (key, *worst(key))


def tune(target: Target, activation: ActivationSpec, timer, *, budget_s: float, state_path: Path, device,
         seed: int, clock: Callable[[], float] = time.monotonic, progress=None,
         routing: Routing | tuple[Routing, ...] = Routing()) -> dict:
    """Run the loop; returns {"path": table written, "tiers": {tier: summary}, "state": ..}.
    `routing`: one, or several that every candidate is timed under (`pick`)."""
    from kimi_k3_moe.configs import user_tables
    from kimi_k3_moe.kernels import get_spec
    shape = target.shape
    routings = (routing,) if isinstance(routing, Routing) else tuple(routing)
    names = [str(r) for r in routings]
    if not routings or len(set(names)) != len(names):
        raise ValueError(f"routing: one or more distinct routings, got {names}")
    fingerprint = {"backend": target.backend, "device": target.identity, "package": __version__,
                   "shape": shape.to_json(), "activation": str(activation), "routing": ",".join(names),
                   **target.table_extra()}
    state = State(state_path, fingerprint)
    deadline = clock() + budget_s
    tiers = target.tiers()
    gen = torch.Generator(device=device).manual_seed(seed)
    sources = [RoutingSource(r, shape.num_experts, shape.topk, device, gen) for r in routings]
    # expert parallel: routing over every expert, this rank holding [0, held) (as bench times it)
    emap = expert_map_for(shape.num_experts, shape.held_experts, device) if shape.is_ep else None
    w13_of, w2_of = target.reference_weights()
    silu = ActivationSpec.silu()
    out_of_time = False  # some candidate was left unmeasured for lack of time (a rerun continues)
    chosen: dict[int, tuple[Candidate | None, dict]] = {}
    for i, tier in enumerate(tiers):
        done = state.tier(tier)
        now = clock()
        tier_deadline = now + max(0.0, deadline - now) / (len(tiers) - i)
        tier_out_of_time = False
        first = None  # the target's first candidate of this tier
        hidden = random_hidden(tier, shape.hidden, device, gen)  # fresh data every run, every tier
        cases = [_Case(name, *src(tier, held=shape.held_experts if shape.is_ep else None))
                 for name, src in zip(names, sources)]
        seen: dict[str, Candidate] = {}
        while True:
            fresh = [c for c in target.candidates(tier, done) if c.key not in seen]
            if not fresh:
                break
            first = first or fresh[0].key
            for cand in fresh:
                seen[cand.key] = cand
                if cand.key in done:  # measured before (resume)
                    continue
                now = clock()
                if now > deadline or (now > tier_deadline and cand.key != first):
                    tier_out_of_time = out_of_time = True
                    continue
                if progress:
                    progress(cand)
                ok, why = target.compile(cand)
                if not ok:
                    state.record(cand, {"status": SKIPPED, "why": why, "label": cand.label})
                    continue
                try:
                    run = target.runner(cand)
                    rel_l2, us = 0.0, {}
                    for case in cases:
                        ref, silu_ref = case.references(hidden, w13_of, w2_of, activation, silu, emap)
                        verdict = judge(run(hidden, case.weights, case.ids, emap), ref, silu_ref,
                                        getattr(target, "bound", REL_L2_BOUND))
                        if not verdict.ok:
                            break
                        rel_l2 = max(rel_l2, verdict.rel_l2)
                        if hasattr(timer, "label"):
                            timer.label = cand.label if len(cases) == 1 else f"{cand.label} @{case.name}"
                        us[case.name] = timer.time(lambda run=run, hidden=hidden, case=case:
                                                   run(hidden, case.weights, case.ids, emap))["median_us"]
                    if not verdict.ok:
                        state.record(cand, {"status": REJECTED, "why": verdict.why, "rel_l2": verdict.rel_l2,
                                            "label": cand.label, **({"routing": case.name} if len(cases) > 1 else {})})
                        continue
                    state.record(cand, {"status": TIMED, "us": us[names[0]], "rel_l2": rel_l2, "label": cand.label,
                                        **({"us_by_routing": us} if len(cases) > 1 else {})})
                except Exception as exc:  # a candidate that fails at run time is one outcome, not the end
                    state.record(cand, {"status": FAILED, "why": f"{type(exc).__name__}: {exc}"[:300],
                                        "label": cand.label})
        timed = {k: o for k, o in done.items() if o["status"] == TIMED and k in seen}
        if timed:
            key, worst, against = pick(timed, names)
            info = {"tuned": True, "us": timed[key]["us"], "candidates": len(seen), "timed": len(timed)}
            if len(names) > 1:
                info.update(us_by_routing=timed[key]["us_by_routing"], worst_x_best=worst, worst_routing=against)
            if not all(k in done for k in seen):
                info["partial"] = True  # its share of the budget ran out: the best so far
            chosen[tier] = (seen[key], info)
        else:
            chosen[tier] = (None, {"tuned": False, "note": "budget ran out" if tier_out_of_time
                                   else "no candidate passed", **target.packaged(tier)})
    key, entry = target.entries(chosen)
    path = user_tables.write(get_spec(target.backend).table_kind(), target.identity, tiers, {key: entry},
                             extra=target.table_extra())
    return {"path": str(path), "key": key, "resumed": state.resumed, "out_of_time": out_of_time,
            "tiers": {t: info for t, (c, info) in chosen.items()},
            "outcomes": state.results}


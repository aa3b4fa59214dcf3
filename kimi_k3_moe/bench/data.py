"""Random experts, routing and activations with the statistics of Kimi-K3's layers."""
from __future__ import annotations

import math

import torch

from kimi_k3_moe.bench.routing import Routing
from kimi_k3_moe.experts import Mxfp4Experts


def random_experts(num_experts: int, hidden: int, inter: int, device, gen: torch.Generator) -> Mxfp4Experts:
    """Uniformly random e2m1 codes (RMS 2.93) with e8m0 scales drawn around the value that makes
    stage-1 outputs RMS ~4 for unit-variance inputs (so SiLU and SiTUv2 really differ, as on K3)
    and stage-2 weights RMS ~1/sqrt(I)."""
    def side(n, k, target_rms):
        center = 127 + round(math.log2(target_rms / 2.93))
        packed = torch.randint(0, 256, (num_experts, n, k // 2), dtype=torch.uint8, device=device, generator=gen)
        scale = torch.randint(center - 2, center + 3, (num_experts, n, k // 32), dtype=torch.uint8,
                              device=device, generator=gen)
        return packed, scale
    return Mxfp4Experts(*side(2 * inter, hidden, 4.0 / math.sqrt(hidden)), *side(hidden, inter, 1.0 / math.sqrt(inter)))


def recorded_ids(path: str, num_experts: int, topk: int) -> torch.Tensor:
    """int32 [N, topk] ids recorded from a router, checked: a bad file ends in one line naming it."""
    try:
        if path.endswith(".npy"):
            import numpy as np
            ids = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            ids = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unreadable file is the same user error
        raise ValueError(f"--routing file:{path}: cannot read recorded top-k ids "
                         f"({type(exc).__name__}: {exc})") from None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != topk or ids.shape[0] < 1 \
            or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"--routing file:{path}: expected integer ids [tokens, {topk}], got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
    if bool(((ids < 0) | (ids >= num_experts)).any()):
        raise ValueError(f"--routing file:{path}: ids outside [0, {num_experts})")
    return ids.to(torch.int32)


class RoutingSource:
    """Each bench row's routing for one Routing: draws share the generator, so a seed replays a run."""

    def __init__(self, routing: Routing, num_experts: int, topk: int, device, gen: torch.Generator):
        self.routing, self.num_experts, self.topk, self.device, self.gen = routing, num_experts, topk, device, gen
        self.bias = None
        self.recorded = None
        if routing.kind == "skewed":
            self.bias = torch.randn(num_experts, device=device, generator=gen) * routing.sigma
        elif routing.kind == "file":
            self.recorded = recorded_ids(routing.path, num_experts, topk).to(device)

    def __call__(self, num_tokens: int, held: int | None = None):
        if self.recorded is not None:
            rows = torch.arange(num_tokens, device=self.device) % self.recorded.shape[0]
            ids = self.recorded[rows]
            weights = torch.rand(ids.shape, device=self.device, generator=self.gen) + 0.05
            return (weights / weights.sum(1, keepdim=True)).float(), ids
        return random_routing(num_tokens, self.num_experts, self.topk, self.device, self.gen, held=held,
                              bias=self.bias)


def random_routing(num_tokens: int, num_experts: int, topk: int, device, gen: torch.Generator,
                   held: int | None = None, tries: int = 200, bias: torch.Tensor | None = None):
    """Distinct experts per token (uniform, or skewed by a per-expert logit `bias`), positive weights
    summing to 1 (like renormalised sigmoid top-k).

    `held`: the rank holds experts [0, held) (EP). Drawn again until the rank's (token, slot) pairs
    are within one standard deviation of its share T*K*held/E and at least one: a row where the
    rank has nothing to do (36 % of single-token draws at EP16) would time an empty MoE."""
    if held is not None and held < 1:
        raise ValueError(f"held = {held}: the rank must hold at least one expert")
    for _ in range(tries):
        if bias is None:
            scores = torch.rand(num_tokens, num_experts, device=device, generator=gen)
        else:   # unit Gaussian router logits plus the per-expert bias, through the sigmoid
            scores = torch.sigmoid(torch.randn(num_tokens, num_experts, device=device, generator=gen) + bias)
        weights, ids = scores.topk(topk, dim=1)
        if held is None or held >= num_experts or num_tokens == 0:
            break
        share = num_tokens * topk * held / num_experts
        local = int((ids < held).sum())
        # skewed: the rank's share depends on its experts' popularity, so only "something to do" is asked
        if local >= 1 and (bias is not None
                           or abs(local - share) <= max(1.0, math.sqrt(share * (1 - held / num_experts)))):
            break
    else:
        raise RuntimeError(f"no routing of {num_tokens} tokens gave the rank its share of {held} experts "
                           f"in {tries} draws")
    weights = weights / weights.sum(1, keepdim=True)
    return weights.float(), ids.to(torch.int32)


def random_hidden(num_tokens: int, hidden: int, device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(num_tokens, hidden, device=device, generator=gen).to(torch.bfloat16)


def expert_map_for(num_experts: int, local_experts: int, device) -> torch.Tensor:
    """Global id -> local id for the rank holding experts [0, local_experts); -1 elsewhere."""
    emap = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    emap[:local_experts] = torch.arange(local_experts, dtype=torch.int32, device=device)
    return emap

"""Routing histograms for benchmarks/flydsl_model.py: how many rows each expert gets, and from that the
row blocks at a tile's BM and the distinct experts whose weights are read.

uniform: the expectation under uniform top-k routing (binomial rows per expert, in closed form).
skewed: one draw of the bench's `skewed` routing (kimi_k3_moe/bench/data.py: unit Gaussian router
logits plus a per-expert logit bias from N(0, sigma), top-k of the sigmoid), through the bench's own
generator at a fixed seed, so the model and `kimi-k3-moe bench --routing skewed` mean the same thing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

E, TOP_K = 896, 16          # Kimi-K3's routed experts and top-k (per rank at TP8 every rank holds all)
SKEW_SEED = 0               # the one draw the tables use (stated beside them)
SKEW_SIGMA = 1.0            # the bench's default `skewed` sigma


def distinct_experts(tokens: int) -> float:
    """Expected experts touched by `tokens` tokens each routed to TOP_K distinct experts, uniformly."""
    return E * (1 - (1 - TOP_K / E) ** tokens)


def expected_blocks(tokens: int, bm: int) -> float:
    """Expected BM-row blocks after aligning every expert's rows to BM (all experts together)."""
    n, p = tokens, TOP_K / E
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    lo, hi = max(0, int(mean - 12 * sd) - 1), min(n, int(mean + 12 * sd) + 2)
    total = 0.0
    for c in range(lo, hi + 1):
        logpmf = (math.lgamma(n + 1) - math.lgamma(c + 1) - math.lgamma(n - c + 1)
                  + (c * math.log(p) if c else 0.0) + ((n - c) * math.log1p(-p) if n - c else 0.0))
        total += math.exp(logpmf) * -(-c // bm)
    return E * total


@cache
def skewed_rows(tokens: int, sigma: float = SKEW_SIGMA, seed: int = SKEW_SEED) -> tuple[int, ...]:
    """Rows per expert of one draw of the bench's skewed routing at `tokens` tokens."""
    import torch

    from kimi_k3_moe.bench.data import RoutingSource
    from kimi_k3_moe.bench.routing import Routing

    gen = torch.Generator().manual_seed(seed)
    _, ids = RoutingSource(Routing("skewed", sigma), E, TOP_K, "cpu", gen)(tokens)
    return tuple(torch.bincount(ids.flatten().long(), minlength=E).tolist())


@dataclass(frozen=True)
class RoutingModel:
    """`uniform` or `skewed` (its draw's seed): the statistics the model's launches need at a token count."""
    name: str
    seed: int = SKEW_SEED

    def __post_init__(self):
        if self.name not in ROUTINGS:
            raise ValueError(f"routing {self.name!r}: expected one of {', '.join(ROUTINGS)}")

    def rows(self, tokens: int) -> tuple[int, ...] | None:
        return skewed_rows(tokens, seed=self.seed) if self.name == "skewed" else None

    def blocks(self, tokens: int, bm: int) -> float:
        rows = self.rows(tokens)
        return expected_blocks(tokens, bm) if rows is None else float(sum(-(-c // bm) for c in rows))

    def distinct(self, tokens: int) -> float:
        rows = self.rows(tokens)
        return distinct_experts(tokens) if rows is None else float(sum(1 for c in rows if c))

    def summary(self, tokens: int, bm: int) -> dict:
        """What the tables quote of a routing at one tier: the busiest expert's rows and blocks, the
        share of all rows the 5 % busiest experts hold, the padding at BM."""
        rows = self.rows(tokens)
        blocks = self.blocks(tokens, bm)
        out = {"BM": bm, "distinct_experts": round(self.distinct(tokens), 1), "blocks": round(blocks, 1),
               "padding": round(1 - tokens * TOP_K / (blocks * bm), 3)}
        if rows is not None:
            ranked = sorted(rows, reverse=True)
            out.update(max_rows=ranked[0], max_blocks=-(-ranked[0] // bm),
                       top5pct_share=round(sum(ranked[:E // 20]) / (tokens * TOP_K), 3))
        return out


ROUTINGS = ("uniform", "skewed")
UNIFORM, SKEWED = RoutingModel("uniform"), RoutingModel("skewed")

"""Helpers the suites share, one per purpose: random experts and routing, the SITU spec, a
deliberately broken backend. Random data only from the generator a test passes in (the suite's
seed rule, tests/conftest.py)."""
from __future__ import annotations

from dataclasses import replace

import torch

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.dispatch import BackendChoice
from kimi_k3_moe.experts import Mxfp4Experts
from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.kernels.torch import SPEC as TORCH_SPEC
from kimi_k3_moe.kernels.torch.backend import TorchBackend

SITU = ActivationSpec.situv2(4.0, 25.0)   # Kimi-K3's betas, as make_checkpoint writes them into config.json
SILU = ActivationSpec.silu()


def random_experts(gen: torch.Generator, e: int = 5, h: int = 64, i: int = 32, gain: float = 3.0) -> Mxfp4Experts:
    """MXFP4 experts from scaled Gaussians (stage-1 outputs of a few units, like a real layer)."""
    w13 = torch.randn(e, 2 * i, h, generator=gen) * gain / h ** 0.5
    w2 = torch.randn(e, h, i, generator=gen) / i ** 0.5
    return Mxfp4Experts(*mxfp4.quantize(w13), *mxfp4.quantize(w2))


def random_ids(gen: torch.Generator, tokens: int, e: int, k: int) -> torch.Tensor:
    """int32 [tokens, k]: k distinct experts per token."""
    return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)


def random_routing(gen: torch.Generator, tokens: int, e: int, k: int, *, floor: float = 0.0,
                   normalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(router weights float32 [tokens, k], at least `floor`, summing to 1 when `normalize`; ids)."""
    ids = random_ids(gen, tokens, e, k)
    weights = torch.rand(tokens, k, generator=gen) + floor
    return (weights / weights.sum(-1, keepdim=True) if normalize else weights), ids


class SiluOnlyBackend(TorchBackend):
    """A deliberately broken kernel: computes SiLU whatever it is asked for (self-checked, unlike torch)."""
    name = "silu-only"
    spec = replace(TORCH_SPEC, name="silu-only", self_checked=True)

    def forward(self, prepared, hidden, topk_weights, topk_ids, activation, expert_map=None):
        return super().forward(prepared, hidden, topk_weights, topk_ids, SILU, expert_map)


class Choice(BackendChoice):
    """A plan entry that makes `SiluOnlyBackend` for the name "silu-only" and the real backend otherwise."""

    def make(self):
        return SiluOnlyBackend() if self.name == "silu-only" else super().make()


def broken_plan(why: str = "stands in for a GPU kernel") -> list[BackendChoice]:
    """A GPU-like plan on a CPU box: a kernel that ignores the activation, then the torch reference."""
    return [Choice("silu-only", {}, why), Choice("torch", {"weight_format": "mxfp4"}, "reference")]

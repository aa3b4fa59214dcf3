"""PyTorch backend: dequantise the touched experts one at a time, fp32 matmuls.

Slow but exact to the format and light on memory; it serves CPU machines and
stands behind every GPU backend as the last fallback. With
`weight_format="int4"` it computes what the gfx942 kernels compute.
"""
from __future__ import annotations

import torch

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.kernels.base import ExpertWeights, MoEBackend
from kimi_k3_moe.reference import dense_moe
from kimi_k3_moe.weights.requant import Int4Experts, requantize_experts

WEIGHT_FORMATS = ("mxfp4", "int4")


class TorchBackend(MoEBackend):
    name = "torch"

    def __init__(self, weight_format: str = "mxfp4", int4_method: str = "amax",
                 compute_dtype: torch.dtype = torch.float32):
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"torch backend: weight_format {weight_format!r} not in {WEIGHT_FORMATS}")
        self.weight_format = weight_format
        self.int4_method = int4_method
        self.compute_dtype = compute_dtype

    def describe(self) -> str:
        return f"{self.name}[{self.weight_format}]"

    def available(self) -> tuple[bool, str]:
        return True, "PyTorch runs everywhere"

    def prepare(self, experts: ExpertWeights) -> ExpertWeights | Int4Experts:
        if self.weight_format == "int4":
            return requantize_experts(experts, method=self.int4_method)
        return experts

    def dequantize_prepared(self, prepared, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        return prepared.dequantize(expert)

    def forward(self, prepared, hidden: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: ActivationSpec,
                expert_map: torch.Tensor | None = None) -> torch.Tensor:
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            if e not in cache:
                cache.clear()  # one expert's float weights alive at a time
                cache[e] = prepared.dequantize(e)
            return cache[e]

        return dense_moe(hidden, lambda e: weights(e)[0], lambda e: weights(e)[1],
                         topk_weights, topk_ids, activation, expert_map,
                         compute_dtype=self.compute_dtype)

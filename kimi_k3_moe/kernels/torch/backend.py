"""PyTorch backend: dequantise the touched experts one at a time, fp32 matmuls.

Slow but exact to the format and light on memory; it serves CPU machines and
stands behind every GPU backend as the last fallback. With
`weight_format="int4"` it computes what the gfx942 kernels compute.

Quantized activations (`act_dtype="fp8"|"fp4"`) are emulated: the activations
are quantized and dequantized by the formats' CPU quantizers at the two points
where the kernels quantize (`act_quant.ActQuant`), then multiplied in fp32. The
CPU path and the fallback behind a quantized-activation kernel therefore compute
the function that kernel computes, not a more accurate one; it is not faster.
"""
from __future__ import annotations

import torch

from kimi_k3_moe.act_quant import ActQuant, resolve_act_dtype
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.formats import int4
from kimi_k3_moe.kernels.base import ExpertWeights, MoEBackend
from kimi_k3_moe.reference import dense_moe
from kimi_k3_moe.weights.requant import Int4Experts, int4_experts_for

WEIGHT_FORMATS = ("mxfp4", "int4")


class TorchBackend(MoEBackend):
    name = "torch"

    def __init__(self, weight_format: str = "mxfp4", int4_method: str = int4.DEFAULT_METHOD,
                 compute_dtype: torch.dtype = torch.float32, act_dtype: str = "bf16",
                 act_quant: ActQuant | None = None):
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"torch backend: weight_format {weight_format!r} not in {WEIGHT_FORMATS}")
        if int4_method not in int4.METHODS:
            raise ValueError(f"torch backend: int4_method {int4_method!r} not in {int4.METHODS}")
        act_dtype = resolve_act_dtype(act_dtype)
        act_quant = act_quant or ActQuant.for_dtype(act_dtype)
        if act_quant.dtype != act_dtype:
            raise ValueError(f"torch backend: act_quant {act_quant} does not match act_dtype {act_dtype!r}")
        self.weight_format = weight_format
        self.int4_method = int4_method
        self.compute_dtype = compute_dtype
        self.act_quant = act_quant

    def describe(self) -> str:
        fmt = f"int4/{self.int4_method}" if self.weight_format == "int4" else self.weight_format
        act = f", {self.act_quant.tag()} emulated" if self.act_quant.quantizes else ""
        return f"{self.name}[{fmt}{act}]"

    def available(self) -> tuple[bool, str]:
        return True, "PyTorch runs everywhere"

    def prepare(self, experts: ExpertWeights | Int4Experts) -> ExpertWeights | Int4Experts:
        """MXFP4 experts, converted to int4 when asked; or experts converted ahead of time.

        Pre-converted experts (a `kimi-k3-moe convert` checkpoint) are taken
        as they are only for weight_format="int4" and only when their method
        is this backend's `int4_method`: methods are never mixed silently.
        """
        if self.weight_format == "int4":
            return int4_experts_for(experts, self.int4_method, "torch backend")
        if isinstance(experts, Int4Experts):
            raise ValueError(f"torch backend with weight_format={self.weight_format!r} was given "
                             "int4 experts; it needs the MXFP4 ones")
        if not isinstance(experts, ExpertWeights):
            raise TypeError(f"torch backend with weight_format={self.weight_format!r} needs MXFP4 "
                            f"ExpertWeights, got {type(experts).__name__}")
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
                         compute_dtype=self.compute_dtype, act_quant=self.act_quant)

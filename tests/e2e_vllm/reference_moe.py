"""Test-only vLLM plugin (`k3_reference_moe`): a float reference MoE method for Kimi-K3's routed experts.

The "off" side of the end-to-end comparison. With kimi-k3-moe filtered out
(VLLM_PLUGINS), vLLM's CPU build has no MoE backend for SiTU at all, so the
reference is supplied here, through the same vLLM machinery the plugin uses:
registered as quantization "mxfp4", handed the same `FusedMoEConfig`, the
same parameters filled by vLLM's loader, called by the same runner after the
same router. It shares no code with kimi-k3-moe: its own MXFP4 decode (E2M1
codes, low nibble first, E8M0 scales) and its own activation, in float32.

The function it computes can be switched in a running engine (`use_variant`,
through `LLM.collective_rpc`), so that one engine start shows the test would
notice a wrong one: `situ` (the betas vLLM passes, from config.json), `silu`,
`wrong-beta` (SiTU with (2.0, 1.5), aiter's old defaults), `no-linear-beta`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4Config, Mxfp4MoEMethod
from vllm.model_executor.utils import set_weight_attrs

VARIANTS = ("situ", "silu", "wrong-beta", "no-linear-beta")
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_done = False
_variant = "situ"


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_quantization_config("mxfp4")(ReferenceConfig)


def use_variant(worker, name: str) -> str:
    """For `collective_rpc`: every reference MoE layer of this worker computes `name` from now on."""
    global _variant
    if name not in VARIANTS:
        raise ValueError(f"reference MoE variant {name!r}: one of {VARIANTS}")
    _variant = name
    return name


class ReferenceMoEMethod(FusedMoEMethodBase):
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra):
        weight_loader = extra.pop("weight_loader")
        extra.pop("unpadded_hidden_size", None)
        extra.pop("global_num_experts", None)
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        scale_loader = Mxfp4MoEMethod.get_scale_weight_loader(weight_loader)
        for name, shape, loader, is_scale in (
                ("w13_weight", (e, 2 * i, h // 2), weight_loader, False),
                ("w13_weight_scale", (e, 2 * i, h // 32), scale_loader, True),
                ("w2_weight", (e, h, i // 2), weight_loader, False),
                ("w2_weight_scale", (e, h, i // 32), scale_loader, True)):
            param = torch.nn.Parameter(torch.zeros(shape, dtype=torch.uint8), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {**extra, "weight_loader": loader})
            if is_scale:
                param.quant_method = "block"  # sharded like its weight

    def get_fused_moe_quant_config(self, layer):
        return None

    def process_weights_after_loading(self, layer):
        # K3 pads the per-rank intermediate size at TP > 1 with zero codes: they decode to 0
        self.w13 = _dequant(layer.w13_weight.data, layer.w13_weight_scale.data)
        self.w2 = _dequant(layer.w2_weight.data, layer.w2_weight_scale.data)
        beta, linear_beta = self.moe.activation_situ_beta, self.moe.activation_situ_linear_beta
        self.acts = {"situ": _situ(beta, linear_beta), "silu": _silu, "wrong-beta": _situ(2.0, 1.5),
                     "no-linear-beta": _situ(beta, None)}

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        # Expert by expert, each over all its tokens in token order. A row's fp32 GEMM result
        # depends on how many rows the GEMM has (other BLAS kernels); a different grouping flips
        # single bf16 ulps of the output, which moves this model's logprobs by ~0.01.
        xf = x.float()
        out = torch.zeros_like(xf)
        inter = self.w13.shape[1] // 2
        act = self.acts[_variant]
        for e in torch.unique(topk_ids).tolist():
            token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            h13 = xf[token] @ self.w13[e].T
            y = (act(h13[:, :inter], h13[:, inter:]) @ self.w2[e].T) * topk_weights[token, slot, None].float()
            out.index_add_(0, token, y)
        return out.to(x.dtype)


class ReferenceConfig(Mxfp4Config):
    def _make_moe_method(self, moe):
        return ReferenceMoEMethod(moe)


def _silu(gate, up):
    return F.silu(gate) * up


def _dequant(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes [..., K/2] and E8M0 scales [..., K/32] -> float32 [..., K]."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    values = _E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = torch.exp2(scales.float() - 127.0).repeat_interleave(32, dim=-1)
    return values * scale


class _situ:
    def __init__(self, beta: float, linear_beta: float | None):
        self.beta, self.linear_beta = beta, linear_beta

    def __call__(self, gate, up):
        g = self.beta * torch.tanh(gate / self.beta) * torch.sigmoid(gate)
        lb = self.linear_beta
        return g * (up if lb is None or lb <= 0 else lb * torch.tanh(up / lb))

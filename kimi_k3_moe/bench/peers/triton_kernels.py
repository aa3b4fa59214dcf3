"""OpenAI's triton_kernels (v3.5.1 API, as vendored by vllm 0.33.0; vLLM's Hopper MXFP4 MoE for gpt-oss).

It has no SiTU: its only gated activation is the fused interleaved SwiGLU
(alpha 1.702, limit 7), so it is a timing peer computing another function, and
it is checked against the float reference of *that* function on the same
weights and routing. Its own routing kernels run on logits built so that they
pick exactly the bench's experts and weights; that routing is outside the
timed region (its matmuls are what is compared). Pass the folder holding the
`triton_kernels` package with --peer-path; nothing of it is committed here.
"""
from __future__ import annotations

import sys

import torch

from kimi_k3_moe.bench.peers.base import OTHER, Peer, PeerUnavailable, Runner

ALPHA, LIMIT = 1.702, 7.0


class InterleavedSwiglu:
    """What triton_kernels' fused swiglu computes on a [.., 2I] stage-1 row (gate even, up odd columns)."""

    name = "swiglu_oai_interleaved(1.702, 7)"

    def apply(self, h: torch.Tensor) -> torch.Tensor:
        x = h.float()
        gate, up = x[..., 0::2].clamp(max=LIMIT), x[..., 1::2].clamp(-LIMIT, LIMIT)
        return (gate * torch.sigmoid(ALPHA * gate) * (up + 1)).to(h.dtype)


class TritonKernelsPeer(Peer):
    name, role, label = "triton_kernels", OTHER, "triton_kernels matmul_ogs (SwiGLU stand-in)"

    def __init__(self, path: str | None = None):
        self.path = path

    def _import(self):
        if self.path and self.path not in sys.path:
            sys.path.insert(0, self.path)
        import triton_kernels  # noqa: F401
        return triton_kernels

    def probe(self) -> tuple[bool, str]:
        if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
            return False, "needs an NVIDIA GPU"
        try:
            tk = self._import()
        except Exception as exc:  # any import failure means: not here
            return False, f"triton_kernels not importable ({type(exc).__name__}: {exc}); pass --peer-path"
        return True, f"triton_kernels from {getattr(tk, '__file__', '?')}"

    def build(self, experts, activation, shape, expert_map) -> Runner:
        if expert_map is not None:
            raise PeerUnavailable("expert map (EP) not adapted for this peer")
        try:
            self._import()
            import triton_kernels.matmul_ogs_details.opt_flags as opt_flags
            import triton_kernels.swiglu
            from triton_kernels.matmul_ogs import FlexCtx, FnSpecs, FusedActivation, PrecisionConfig, matmul_ogs
            from triton_kernels.numerics import InFlexData
            from triton_kernels.routing import routing
            from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
            from triton_kernels.tensor_details import layout
        except Exception as exc:
            raise PeerUnavailable(f"triton_kernels API differs from v3.5.1: {type(exc).__name__}: {exc}") from exc
        opt_flags.update_opt_flags_constraints({"split_k": 1})

        def swizzle(packed, scale):
            vl, vo = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
            sl, so = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
            w = convert_layout(wrap_torch_tensor(packed.transpose(-2, -1), dtype=FP4), vl, **vo)
            s = convert_layout(wrap_torch_tensor(scale.transpose(-2, -1)), sl, **so)
            return w, s
        w13, s13 = swizzle(experts.w13_packed, experts.w13_scale)
        w2, s2 = swizzle(experts.w2_packed, experts.w2_scale)
        pc1 = PrecisionConfig(weight_scale=s13, flex_ctx=FlexCtx(rhs_data=InFlexData()))
        pc2 = PrecisionConfig(weight_scale=s2, flex_ctx=FlexCtx(rhs_data=InFlexData()))
        act = FusedActivation(FnSpecs("swiglu", triton_kernels.swiglu.swiglu_fn, ("alpha", "limit")),
                              (ALPHA, LIMIT), 2)
        e = experts.num_experts

        def route(weights, ids):
            # logits whose top-k are `ids` and whose softmax over them gives `weights` (they sum to 1)
            logits = torch.full((ids.shape[0], e), -30.0, device=ids.device, dtype=torch.float32)
            logits.scatter_(1, ids.long(), weights.float().clamp_min(1e-12).log())
            return routing(logits, ids.shape[1])

        def run(hidden, routed):
            rdata, gather, scatter = routed
            inter = matmul_ogs(hidden, w13, None, rdata, gather_indx=gather, precision_config=pc1,
                               fused_activation=act)
            return matmul_ogs(inter, w2, None, rdata, scatter_indx=scatter, precision_config=pc2,
                              gammas=rdata.gate_scal)
        return Runner(run=run, activation=InterleavedSwiglu(), route=route, route_in_timing=False,
                      notes=["computes an interleaved SwiGLU (no SiTU in triton_kernels): a timing stand-in, "
                             "checked against that function", "its routing kernels are not timed"])

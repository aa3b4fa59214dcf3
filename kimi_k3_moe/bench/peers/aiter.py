"""vLLM 0.33's own Kimi-K3 MoE path on ROCm: aiter's fused MoE, called as vLLM calls it for K3.

UNVERIFIED: written from aiter's public API as the vLLM 0.33.0 wheel uses it
(`oracle/mxfp4.py`, `experts/rocm_aiter_moe.py`, `_aiter_ops.py`); no AMD GPU
has run it here. gfx950: a16w4 (FlyDSL `moe_2stage_a16wmix`) with gate/up
SEPARATED (vLLM's default; a8w4 interleaves and is opt-in), weights shuffled
by `shuffle_weight_a16w4(.., 16, False)`, w13 scales by
`shuffle_scale_a16w4(.., E, False)`, w2 scales by `e8m0_shuffle`, then
`aiter.fused_moe.fused_moe(..., ActivationType.Situv2, QuantType.per_1x32,
gate_mode="separated", beta, linear_beta)`. gfx942 (int4 per 32 from
`per_1x32_i4_quant`) is not adapted: the bench says so instead of guessing.
"""
from __future__ import annotations

import torch

from kimi_k3_moe.activation import SITUV2
from kimi_k3_moe.bench.peers.base import ENGINE, Peer, PeerUnavailable, Runner


def _arch() -> str:
    props = torch.cuda.get_device_properties(0)
    return getattr(props, "gcnArchName", "").split(":")[0]


class AiterPeer(Peer):
    name, role, label = "aiter", ENGINE, "aiter fused_moe (vLLM 0.33's ROCm path; unverified adapter)"

    def probe(self) -> tuple[bool, str]:
        if not torch.cuda.is_available() or not getattr(torch.version, "hip", None):
            return False, "engine path: not available (aiter is vLLM's ROCm path; no AMD GPU here)"
        try:
            import aiter
            from aiter import ActivationType, QuantType  # noqa: F401
            from aiter.fused_moe import fused_moe  # noqa: F401
        except Exception as exc:
            return False, f"engine path: not available (aiter: {type(exc).__name__}: {exc})"
        if getattr(ActivationType, "Situv2", None) is None:
            return False, "engine path: not available (this aiter has no ActivationType.Situv2)"
        arch = _arch()
        if arch != "gfx950":
            return False, (f"engine path: not available ({arch}: vLLM runs K3 there as emulation or opt-in int4; "
                           "the int4 call is not adapted)")
        return True, f"aiter {getattr(aiter, '__version__', '?')} on {arch} (adapter unverified)"

    def build(self, experts, activation, shape, expert_map) -> Runner:
        if activation.name != SITUV2:
            raise PeerUnavailable("engine path: not available (the K3 aiter path is SiTUv2 only)")
        try:
            from aiter import ActivationType, QuantType
            from aiter.fused_moe import fused_moe
            from aiter.ops.flydsl.moe_common import GateMode
            from aiter.ops.shuffle import shuffle_scale_a16w4, shuffle_weight_a16w4
            from aiter.utility.fp4_utils import e8m0_shuffle
            fp4, e8m0 = torch.float4_e2m1fn_x2, torch.float8_e8m0fnu
            e = experts.num_experts
            w13 = shuffle_weight_a16w4(experts.w13_packed.view(fp4), 16, False)
            w2 = shuffle_weight_a16w4(experts.w2_packed.view(fp4), 16, False)
            s13 = experts.w13_scale.view(e8m0)
            s13 = shuffle_scale_a16w4(s13.reshape(-1, s13.shape[-1]), e, False)
            s2 = experts.w2_scale.view(e8m0)
            s2 = e8m0_shuffle(s2.reshape(-1, s2.shape[-1]))
        except Exception as exc:
            raise PeerUnavailable(f"engine path: not available (aiter API differs: {type(exc).__name__}: {exc})") \
                from exc
        emask = None if expert_map is None else (expert_map >= 0).to(torch.int32)

        def run(hidden, routed):
            weights, ids = routed
            return fused_moe(hidden, w13, w2, weights, ids, emask, ActivationType.Situv2, QuantType.per_1x32,
                             False, s13, s2, None, None, dtype=torch.bfloat16, gate_mode=GateMode.SEPARATED.value,
                             beta=activation.beta, linear_beta=activation.linear_beta)
        return Runner(run=run, activation=activation, notes=["aiter adapter unverified until a user runs it"])

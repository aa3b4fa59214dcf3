"""The kernel set CI compiles: every table tile at Kimi-K3's per-rank shape, per arch,
for SiLU and SiTUv2 (direct tiers in both layouts), plus the variants the checks need (runtime betas,
a second beta pair, every tier's asymmetric int4, fp32-atomic split-K stage 2, every aligned tier's
stage 2 with the fused top-k sum),
and on gfx950 the quantized-activation kernels: both activation quantizers, every
tier's a8w4 and a4w4 stages with SiTUv2, and SiLU / other-beta / atomic variants.
"""
from __future__ import annotations

from kimi_k3_moe.act_quant import BF16, FP8
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.experts.format import INT4, MXFP4
from kimi_k3_moe.kernels.flydsl import supported_act_dtypes, tiles
from kimi_k3_moe.kernels.flydsl.config import FlyKernelConfig, KLoop, QuantConfig
from kimi_k3_moe.platform import FLYDSL_ARCHS, Platform

# Kimi-K3 at TP8: routed experts run at hidden 3584, intermediate 3072/8 per rank, top-16
K3_HIDDEN = 3584
K3_INTER_TP8 = 384
K3_TOP_K = 16
K3_EXPERTS = 896
K3_SITU = ActivationSpec.situv2(4.0, 25.0)
OTHER_SITU = ActivationSpec.situv2(2.0, 1.5)   # a second beta pair: must never share a kernel with K3's


def ci_configs(archs=FLYDSL_ARCHS) -> list[FlyKernelConfig | QuantConfig]:
    out: dict[FlyKernelConfig | QuantConfig, None] = {}
    for arch in archs:
        weight_format = Platform("rocm", arch).weight_format   # the format the plan serves there
        shape = dict(hidden=K3_HIDDEN, inter=K3_INTER_TP8, top_k=K3_TOP_K)
        for cfg in tiles.sweep_configs(arch, weight_format, activations=[ActivationSpec.silu(), K3_SITU],
                                       num_experts=K3_EXPERTS, **shape):
            out.setdefault(cfg)
        s1, s2 = tiles.stage_configs(arch, weight_format, num_tokens=1, activation=K3_SITU, **shape)
        extras = [
            s1.with_activation(K3_SITU, betas="runtime"),
            s1.with_activation(OTHER_SITU),
            s2.with_tile(k_waves=1).with_reduction("atomic", split_k=3),
        ]
        for tier in tiles.default_table()[arch]:   # every aligned tier's stage 2 with either deterministic sum
            for reduce in ("slots", "fused"):
                extras.append(tiles.stage_configs(arch, weight_format, num_tokens=tier.max_tokens or 1 << 20,
                                                  activation=K3_SITU, reduce=reduce, **shape)[1])
        # the LDS double buffer on the largest tier's tiles, which no tier takes yet (docs/FLYDSL.md); int4 at
        # n_rep 2: at that tier's n_rep 3 / 4 the carried weights take 418 / 278 VGPRs, one wave per SIMD
        last = tiles.stage_configs(arch, weight_format, num_tokens=1 << 20, activation=K3_SITU, **shape)
        extras += [c.with_tile(schedule=KLoop.LDS_DB, waves_per_eu=2,
                               n_rep=2 if weight_format == INT4 else c.tile.n_rep) for c in last]
        if weight_format == INT4:   # asymmetric int4: every tier's kernels (registers and decode checked)
            extras += tiles.sweep_configs(arch, weight_format, activations=[K3_SITU], has_offsets=True,
                                          num_experts=K3_EXPERTS, **shape)
        for cfg in extras:
            out.setdefault(cfg)
        for cfg in quantized_configs(arch):
            out.setdefault(cfg)
    return list(out)


def quantized_configs(arch: str) -> list[FlyKernelConfig | QuantConfig]:
    """fp8/fp4 activations (gfx950 only): quantizer, every tier's stages, and the variants."""
    shape = dict(hidden=K3_HIDDEN, inter=K3_INTER_TP8, top_k=K3_TOP_K)
    out: dict[FlyKernelConfig | QuantConfig, None] = {}
    for act in supported_act_dtypes(arch):
        if act == BF16:
            continue
        out.setdefault(QuantConfig(arch, act))
        for cfg in tiles.sweep_configs(arch, MXFP4, activations=[K3_SITU], act_dtype=act, **shape):
            out.setdefault(cfg)
        s1, s2 = tiles.stage_configs(arch, MXFP4, num_tokens=1, activation=K3_SITU, act_dtype=act, **shape)
        out.setdefault(s1.with_activation(ActivationSpec.silu()))
        if act == FP8:
            out.setdefault(s1.with_activation(OTHER_SITU))
        else:
            out.setdefault(s2.with_tile(k_waves=1).with_reduction("atomic", split_k=3))
    return list(out)

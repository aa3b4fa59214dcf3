"""The MoE with fp8 activations (e4m3, float32 scale per row) for one chunk of tokens, as launches.

    quantize hidden -> stage 1 (e4m3 dots, SiTUv2/SiLU, float32 out) -> quantize
    intermediate -> stage 2 (e4m3 dots, router weight) [-> top-k reduction]

on the aligned path (matrix unit) or the small-batch path (fp32 FMA), chosen by
the same MoEConfig as the bf16 kernels (`fp8_config` adapts it). The scheme is
`ACT_QUANT`: what reference.dense_moe(..., act_quant=ACT_QUANT) computes.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kimi_k3_moe.act_quant import FP8, TOKEN, ActQuant
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.configs.triton_table import KernelConfig, MoEConfig
from kimi_k3_moe.kernels.triton._details import fp8_kernels as K
from kimi_k3_moe.kernels.triton.alignment import AlignedPairs, align_launches
from kimi_k3_moe.kernels.triton.fp8_layout import Fp8Experts
from kimi_k3_moe.kernels.triton.launch import Launch, cdiv, next_pow2
from kimi_k3_moe.kernels.triton.stage1 import DECODE_CODES, activation_args
from kimi_k3_moe.kernels.triton.stage2 import topk_reduce

ACT_QUANT = ActQuant(FP8, hidden=TOKEN, inter=TOKEN)
MIN_DOT_K = 32  # e4m3 dots on Hopper take K in steps of 32


MAX_ACC_PER_THREAD = 96  # stage 1's two fp32 accumulators above this spill on sm_90 (BM 128 x BN 64, 4 warps)
# Precise fp8 accumulation (see _details/fp8_kernels._dot8) keeps a partial accumulator
# beside each fp32 one, so each counts twice against the registers.
PROMOTED = 2
MIN_BLOCK_N = 32
# row blocks where stage 1 takes one K-order dot instead of eight word dots: with 64 rows, on
# the H200 at 4096 and 16384 tokens, 24-25 % faster with the e4m3 operands
# (benchmarks/results/h200-2026-11-29-retune/bench_fp8.json, variant "s1-one-dot"); with 128
# rows the one dot needs 255 registers and spills on sm_90
ONE_DOT_BLOCK_MS = (64,)


def fp8_config(config: MoEConfig) -> MoEConfig:
    """A bf16 MoEConfig made valid for the e4m3 kernels: word dots need K/8 >= 32, else one dot in K order
    (stage 1 also takes one dot in ONE_DOT_BLOCK_MS row blocks); where the accumulators (two in
    stage 1, each doubled by the precise fp8 accumulation) alone would fill the registers, more warps,
    then narrower N tiles."""
    if config.path != "aligned":
        return config

    def fix(cfg: KernelConfig, accumulators: int) -> KernelConfig:
        if cfg.pairs:  # the e4m3 kernels have no pair-order variant: they take the K-order dots
            cfg = replace(cfg, pairs=False, interleave=True, stack_gate_up=False)
        if not cfg.interleave and cfg.block_k // 8 < MIN_DOT_K:
            cfg = replace(cfg, interleave=True)
        if accumulators == 2 and config.block_m in ONE_DOT_BLOCK_MS:
            cfg = replace(cfg, interleave=True)

        def too_big(c: KernelConfig) -> bool:
            per_thread = accumulators * PROMOTED * config.block_m * c.block_n / (32 * c.num_warps)
            return per_thread > MAX_ACC_PER_THREAD
        while too_big(cfg) and cfg.num_warps < 8:
            cfg = replace(cfg, num_warps=cfg.num_warps * 2)
        while too_big(cfg) and cfg.block_n > MIN_BLOCK_N:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        return cfg
    return replace(config, stage1=fix(config.stage1, 2), stage2=fix(config.stage2, 1))


def _weights(experts: Fp8Experts, which: str) -> dict:
    w = getattr(experts, which)
    d = getattr(experts, f"{which}_shift")
    rs = getattr(experts, f"{which}_row_scale")
    return dict(w_ptr=w, stride_we=w.stride(0), stride_wn=w.stride(1),
                d_ptr=d, stride_de=d.stride(0), stride_dn=d.stride(1),
                rs_ptr=rs, stride_re=rs.stride(0), lut_ptr=experts.lut)


def quantize_rows(x: torch.Tensor, out_block_k: int, num_rows: torch.Tensor | None = None,
                  label: str = "fp8.quantize") -> tuple[torch.Tensor, torch.Tensor, Launch]:
    """x [R, K] (any float dtype) -> (uint8 e4m3 codes [R, K] in word order of out_block_k tiles (0: plain),
    float32 scales [R], the launch). `num_rows` (device, int32 [1]) limits the rows quantized."""
    rows, cols = x.shape
    codes = torch.empty(rows, cols, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = next_pow2(cols)
    return codes, scales, Launch(K.quantize_rows_kernel, (rows,), dict(
        x_ptr=x, stride_xm=x.stride(0), q_ptr=codes, stride_qm=codes.stride(0), scale_ptr=scales,
        num_rows_ptr=scales if num_rows is None else num_rows, n_cols=cols,
        HAS_NUM_ROWS=num_rows is not None, BLOCK=block, OUT_BLOCK_K=out_block_k),
        4 if block <= 2048 else 8, 1, label)


def plan_moe_fp8(experts: Fp8Experts, hidden: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, activation: ActivationSpec, expert_map: torch.Tensor | None,
                 out: torch.Tensor, config: MoEConfig) -> list[Launch]:
    """Launches computing `out` ([T, H], written in full) in order; buffers are allocated here."""
    config = fp8_config(config).validate(experts.hidden_size, experts.intermediate_size)
    s1, s2 = config.stage1, config.stage2
    if config.path == "gemv":
        return _gemv(experts, hidden, topk_weights, topk_ids, activation, expert_map, out, config)
    pairs, align = align_launches(topk_ids, expert_map, experts.num_experts, config.block_m)
    x, xs, quant_x = quantize_rows(hidden, 0 if s1.interleave else s1.block_k, label="fp8.quantize_hidden")
    inter32, stage1 = _stage1_aligned(experts, x, xs, pairs, topk_ids.shape[1], activation, s1, config.decode)
    a, a_scale, quant_a = quantize_rows(inter32, 0 if s2.interleave else s2.block_k, pairs.num_rows,
                                        "fp8.quantize_inter")
    return [*align, quant_x, stage1, quant_a,
            *_stage2_aligned(experts, a, a_scale, pairs, topk_weights, out, s2, config.decode)]


def _stage1_aligned(experts, x, xs, pairs: AlignedPairs, topk, activation, cfg: KernelConfig, decode):
    inter_size = experts.intermediate_size
    inter = torch.empty(pairs.max_rows, inter_size, dtype=torch.float32, device=x.device)
    args = dict(x_ptr=x, stride_xm=x.stride(0), xs_ptr=xs, **_weights(experts, "w13"),
                inter_ptr=inter, stride_im=inter.stride(0),
                sorted_ptr=pairs.sorted_pairs, block_expert_ptr=pairs.block_expert,
                num_rows_ptr=pairs.num_rows, num_pairs=pairs.num_pairs,
                inter_size=inter_size, hidden=experts.hidden_size, **activation_args(activation),
                TOPK=topk, DECODE=DECODE_CODES[decode], SWAP=cfg.swap, INTERLEAVE=cfg.interleave,
                BLOCK_M=pairs.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    grid = (pairs.max_blocks, cdiv(inter_size, cfg.block_n))
    return inter, Launch(K.stage1_fp8_aligned_kernel, grid, args, cfg.num_warps, cfg.num_stages,
                         "fp8.stage1.aligned")


def _stage2_aligned(experts, a, a_scale, pairs: AlignedPairs, topk_weights, out, cfg: KernelConfig,
                    decode) -> list[Launch]:
    hidden = experts.hidden_size
    topk = topk_weights.shape[1]
    y = torch.empty(pairs.num_pairs, hidden, dtype=torch.bfloat16, device=a.device)
    matmul = Launch(K.stage2_fp8_aligned_kernel, (pairs.max_blocks, cdiv(hidden, cfg.block_n)), dict(
        a_ptr=a, stride_am=a.stride(0), as_ptr=a_scale, **_weights(experts, "w2"),
        y_ptr=y, stride_ym=y.stride(0), topk_w_ptr=topk_weights.reshape(-1),
        sorted_ptr=pairs.sorted_pairs, block_expert_ptr=pairs.block_expert, num_rows_ptr=pairs.num_rows,
        num_pairs=pairs.num_pairs, hidden=hidden, inter_size=experts.intermediate_size,
        DECODE=DECODE_CODES[decode], SWAP=cfg.swap, INTERLEAVE=cfg.interleave,
        BLOCK_M=pairs.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k),
        cfg.num_warps, cfg.num_stages, "fp8.stage2.aligned")
    return [matmul, topk_reduce(y, pairs, out, topk)]


def _gemv(experts, hidden, topk_weights, topk_ids, activation, expert_map, out, config: MoEConfig):
    s1, s2 = config.stage1, config.stage2
    inter_size = experts.intermediate_size
    num_pairs = topk_ids.numel()
    topk = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)
    emap = ids if expert_map is None else expert_map
    x, xs, quant_x = quantize_rows(hidden, s1.block_k, label="fp8.quantize_hidden")
    inter = torch.empty(num_pairs, inter_size, dtype=torch.float32, device=hidden.device)
    stage1 = Launch(K.stage1_fp8_gemv_kernel, (num_pairs, cdiv(inter_size, s1.block_n)), dict(
        x_ptr=x, stride_xm=x.stride(0), xs_ptr=xs, **_weights(experts, "w13"),
        inter_ptr=inter, stride_im=inter.stride(0), ids_ptr=ids, map_ptr=emap,
        inter_size=inter_size, hidden=experts.hidden_size, **activation_args(activation),
        TOPK=topk, HAS_MAP=expert_map is not None, DECODE=DECODE_CODES[config.decode],
        BLOCK_N=s1.block_n, BLOCK_K=s1.block_k), s1.num_warps, s1.num_stages, "fp8.stage1.gemv")
    a, a_scale, quant_a = quantize_rows(inter, s2.block_k, label="fp8.quantize_inter")
    hidden_size = experts.hidden_size
    stage2 = Launch(K.stage2_fp8_gemv_kernel, (out.shape[0], cdiv(hidden_size, s2.block_n)), dict(
        a_ptr=a, stride_am=a.stride(0), as_ptr=a_scale, **_weights(experts, "w2"),
        out_ptr=out, stride_om=out.stride(0), ids_ptr=ids, map_ptr=emap, topk_w_ptr=topk_weights.reshape(-1),
        hidden=hidden_size, inter_size=inter_size, TOPK=topk, SLOTS=next_pow2(topk),
        HAS_MAP=expert_map is not None, DECODE=DECODE_CODES[config.decode],
        BLOCK_N=s2.block_n, BLOCK_K=s2.block_k), s2.num_warps, s2.num_stages, "fp8.stage2.gemv")
    return [quant_x, stage1, quant_a, stage2]

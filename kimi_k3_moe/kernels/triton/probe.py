"""Decode a prepared weight matrix with the kernels' decoder (for tests and GPU checks)."""
from __future__ import annotations

import torch

from kimi_k3_moe.experts import MXFP4
from kimi_k3_moe.kernels.common.launch import cdiv
from kimi_k3_moe.kernels.triton import layout
from kimi_k3_moe.kernels.triton.weight_codes import decode_code, weights_code


def decode_rows(words: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, weight_format: str,
                decode: str = "bits", block_n: int = 16, block_k: int = 64, pairs: bool = False,
                wide_scales: bool | None = None) -> torch.Tensor:
    """[rows, K/2] word-layout codes (+ scales, offsets) -> fp32 [rows, K], through the kernels' decoder
    (pairs: the pair-order tile of the one-dot kernels, else the two regrouped halves; wide_scales:
    the layer's TritonExperts.wide_scales, None to read it off these scales)."""
    if wide_scales is None:
        wide_scales = weight_format == MXFP4 and layout.wide_scales(scales)
    from kimi_k3_moe.kernels.triton._details.probe_kernels import decode_probe_kernel
    rows, half = words.shape
    k = half * 2
    if k % block_k:
        raise ValueError(f"K = {k} is not a multiple of block_k = {block_k}")
    out = torch.empty(rows, k, dtype=torch.float32, device=words.device)
    decode_probe_kernel[(cdiv(rows, block_n),)](
        words.contiguous(), scales.contiguous(), (scales if offsets is None else offsets).contiguous(), out,
        rows, k, WEIGHTS=weights_code(weight_format, decode_code(decode, wide_scales), offsets is not None),
        BLOCK_N=block_n, BLOCK_K=block_k, PAIRS=pairs)
    return out

"""A stage config's K order (KOrder, _details/constants.py, with each order's code and stored order)
as the aligned kernels' ORDER and OUT_ORDER constexprs. Nothing here names an order but words, whose
stored order needs its block_k."""
from __future__ import annotations

from kimi_k3_moe.kernels.triton.table import KernelConfig, KOrder


def stage1_args(cfg: KernelConfig, stage2: KernelConfig) -> dict:
    """The stage-1 kernel's ORDER, and OUT_ORDER: inter stored as stage 2 reads it (its
    stored_order), in pair order, plain, or in word order, which is given by the block_k of its
    tiles (one constexpr for both; words takes block_k >= 128, so it is never one of the codes)."""
    out = stage2.order.stored_order
    if out != KOrder.WORDS:
        return dict(ORDER=cfg.order.code, OUT_ORDER=out.code)
    if stage2.block_k in {o.code for o in KOrder}:
        raise ValueError(f"stage2.block_k = {stage2.block_k}: order 'words' needs block_k >= 128")
    return dict(ORDER=cfg.order.code, OUT_ORDER=stage2.block_k)


def stage2_args(cfg: KernelConfig) -> dict:
    """The stage-2 kernel's ORDER."""
    return dict(ORDER=cfg.order.code)

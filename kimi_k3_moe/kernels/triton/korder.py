"""A stage config's K order (kernels/triton/table.KOrder) as the aligned kernels' constexprs, and
the order in which each stage's activations must be stored for it."""
from __future__ import annotations

from kimi_k3_moe.kernels.triton.table import KernelConfig, KOrder
from kimi_k3_moe.kernels.triton._details import constants as C

CODES = {KOrder.WORDS: C.ORDER_WORDS, KOrder.INTERLEAVE: C.ORDER_INTERLEAVE, KOrder.PAIRS: C.ORDER_PAIRS,
         KOrder.STACKED: C.ORDER_STACKED, KOrder.PLAIN_INTER: C.ORDER_PLAIN_INTER}


def stored_order(cfg: KernelConfig) -> KOrder:
    """The order a stage with config `cfg` reads its activations from memory in: WORDS (word order of
    cfg.block_k tiles), PAIRS, or INTERLEAVE for the plain order (interleave regroups the weights in
    registers instead, plain-inter swaps the activations in registers)."""
    if cfg.order == KOrder.WORDS:
        return KOrder.WORDS
    if cfg.order in (KOrder.PAIRS, KOrder.STACKED):
        return KOrder.PAIRS
    return KOrder.INTERLEAVE


def stage1_args(cfg: KernelConfig, stage2: KernelConfig) -> dict:
    """The stage-1 kernel's ORDER, and OUT_ORDER: inter stored as stage 2 reads it, in pair order
    (ORDER_PAIRS), plain (ORDER_INTERLEAVE), or in word order, which is given by the block_k of its
    tiles (one constexpr for both; words takes block_k >= 128, so it is never one of the codes)."""
    out = stored_order(stage2)
    if out != KOrder.WORDS:
        return dict(ORDER=CODES[cfg.order], OUT_ORDER=CODES[out])
    if stage2.block_k in CODES.values():
        raise ValueError(f"stage2.block_k = {stage2.block_k}: order 'words' needs block_k >= 128")
    return dict(ORDER=CODES[cfg.order], OUT_ORDER=stage2.block_k)


def stage2_args(cfg: KernelConfig) -> dict:
    """The stage-2 kernel's ORDER."""
    return dict(ORDER=CODES[cfg.order])

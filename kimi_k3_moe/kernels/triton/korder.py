"""A stage config's K order (configs/triton_table.KOrder) as the aligned kernels' constexprs, and
the order in which each stage's activations must be stored for it."""
from __future__ import annotations

from kimi_k3_moe.configs.triton_table import KernelConfig, KOrder
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
    """The stage-1 kernel's ORDER, and OUT_ORDER / OUT_BLOCK_K: inter stored as stage 2 reads it."""
    out = stored_order(stage2)
    return dict(ORDER=CODES[cfg.order], OUT_ORDER=CODES[out],
                OUT_BLOCK_K=stage2.block_k if out == KOrder.WORDS else 0)


def stage2_args(cfg: KernelConfig) -> dict:
    """The stage-2 kernel's ORDER."""
    return dict(ORDER=CODES[cfg.order])

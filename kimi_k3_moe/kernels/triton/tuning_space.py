"""The Triton backend's tuning space: which tile configs a tuner tries per token tier.

Kept beside the kernels (not in the tuner) so that whoever changes what a kernel
config can be also changes what is tried, and every tuner (the project's
benchmarks/tune_triton.py, a user-side tune command) enumerates the same space.
"""
from __future__ import annotations

from dataclasses import replace
from itertools import product

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.kernels.triton import table as tt
from kimi_k3_moe.kernels.triton.table import KernelConfig, KOrder, MoEConfig

TIERS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
TOPK = 16
ACT = ActivationSpec.situv2(4.0, 25.0)
GEMV_MAX_TOKENS = 16

# (block_n, block_k, num_warps, num_stages[, order[, n_tiles]]), order a KOrder (INTERLEAVE when absent),
# PAIRS: one dot per K step on the pair order; STACKED: the same on one stacked gate/up tile (the H200's winners
# at 16-256 tokens;
# block_k 256 is faster still under Triton 3.6, the H200 table's; it spills under 3.9). The GEMV path prefetches
# its weights itself, num_stages K steps ahead (its loops have no dot for the compiler to pipeline); on an H100
# (Triton 3.8, 1 token) 2-4 steps ahead took stage 2's 64-wide K steps 1.5-2.5 us faster and stage 1 nothing.
GEMV_S1 = [(8, 512, 4, 1), (4, 512, 4, 1), (16, 512, 4, 1), (16, 256, 4, 1), (32, 256, 4, 1)]
GEMV_S2 = [(4, 128, 4, 1), (8, 64, 4, 4), (8, 128, 4, 2), (16, 64, 4, 1), (8, 64, 4, 1), (16, 128, 8, 1)]
# most promising first: the secondary entries try only the first QUICK of each list
WORDS, INTERLEAVE, PAIRS = KOrder.WORDS, KOrder.INTERLEAVE, KOrder.PAIRS
STACKED = KOrder.STACKED  # pairs, gate and up rows in one tile (H200 winners at 16-64 tokens MXFP4, 4096+ int4)
PLAIN_INTER = KOrder.PLAIN_INTER  # pairs on several N tiles, inter read in plain order
ALIGNED_S1 = [(64, 128, 4, 3, PAIRS), (32, 128, 4, 3, STACKED), (64, 128, 8, 3, STACKED), (64, 256, 4, 3, PAIRS),
              # the H200's winners at 4096+ on tail blocks: MXFP4 the first, int4 the second
              (64, 64, 8, 3, STACKED), (64, 64, 4, 3, STACKED),
              (64, 256, 4, 3, WORDS), (128, 64, 8, 4, INTERLEAVE), (64, 128, 4, 4, WORDS), (128, 128, 8, 3, INTERLEAVE),
              (128, 256, 8, 3, WORDS), (128, 128, 8, 4, WORDS), (64, 256, 8, 3, WORDS), (64, 128, 4, 3, INTERLEAVE),
              # two stages: less shared memory per CTA, so more CTAs per SM on the latency-bound sizes
              (64, 256, 4, 2, WORDS), (64, 128, 4, 2, WORDS), (128, 128, 8, 2, WORDS)]
ALIGNED_S2 = [(64, 128, 4, 3, PAIRS), (128, 128, 8, 3, PAIRS), (64, 64, 4, 4, PAIRS), (128, 64, 8, 3, INTERLEAVE),
              (256, 128, 8, 3, INTERLEAVE), (256, 64, 8, 3, INTERLEAVE),  # 4096+ on 128-row blocks, not swapped
              (128, 128, 8, 3, WORDS), (64, 64, 4, 4, INTERLEAVE), (256, 128, 8, 3, WORDS),
              (128, 128, 8, 3, INTERLEAVE), (128, 128, 4, 4, WORDS), (64, 128, 4, 3, WORDS)]
# stage 2 with several N tiles per program (KernelConfig.n_tiles; the H200's winners at 4-1024 tokens),
# tried up to TILES_MAX_TOKENS: above, the 128-row blocks measured slower with it. Not 128 x 128 x 4
# tiles: no table entry took it, and under Triton 3.8 at EP16's I = 3072 its compile ran past 5
# minutes, taking a whole tune's budget
ALIGNED_S2_TILES = [(64, 128, 4, 3, PAIRS, 8), (64, 128, 4, 3, PAIRS, 14), (64, 64, 4, 2, PAIRS, 4)]
TILES_MAX_TOKENS = 1024
# the direct path (one pair per 16-row block, no alignment launches) at the GEMV tiers, with
# programmatic dependent launch; the H200's winners at 1-16 tokens first
DIRECT_S1 = [(32, 256, 4, 3, STACKED), (64, 256, 4, 3, PAIRS), (32, 128, 4, 4, STACKED)]
DIRECT_S2 = [(64, 128, 4, 3, PAIRS, 2), (64, 64, 4, 2, PAIRS, 4), (64, 128, 4, 3, PAIRS)]
# up to here the aligned path's best tiles are also tried with pdl toggled (the H200's aligned entries
# at 4-64 tokens took it; at EP16 it measured slower); a GPU without it gets the same
# config back (MoEConfig.for_target), tried once
PDL_MAX_TOKENS = 64
# the activations a pair-order stage 2 with n_tiles > 1 keeps for all its tiles (block_m x I bf16):
# Triton 3.6 holds them in shared memory (sm_90 SASS: LDGSTS), so TP8's 128- and 160-row
# blocks (96 / 120 KB) fit beside the weight stages and EP16's I = 3072 (192 KB at 32 rows) does not
TILES_X_BYTES = 128 * 1024
REGISTER_MARGIN = 250  # configs using more are treated as spilling (see tune_entry)
QUICK = 4  # candidates per stage for the secondary entries (int4, TP16): the first ones of each list


# row blocks of a main and a tail tile (MoEConfig.block_m, table.row_tiles) for stage 1 at
# these tiers, where a TP8 or EP16 expert holds ~73 (4096) or ~292 (16384) rows; stage 2 is tried
# on them (swapped) and on blocks of SPLIT_STAGE2_BLOCK_M rows of its own (MoEConfig.stage2_block_m)
TAIL_BLOCKS = {4096: (96,), 16384: (160, 192)}
# the tiles that win on tail blocks on the H200: stage 1 MXFP4 (64, 64, 8 warps) and int4
# (4 warps), 64 x 128 at 16384; stage 2 not swapped 256 x 128 and 256 x 64 on its own 128-row blocks
TAIL_S1_WINNERS = [(64, 64, 8, 3, STACKED), (64, 64, 4, 3, STACKED), (64, 128, 8, 3, STACKED)]
TAIL_S2_WINNERS = [(256, 128, 8, 3, INTERLEAVE), (256, 64, 8, 3, INTERLEAVE)]
SPLIT_STAGE2_BLOCK_M = 128
# stage 2 swapped (weights the register operand, so its wgmmas chain) on 28 N tiles of 64 per
# program, the row block's activations loaded once into shared memory for all of them: the H200's
# winners at 4096 (on the tail blocks, 3 stages) and 16384 (on 128-row blocks of its own, 2 stages),
# where they cut stage 2 by 27-34 % against the previous entries (docs/TRITON.md); an SM runs two blocks of
# each. Tried on both kinds of block, inter in pair order and read plainly (PLAIN_INTER).
TAIL_S2_TILES = [(64, 128, 4, 3, PAIRS, 28), (64, 128, 4, 2, PAIRS, 28),
                 (64, 128, 4, 3, PLAIN_INTER, 28), (64, 128, 4, 2, PLAIN_INTER, 28)]


def block_ms(tier: int) -> list[int]:
    if tier <= 16:
        return [16]
    if tier <= 64:
        return [16, 32]
    if tier <= 256:
        return [16, 32, 64]
    if tier <= 1024:
        return [32, 64, 128]
    return [64, 128]


def swaps(block_m: int) -> list[bool]:
    return [True] if block_m <= 32 else [True, False]


def kc(t, swap=True) -> KernelConfig:
    bn, bk, w, s, *rest = t
    order = rest[0] if rest else INTERLEAVE
    n_tiles = rest[1] if len(rest) > 1 else 1
    return KernelConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=s, swap=swap, order=order, n_tiles=n_tiles)


def valid(cfg: MoEConfig, hidden: int, inter: int) -> bool:
    try:
        cfg.validate(hidden, inter)
    except ValueError:
        return False
    s2 = cfg.stage2
    held = cfg.block_ms[1] * inter * 2
    return not (cfg.path == "aligned" and s2.order.pairs and s2.n_tiles > 1 and held > TILES_X_BYTES)


def candidates(tier: int, hidden: int, inter: int, quick: bool = False):
    """{(path, block_m): (stage-1 list, stage-2 list, base config)}."""
    out = {}
    n = QUICK if quick else None
    base_h = tt.heuristic_config(hidden, inter, max(tier, 32), is_cuda=True)
    if tier <= GEMV_MAX_TOKENS:
        base = tt.heuristic_config(hidden, inter, 1, is_cuda=True)
        s1 = [replace(base, stage1=kc(c)) for c in GEMV_S1[:n]]
        s2 = [replace(base, stage2=kc(c)) for c in GEMV_S2[:n]]
        out[("gemv", 0)] = ([c for c in s1 if valid(c, hidden, inter)],
                            list(dict.fromkeys(c for c in s2 if valid(c, hidden, inter))), base)
        out.update(_direct_candidates(hidden, inter, n))
    # quick: the two smallest row blocks (the largest never won a tier on the H200)
    for bm in block_ms(tier)[:2] if quick else block_ms(tier):
        base = replace(base_h, block_m=bm, stage1=replace(base_h.stage1, swap=bm <= 64),
                       stage2=replace(base_h.stage2, swap=bm <= 64))
        s1 = [replace(base, stage1=kc(c, sw)) for c, sw in product(ALIGNED_S1[:n], swaps(bm))]
        s2_tiles = ALIGNED_S2[:n] + (ALIGNED_S2_TILES[:n] if tier <= TILES_MAX_TOKENS else [])
        s2 = [replace(base, stage2=kc(c, sw)) for c, sw in product(s2_tiles, swaps(bm))]
        # shapes whose stage-2 K (= I) does not take block_k 128 (TP16: I = 192) get block_k 64 tiles
        s2 += [replace(base, stage2=kc((c[0], 64, *c[2:]), sw)) for c, sw
               in product(s2_tiles, swaps(bm)) if inter % c[1]]
        s1 = [c for c in s1 if valid(c, hidden, inter)]
        s2 = list(dict.fromkeys(c for c in s2 if valid(c, hidden, inter)))
        if s1 and s2:
            out[("aligned", bm)] = (s1, s2, base if valid(base, hidden, inter) else s1[0])
    for bm in TAIL_BLOCKS.get(tier, ()):
        out.update(_tail_candidates(base_h, bm, hidden, inter, n))
    return out


def _winners_first(tiles: list, winners: list) -> list:
    """`tiles` with `winners` moved to the front (so a quick tune, which takes the first few, tries them)."""
    return list(winners) + [t for t in tiles if t not in winners]


def _fit_k(stage2: KernelConfig, inter: int) -> KernelConfig:
    """A stage-2 tile whose K step does not divide I (TP16's 192) steps 64 wide instead."""
    return stage2 if inter % stage2.block_k == 0 else replace(stage2, block_k=64)


def _direct_candidates(hidden: int, inter: int, n: int | None) -> dict:
    """The direct path with pdl: DIRECT_S1 x the first stage 2, the first stage 1 x DIRECT_S2."""
    base = MoEConfig("direct", tt.DIRECT_BLOCK_M, kc(DIRECT_S1[0]), _fit_k(kc(DIRECT_S2[0]), inter), "ptx", pdl=True)
    s1 = [replace(base, stage1=kc(c)) for c in DIRECT_S1[:n]]
    s2 = [replace(base, stage2=_fit_k(kc(c), inter)) for c in DIRECT_S2[:n]]
    s1 = [c for c in s1 if valid(c, hidden, inter)]
    s2 = list(dict.fromkeys(c for c in s2 if valid(c, hidden, inter)))
    return {("direct", tt.DIRECT_BLOCK_M): (s1, s2, s1[0])} if s1 and s2 else {}


def _tail_candidates(base_h: MoEConfig, bm: int, hidden: int, inter: int, n: int | None) -> dict:
    """Stage 1 on tail blocks of bm rows (swapped: the tail is a second MMA on the same weights);
    stage 2 on its own 128-row blocks (either orientation) or, swapped, on the same blocks; the
    many-tile stage 2 (TAIL_S2_TILES) first, on both."""
    base = replace(base_h, block_m=bm, stage1=replace(base_h.stage1, swap=True),
                   stage2=replace(base_h.stage2, swap=False), stage2_block_m=SPLIT_STAGE2_BLOCK_M)
    s1 = [replace(base, stage1=kc(c)) for c in _winners_first(ALIGNED_S1, TAIL_S1_WINNERS)[:n]]
    s2_tiles = _winners_first(ALIGNED_S2, TAIL_S2_WINNERS)[:n]
    s2 = [replace(base, stage2=kc(c), stage2_block_m=bm2)
          for c in TAIL_S2_TILES[:n] for bm2 in (None, SPLIT_STAGE2_BLOCK_M)]
    s2 += [replace(base, stage2=kc(c, sw)) for c, sw in product(s2_tiles, (True, False))]
    s2 += [replace(base, stage2=kc(c), stage2_block_m=None) for c in s2_tiles]
    s2 = [replace(c, stage2=_fit_k(c.stage2, inter)) for c in s2]
    s1 = [c for c in s1 if valid(c, hidden, inter)]
    s2 = list(dict.fromkeys(c for c in s2 if valid(c, hidden, inter)))
    return {("aligned", bm): (s1, s2, base if valid(base, hidden, inter) else s1[0])} if s1 and s2 else {}

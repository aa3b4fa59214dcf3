"""Integer codes for the kernels' constexpr switches (shared by launchers and kernels), and the K
orders (KOrder) with theirs. Plain Python: table.py imports it without triton."""
from __future__ import annotations

from enum import Enum

FMT_MXFP4 = 0
FMT_INT4 = 1

DECODE_BITS = 0  # portable Triton integer/float ops, one element at a time
DECODE_PTX = 1   # inline PTX producing bf16 pairs (NVIDIA sm_80+); MXFP4: one multiply, scales <= 2
DECODE_PTX_WIDE = 2  # the same for MXFP4 weights with a scale above 2: two multiplies

# The stage kernels' WEIGHTS: format, decoder and int4 offsets as one code, one per combination the
# backend can launch (kernels/triton/weight_codes.py maps to it). Each code's (FMT, DECODE, HAS_OFFSETS)
# is WEIGHTS[code]: what the decode helpers (decode.py) take apart.
W_MXFP4_BITS = 0
W_MXFP4_PTX = 1
W_MXFP4_PTX_WIDE = 2
W_INT4_BITS = 3
W_INT4_PTX = 4
W_INT4_OFFSETS_BITS = 5
W_INT4_OFFSETS_PTX = 6
WEIGHTS = (
    (FMT_MXFP4, DECODE_BITS, False),
    (FMT_MXFP4, DECODE_PTX, False),
    (FMT_MXFP4, DECODE_PTX_WIDE, False),
    (FMT_INT4, DECODE_BITS, False),
    (FMT_INT4, DECODE_PTX, False),
    (FMT_INT4, DECODE_BITS, True),
    (FMT_INT4, DECODE_PTX, True),
)

# The aligned kernels' PATH: where a row block's pairs and expert come from (stage1.row_tile_args)
PATH_ALIGNED = 0     # the alignment's sorted pairs and block experts (any expert map already applied)
PATH_DIRECT = 1      # path "direct": block b is pair b alone, its expert read from topk_ids
PATH_DIRECT_MAP = 2  # the same, the id taken through the expert map


class KOrder(str, Enum):
    """The K order in which an aligned (or direct) stage reads its activations and decodes its weights.
    The GEMV stages read word order of their own block_k whatever this says.

    A member is (its table name, its `code`: the aligned kernels' ORDER and OUT_ORDER, `stored_order`:
    the order it reads its activations from memory in, `pairs`: one dot per K step on the pair order).
    Everything else (kernels/triton/korder.py, table.py) is derived from these, so a new order is this
    member and its ORDER_ name below, its branches in matmul_kernels.py, and its tuning candidates."""

    # activations in word order of block_k tiles (K = 8c + j): eight dots per K step
    WORDS = "words", 0, "words", False
    # activations in plain order, weights regrouped in registers: two dots per K step
    INTERLEAVE = "interleave", 1, "interleave", False
    # activations and weights in pair order (decode.pair_order): one dot per K step
    PAIRS = "pairs", 2, "pairs", True
    # pairs, stage 1's gate and up rows stacked in one [2 x block_n] tile, one dot per K step (with 8
    # warps each warpgroup holds one of them: half the accumulator registers per thread)
    STACKED = "stacked", 3, "pairs", True
    # pairs, stage 2 with n_tiles > 1: inter is read in plain order (stage 1 stores it so) and each K
    # step is swapped into pair order in registers, once per program for all its tiles (stage 1's
    # epilogue then skips that swap)
    PLAIN_INTER = "plain-inter", 4, "interleave", True

    def __new__(cls, value: str, code: int, stored: str, pairs: bool):
        member = str.__new__(cls, value)
        member._value_ = value
        member.code, member._stored, member.pairs = code, stored, pairs
        return member

    @property
    def stored_order(self) -> KOrder:
        """WORDS (word order of the config's block_k tiles), PAIRS, or INTERLEAVE for the plain order."""
        return KOrder(self._stored)

    def misfit(self, block_k: int, n_tiles: int, stage: int | None = None) -> str | None:
        """Why a stage config of this order cannot run with these tiles (on stage 1 or 2 when `stage`
        is given), or None. Plain-inter needs no stage rule: n_tiles > 1 is stage 2's alone."""
        if self is KOrder.WORDS and block_k < 128:
            return "order 'words' needs block_k >= 128 (8 dots of block_k/8 >= 16)"
        if self is KOrder.PLAIN_INTER and n_tiles == 1:
            return "order 'plain-inter' needs n_tiles > 1 (the swap is done once per program)"
        if self is KOrder.STACKED and stage == 2:
            return "order 'stacked' is stage 1's (stage 2 has no gate and up rows)"
        return None


# the names the kernels compare ORDER and OUT_ORDER with (matmul_kernels.py)
ORDER_WORDS = KOrder.WORDS.code
ORDER_INTERLEAVE = KOrder.INTERLEAVE.code
ORDER_PAIRS = KOrder.PAIRS.code
ORDER_STACKED = KOrder.STACKED.code
ORDER_PLAIN_INTER = KOrder.PLAIN_INTER.code

# MXFP4 word layout (layout.py writes it, decode.py reads it): bit of the lowest magnitude bit and
# of the sign of element v0..v7. Pair j = (v2j, v2j+1) must end as two bf16 halves with the
# magnitude at bits 6-8 and the sign at 15; these positions get pairs 1 and 2 there with one shift
# and one mask, pairs 0 and 3 with two (4 tiles of {6,7,8,15} cannot partition 16 bits, so no
# layout does all four with one): 5 shifts and 6 logic ops per word of 8 weights.
MXFP4_MAG_BIT = (6, 22, 3, 19, 0, 16, 13, 29)
MXFP4_SIGN_BIT = (11, 27, 12, 28, 9, 25, 10, 26)
# DECODE_PTX multiplies the placed bits (2^-126 times the e2m1 value) by 2^(b-1) in one bf16x2
# multiply; that factor is a normal bf16 up to e8m0 byte 128 (scale 2, weights up to 12)
MXFP4_FOLD_MAX_SCALE = 128

ACT_SILU = 0
ACT_SITU = 1            # SiTUv2 with a linear beta
ACT_SITU_NO_LINEAR = 2  # SiTUv2 whose linear beta is unset: the up half passes unchanged

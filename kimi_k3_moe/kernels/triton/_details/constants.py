"""Integer codes for the kernels' constexpr switches (shared by launchers and kernels)."""

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

# kernels/triton/table.KOrder as the aligned kernels' ORDER and OUT_ORDER (kernels/triton/korder.py)
ORDER_WORDS = 0
ORDER_INTERLEAVE = 1
ORDER_PAIRS = 2
ORDER_STACKED = 3
ORDER_PLAIN_INTER = 4

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

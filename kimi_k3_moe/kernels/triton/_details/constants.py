"""Integer codes for the kernels' constexpr switches (shared by launchers and kernels)."""

FMT_MXFP4 = 0
FMT_INT4 = 1

DECODE_BITS = 0  # portable Triton integer/float ops, one element at a time
DECODE_PTX = 1   # inline PTX producing bf16 pairs (NVIDIA sm_80+)

ACT_SILU = 0
ACT_SITU = 1            # SiTUv2 with a linear beta
ACT_SITU_NO_LINEAR = 2  # SiTUv2 whose linear beta is unset: the up half passes unchanged

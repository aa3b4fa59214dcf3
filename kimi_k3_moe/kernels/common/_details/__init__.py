"""Triton kernels and device helpers both GPU backends use (importing these imports triton): the
alignment, the top-k sum, the casts, and the rules every Triton kernel shares (expert ids, PDL,
rounding)."""

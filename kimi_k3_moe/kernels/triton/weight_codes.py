"""A layer's weights and a config's decoder as the stage kernels' WEIGHTS constexpr (_details/constants.py):
one code per combination a kernel decodes, so a combination without one is refused here, before a launch."""
from __future__ import annotations

from kimi_k3_moe.experts import INT4, MXFP4
from kimi_k3_moe.kernels.triton._details import constants as C

DECODE_CODES = {"bits": C.DECODE_BITS, "ptx": C.DECODE_PTX}
FMT_CODES = {MXFP4: C.FMT_MXFP4, INT4: C.FMT_INT4}
DECODE_NAMES = {C.DECODE_BITS: "bits", C.DECODE_PTX: "ptx", C.DECODE_PTX_WIDE: "ptx-wide"}


def decode_code(decode: str, wide_scales: bool) -> int:
    """The kernels' decoder for a config's decoder name: "ptx" on MXFP4 weights with a scale above 2
    needs the two-multiply variant (TritonExperts.wide_scales)."""
    code = DECODE_CODES[decode]
    return C.DECODE_PTX_WIDE if code == C.DECODE_PTX and wide_scales else code


def weights_code(weight_format: str, decode: int, offsets: bool) -> int:
    """WEIGHTS for weights of format `weight_format` (experts.MXFP4 / INT4), the decoder `decode` (a DECODE_*
    code, decode_code) and whether they carry per-group offsets (int4 only)."""
    key = (FMT_CODES.get(weight_format), decode, bool(offsets))
    if key not in C.WEIGHTS:
        raise ValueError(f"no kernel decodes {weight_format!r} weights with decoder "
                         f"{DECODE_NAMES.get(decode, decode)!r} "
                         f"and offsets={bool(offsets)} (the wide PTX decoder is MXFP4's, offsets int4's)")
    return C.WEIGHTS.index(key)


def weights_of(code: int) -> tuple[str, int, bool]:
    """WEIGHTS code -> (format, decoder, offsets): weights_code's inverse."""
    fmt_code, decode, offsets = C.WEIGHTS[code]
    return next(name for name, c in FMT_CODES.items() if c == fmt_code), decode, offsets

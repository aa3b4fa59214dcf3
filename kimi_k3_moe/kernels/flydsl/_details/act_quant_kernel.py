"""The activation quantization kernel (gfx950): bf16 rows -> fp8 e4m3 or MXFP4 codes and an e8m0
byte per 32 elements, with layout.py's rounding rules, before stage 1 of a quantized forward.

Compiled for gfx950 on a CPU; never run on AMD hardware here.
"""

import flydsl.compiler as flyc
import flydsl.expr as fx

from kimi_k3_moe.kernels.flydsl import layout as L
from kimi_k3_moe.kernels.flydsl._details import device as D


def _quantize_one_group(act, rx, rq, rs, q):
    """Lane q: 32 bf16 values (64 bytes) -> codes (32 or 16 bytes) and one e8m0 byte."""
    x_off, q_off, s_off = L.quant_group_offsets(q, act)
    values = []
    for i in range(4):
        chunk = D.load_v4i32(rx, x_off + 16 * i)
        for j in range(4):
            word = fx.Int32(chunk[j])                                    # bf16 pair, element 2j low
            values += [D.FlyOps.f32(word << 16), D.FlyOps.f32((word >> 16) << 16)]
    codes, b = D.quantize_group(values, act)
    words = D.pack_codes(codes, act)
    for i in range(len(words) // 4):
        D.store(fx.Vector.from_elements(words[4 * i:4 * i + 4], fx.Int32), rq, q_off + 16 * i)
    D.store_u8(b, rs, s_off)


def build(qcfg):
    """The @flyc.jit launcher of the activation quantization kernel (config.QuantConfig).

    launcher(X, XQ, XS, num_groups[, stream]): X = bf16 [G*32], XQ = uint8 codes [G*32] (fp8)
    or [G*16] (fp4, packed), XS = uint8 e8m0 [G]; lane q quantizes group q (elements 32q..32q+31).
    """
    act, threads = qcfg.act_dtype, qcfg.threads
    code_bytes = 4 * L.ACT_CODE_BITS[act]          # per group of 32

    @flyc.kernel(name=qcfg.name, known_block_size=[threads, 1, 1])
    def k3quant(X: fx.Tensor, XQ: fx.Tensor, XS: fx.Tensor, num_groups: fx.Int32):
        q = fx.block_idx.x * threads + fx.thread_idx.x
        rx = D.rsrc(fx.get_iter(X), fx.Int64(num_groups) * 64)          # lanes past the end read 0 ...
        rq = D.rsrc(fx.get_iter(XQ), fx.Int64(num_groups) * code_bytes)  # ... and their stores drop
        rs = D.rsrc(fx.get_iter(XS), fx.Int64(num_groups))
        _quantize_one_group(act, rx, rq, rs, q)

    @flyc.jit
    def launch(X: fx.Tensor, XQ: fx.Tensor, XS: fx.Tensor, num_groups: fx.Int32,
               stream: fx.Stream = fx.Stream(None)):
        k3quant(X, XQ, XS, num_groups).launch(grid=((num_groups + (threads - 1)) // threads, 1, 1),
                                              block=(threads, 1, 1), stream=stream)

    launch.func.__name__ = qcfg.name
    return launch

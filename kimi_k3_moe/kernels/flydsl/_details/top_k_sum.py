"""Stage 2's own top-k sum (reduce "fused"), the device code the kernel body calls after its epilogue.

Deterministic without a launch of its own: every workgroup releases its stores, then counts one
arrival per row on its token's counter for this column tile; the workgroup whose count completes
a token (every slot of it on this rank) reads the token's slot rows back and writes its output,
summing them in slot order as the separate top-k sum kernel does. No workgroup waits for another.
The counters and each slot's local expert live in BOOK (layout.py); the alignment zeroes the
counters and the output rows.
"""

import flydsl.expr as fx
from flydsl.expr.typing import T

from kimi_k3_moe.kernels.flydsl import layout as L
from kimi_k3_moe.kernels.flydsl._details import device as D


def row_locals(cfg, BOOK, slots, tid):
    """(slot, local experts of its token's slots) of the workgroup's row `tid` (lanes tid < BM, wave 0:
    lane group g holds row 16g + r's slot in slots[g]). Issued before the release, whose wait for
    the stores then covers these loads too."""
    slot = slots[0]
    for mi in range(1, len(slots)):
        slot = ((tid >> 4) == mi).select(slots[mi], slot)
    token = L.slot_token(slot, cfg.shape.top_k)
    rbook = D.rsrc(fx.get_iter(BOOK))
    return slot, [D.load_i32(rbook, L.local_byte_offset(token * cfg.shape.top_k + j)) for j in range(cfg.shape.top_k)]


def arrive(cfg, BOOK, flags, tid, slot, local, num_tokens):
    """Count row `tid`'s arrival; in LDS, its token if this workgroup completes the token's tile (else
    -1), and the token's mask of slots on this rank."""
    k = cfg.shape.top_k
    token = L.slot_token(slot, k)
    mask, need = fx.Int32(0), fx.Int32(0)
    for j in range(k):
        here = (local[j] >= 0).select(fx.Int32(1), fx.Int32(0))
        mask, need = mask | (here << j), need + here
    old = D.count_arrival(BOOK, L.counter_byte_offset(token, fx.block_idx.y, num_tokens * k, cfg.shape.N // cfg.BN))
    last = (slot < num_tokens * k) & (old + 1 == need)
    fx.ptr_store(last.select(token, fx.Int32(-1)), fx.add_offset(flags, tid))
    fx.ptr_store(mask, fx.add_offset(flags, cfg.BM + tid))


def sum_token(cfg, Y, OUT, flags, i, token, tid, num_tokens):
    """Thread `tid`'s 4 columns of a completed token: its slot rows summed in slot order in fp32 (absent
    slots add 0, as in the separate kernel), in bf16 into OUT."""
    N, k = cfg.shape.N, cfg.shape.top_k
    col = fx.block_idx.y * cfg.BN + tid * 4
    mask = fx.Int32(fx.ptr_load(fx.add_offset(flags, cfg.BM + i), T.i32))
    rslots = D.rsrc(fx.get_iter(Y), fx.Int64(num_tokens) * (k * N * 2))
    acc = [fx.Float32(0.0)] * 4
    for j in range(k):
        here = ((mask >> j) & 1) != 0
        words = fx.Vector(D.load(rslots, L.slot_out_byte_offset(token * k + j, col, N), T.vec(2, T.i32)))
        values = D.bf16x4_f32([fx.Int32(words[0]), fx.Int32(words[1])])
        acc = [a + here.select(v, fx.Float32(0.0)) for a, v in zip(acc, values)]
    packed = fx.Vector.from_elements(acc, fx.Float32).to(fx.BFloat16).bitcast(fx.Int32)
    D.store(packed, D.rsrc(fx.get_iter(OUT), fx.Int64(num_tokens) * (N * 2)), L.out_byte_offset(token, col, N))

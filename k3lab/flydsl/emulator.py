"""CPU stand-in for running the FlyDSL MoE kernels: the same address logic, lane by lane.

`launch(cfg, args)` takes exactly the arguments of the FlyDSL launchers and
writes the output buffer the kernel would write. It walks the grid as the
kernels do (workgroup, wave, K iteration, MFMA step), computes every address
with the functions of `layout.py` that the kernels call at trace time (here on
torch int64 lane vectors), gathers those bytes from flat byte images of the
buffers with the hardware's buffer range check, decodes them with the kernels'
formulas and models of the conversion instructions, multiplies 16x16 tiles in
fp32 following AMD's documented MFMA lane layout, and stores through the same
output offsets. It also checks what hardware would not report: reads past a
tensor's end, accesses straddling a range limit, 32-bit offset overflow, LDS
writes that collide or leave holes.

What this stands on: the layout functions are shared with the kernels, so a
wrong index in them shows up here. What it cannot show: that FlyDSL/LLVM lower
the kernels as written, that the MFMA lane layout and the conversion
instructions behave as modelled on a real gfx942/gfx950 (`_mfma`,
`_cvt_scalef32_pk_bf16_fp4`, `_mfma_scale` below are models
from AMD's documentation, not measurements), or anything about timing. The
load-time self-check on the user's GPU covers those.

Quantized activations (gfx950): the quantization kernel and the stage-1 epilogue
run layout.py's own rounding functions (on torch tensors here); `_mfma_scale`
models the scaled MFMA from its documented operand ABI, written independently of
the kernels' load offsets, so a load that puts a value at the wrong k, or a scale
on the wrong block, shows up as a wrong product.
"""
from __future__ import annotations

import functools

import torch

from kimi_k3_moe.act_quant import FP4, FP8
from kimi_k3_moe.amd_archs import traits
from kimi_k3_moe.experts.format import INT4
from kimi_k3_moe.formats import fp8, mxfp4
from kimi_k3_moe.kernels.flydsl import layout as L
from kimi_k3_moe.kernels.flydsl.config import FlyKernelConfig, QuantConfig

NO_RANGE = 0xFFFFFFFF
I32_MAX = 2**31 - 1


class EmulatorError(AssertionError):
    """The kernel as written would read or write somewhere it must not."""


class _Buffer:
    """A flat byte image of a kernel argument behind one buffer descriptor."""

    def __init__(self, tensor: torch.Tensor, name: str, base: int = 0, records: int | None = None):
        self.bytes = tensor.view(torch.uint8).reshape(-1)   # shares storage: stores land in the tensor
        self.name = name
        self.base = base                                   # 64-bit pointer offset folded into the descriptor
        self.records = NO_RANGE if records is None else min(int(records), NO_RANGE)

    def _check(self, off: torch.Tensor, nbytes: int) -> torch.Tensor:
        off = off.long()
        if bool((off < 0).any()) or bool((off + nbytes > I32_MAX).any()):
            raise EmulatorError(f"{self.name}: 32-bit byte offset out of [0, 2^31): {off.min()}..{off.max()}")
        inside = off + nbytes <= self.records
        straddle = (off < self.records) & ~inside
        if bool(straddle.any()):
            raise EmulatorError(f"{self.name}: a {nbytes}-byte access straddles the range limit {self.records}")
        end = self.base + off[inside] + nbytes
        if end.numel() and int(end.max()) > self.bytes.numel():
            raise EmulatorError(f"{self.name}: access up to byte {int(end.max())} of a "
                                f"{self.bytes.numel()}-byte tensor")
        return inside

    def load(self, off: torch.Tensor, nbytes: int) -> torch.Tensor:
        """[L] byte offsets -> [L, nbytes] uint8; out-of-range lanes read zeros."""
        off = off.long().reshape(-1)
        inside = self._check(off, nbytes)
        idx = self.base + off[:, None] + torch.arange(nbytes)
        out = torch.zeros(off.numel(), nbytes, dtype=torch.uint8)
        out[inside] = self.bytes[idx[inside]]
        return out

    def store(self, off: torch.Tensor, data: torch.Tensor, same_value_ok: bool = False) -> None:
        """Out-of-range lanes are dropped, as the range check drops them. Two lanes storing to the
        same address is an error unless `same_value_ok` and they store the same bytes."""
        off = off.long().reshape(-1)
        nbytes = data.shape[1]
        inside = self._check(off, nbytes)
        uniq, first = torch.unique(off[inside], return_inverse=True)
        if uniq.numel() != int(inside.sum()):
            ref = torch.zeros(uniq.numel(), nbytes, dtype=data.dtype).index_copy_(0, first, data[inside])
            if not same_value_ok or not torch.equal(ref[first], data[inside]):
                raise EmulatorError(f"{self.name}: lanes of one store write the same address"
                                    + (" with different values" if same_value_ok else ""))
        idx = self.base + off[inside][:, None] + torch.arange(nbytes)
        self.bytes[idx.reshape(-1)] = data[inside].reshape(-1)

    def atomic_add_f32(self, off: torch.Tensor, values: torch.Tensor) -> None:
        off = off.long().reshape(-1)
        inside = self._check(off, 4)
        if bool((off[inside] % 4).any()):
            raise EmulatorError(f"{self.name}: misaligned fp32 atomic")
        f32 = self.bytes.view(torch.float32)
        f32.index_add_(0, (self.base + off[inside]) // 4, values.reshape(-1)[inside].float())

    def count_arrivals(self, off: torch.Tensor) -> torch.Tensor:
        """An int32 atomic +1 per lane, lane by lane (a global pointer: no range check on the GPU, so
        every address must lie in the tensor); the values before each add."""
        off = off.long().reshape(-1)
        if bool((~self._check(off, 4)).any()) or bool((off % 4).any()):
            raise EmulatorError(f"{self.name}: counter outside the tensor or misaligned")
        ints = self.bytes.view(torch.int32)
        old = torch.empty_like(off)
        for n, i in enumerate(((self.base + off) // 4).tolist()):
            old[n] = ints[i]
            ints[i] += 1
        return old


# --------------------------------------------------------------------- instruction models
def _words(b16: torch.Tensor) -> torch.Tensor:
    """[L, 16] bytes -> [L, 4] int32 dwords (little-endian)."""
    return b16.contiguous().view(torch.int32)


def _bf16(b16: torch.Tensor) -> torch.Tensor:
    """[L, 16] bytes -> [L, 8] bf16 values as fp32."""
    return b16.contiguous().view(torch.bfloat16).float()


def _e2m1(code: torch.Tensor) -> torch.Tensor:
    return L.e2m1_f32_bits(code.int()).view(torch.float32) * L.E2M1_BIAS_FIX


def _cvt_scalef32_pk_bf16_fp4(word: torch.Tensor, scale: torch.Tensor, sel: int) -> torch.Tensor:
    """v_cvt_scalef32_pk_bf16_fp4: byte `sel` -> (low nibble, high nibble) * scale, as bf16 [L, 2]."""
    byte = (word.long() & 0xFFFFFFFF) >> (8 * sel) & 255
    pair = torch.stack([_e2m1(byte & 15), _e2m1(byte >> 4)], dim=-1) * scale[:, None]
    return pair.to(torch.bfloat16).float()


def _dequant8(word: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4: [64] dwords + [64] e8m0 scales (as f32) -> [64, 8] bf16 weights as fp32 (element t = bits 4t..)."""
    return torch.cat([_cvt_scalef32_pk_bf16_fp4(word, scale, sel) for sel in range(4)], dim=1)


def _int4_decode8(word: torch.Tensor) -> torch.Tensor:
    """int4: [64] kernel-order dwords -> [64, 8] bf16 values q + 136 (as fp32), layout.int4_bf16_words."""
    words = torch.stack(L.int4_bf16_words(word.int()), dim=1).to(torch.int32).contiguous()
    return words.view(torch.bfloat16).float()           # little-endian: the low half is element 2i


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once, as v_fma_f32 / v_pk_fma_f32 (the fp32 product is exact in
    fp64; the fp64 sum then rounds to fp32: a double rounding that can differ from the fused
    result in the last bit on rare ties)."""
    return (a.double() * b.double() + c.double()).float()


def _mfma_issues(cfg: FlyKernelConfig, acc: torch.Tensor, a8: torch.Tensor, b8: torch.Tensor) -> torch.Tensor:
    """The kernels' D.mma on the arch's bf16 MFMA (amd_archs traits). A 16x16x32 tile: lane 16g+i
    gives A[i][8g+t] = a8[lane, t] and B[8g+t][i] = b8[lane, t]; 16x16xK takes K/4 of each lane's
    8 values per issue, so one 16x16x32 on gfx950 and on gfx942 two chained 16x16x16 issues
    (values t < 4, then t >= 4 of each lane), each adding its fp32 sum to the accumulator."""
    per = traits(cfg.arch).mfma_k // 4
    for h in range(8 // per):
        a = a8[:, per * h:per * h + per].reshape(4, 16, per).permute(1, 0, 2).reshape(16, 4 * per)
        b = b8[:, per * h:per * h + per].reshape(4, 16, per).permute(0, 2, 1).reshape(4 * per, 16)
        acc = acc + a @ b
    return acc


def _per_element(lane_values: torch.Tensor) -> torch.Tensor:
    """[64] per-lane scalars -> [16, 16]: at each D element the value of the lane holding it."""
    out = torch.empty(16, 16, dtype=lane_values.dtype)
    lane = torch.arange(L.LANES)
    g, r = L.lane_split(lane)
    for e in range(4):
        i, c = L.d_row_col(g, r, e)
        out[i, c] = lane_values
    return out


def _bf16_words(b8: torch.Tensor) -> torch.Tensor:
    """[64, 8] bytes holding 4 bf16 -> [64, 4] fp32."""
    return b8.contiguous().view(torch.bfloat16).float()


def _constant8(words) -> torch.Tensor:
    """A constant v8bf16 operand (the same in every lane) as [64, 8] fp32."""
    w = torch.tensor([x - (1 << 32) if x >= 1 << 31 else x for x in words], dtype=torch.int32)
    return w.view(torch.bfloat16).float().expand(L.LANES, 8)


def _int4_block(cfg, accs, rw, rs, ro, act, lds, w_rows, a_rows, kb, u, g, r, m_rep):
    """One K128 block of an int4 kernel, in the kernels' order (_details/workgroup._int4_block); with
    offsets, each tile's offset MFMA adds into its accumulator after the scaled sum."""
    K = cfg.shape.K
    words, scales, offsets = [], [], []
    for row in w_rows:
        words.append(_words(rw.load(L.w_byte_offset(row, kb, g, K), 16)))
        qi = L.int4_group_quad_index(row, kb, K)
        scales.append(_bf16_words(rs.load(qi * 2, 8)))
        offsets.append(_words(ro.load(qi * 2, 8)) if cfg.has_offsets else None)

    def load_x(mi, G):
        if cfg.tile.schedule.staged:
            lofs = L.lds_byte_offset(mi * L.MFMA_TILE + r, u * L.K_BLOCK + G * L.GROUP + g * 8, cfg.tile.kb_unroll)
            return _bf16(_lds_read(lds, lofs))
        return _bf16(act.load(L.int4_act_byte_offset(a_rows[mi], kb, G, g, K), 16))

    zero = torch.zeros(16, 16)
    neg_bias = _constant8(L.INT4_NEG_BIAS_WORDS)
    for G in range(4):
        w8s = [_int4_decode8(words[wi][:, G]) for wi in range(len(w_rows))]
        ss = [_per_element(scales[wi][:, G]) for wi in range(len(w_rows))]
        o8s = [_int4_offset8(offsets[wi], G) for wi in range(len(w_rows))] if cfg.has_offsets else None
        for mi in range(m_rep):
            x = load_x(mi, G)
            base = _mfma_issues(cfg, zero, x, neg_bias)                 # -136 sum x
            for wi in range(len(w_rows)):
                a = wi * m_rep + mi
                accs[a] = _fma(_mfma_issues(cfg, base, x, w8s[wi]), ss[wi], accs[a])
                if cfg.has_offsets:
                    accs[a] = _mfma_issues(cfg, accs[a], x, o8s[wi])


def _int4_offset8(pairs: torch.Tensor, G: int) -> torch.Tensor:
    """[64, 2] offset dwords -> [64, 8]: the bf16 offset of group G in every slot (layout.int4_offset_word)."""
    w = L.int4_offset_word(pairs[:, G >> 1].long(), G) & 0xFFFFFFFF
    w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)[:, None].expand(L.LANES, 4)
    return w.contiguous().view(torch.bfloat16).float()


class TorchOps:
    """layout.py's `ops` on torch tensors (int64 holding int32 bit patterns, float32 values)."""

    @staticmethod
    def select(cond, a, b):
        return torch.where(cond, torch.as_tensor(a), torch.as_tensor(b))

    @staticmethod
    def bits(x):
        return x.to(torch.float32).contiguous().view(torch.int32).long()

    @staticmethod
    def f32(i):
        i = torch.as_tensor(i).long() & 0xFFFFFFFF
        return torch.where(i >= 2**31, i - 2**32, i).to(torch.int32).view(torch.float32)


def _abi_k(weight_format: str, g: int) -> list[int]:
    """Logical k (0..127) of value v = 0..31 of a lane in group g, per the scaled MFMA's operand ABI:
    e2m1 32 consecutive k; e4m3 two runs of 16, 64 apart (AMD CDNA4 matrix-core guide, FlyDSL mxfp_moe)."""
    if weight_format == FP4:
        return [32 * g + v for v in range(32)]
    return [16 * g + v if v < 16 else 64 + 16 * g + (v - 16) for v in range(32)]


@functools.cache
def _abi_k_table(weight_format: str) -> torch.Tensor:
    """[64, 32]: logical k of each value of each lane."""
    return torch.tensor([_abi_k(weight_format, lane >> 4) for lane in range(L.LANES)])


def _operand_values(weight_format: str, regs: torch.Tensor) -> torch.Tensor:
    """[64, 16 | 32] register bytes -> [64, 32] element values (e2m1 low nibble first, or e4m3 bytes)."""
    if weight_format == FP4:
        return mxfp4.e2m1_table()[mxfp4.unpack_nibbles(regs).long()]
    return fp8.decode(regs)


def _mfma_scale(acc, a_regs, a_fmt, a_scale, b_regs, b_fmt, b_scale) -> torch.Tensor:
    """v_mfma_scale_f32_16x16x128_f8f6f4: D[i][j] += sum_k A[i][k] 2^(sa[i][k/32]-127) B[k][j] 2^(sb[j][k/32]-127).

    Lane 16g + r supplies row r of A (column r of B) at the ABI's k positions, and the e8m0
    byte of row r (column r) for k block g, whichever lane holds that block's values.
    """
    A = torch.zeros(16, 128, dtype=torch.float64)
    B = torch.zeros(128, 16, dtype=torch.float64)
    av, bv = _operand_values(a_fmt, a_regs).double(), _operand_values(b_fmt, b_regs).double()
    rows = (torch.arange(L.LANES) & 15)[:, None]
    A[rows, _abi_k_table(a_fmt)] = av
    B[_abi_k_table(b_fmt), rows] = bv
    sa = torch.exp2(a_scale.double() - 127).view(4, 16)          # [block, row]
    sb = torch.exp2(b_scale.double() - 127).view(4, 16)
    block = torch.arange(128) // 32
    A = A * sa[block].T
    B = B * sb[block]
    return acc + (A @ B).float()


def _lane_values(d: torch.Tensor, g: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """[64, 4]: the D elements a lane holds in accumulator registers e = 0..3."""
    e = torch.arange(4)
    i, c = L.d_row_col(g[:, None], r[:, None], e[None, :])
    return d[i, c]


def _activate(cfg: FlyKernelConfig, gate: torch.Tensor, up: torch.Tensor, beta: float, lin_beta: float):
    exp2, rcp = torch.exp2, torch.reciprocal
    if cfg.activation.name == "silu":
        return L.silu_mul(gate, up, exp2, rcp)
    if cfg.activation.betas == "const":
        lb = cfg.activation.linear_beta
        return L.situv2_mul(gate, up, cfg.activation.beta, L.tanh_coef(cfg.activation.beta), lb,
                            None if lb is None else L.tanh_coef(lb), exp2, rcp)
    b = torch.tensor(beta, dtype=torch.float32)
    lb = torch.tensor(lin_beta, dtype=torch.float32)
    two_log2e = torch.tensor(-2.0 * L.LOG2E, dtype=torch.float32)
    return L.situv2_mul(gate, up, b, two_log2e / b, lb, two_log2e / lb, exp2, rcp, select=torch.where)


# --------------------------------------------------------------------- the grid
def launch(cfg: FlyKernelConfig | QuantConfig, args: tuple, *, shuffle: torch.Generator | None = None) -> None:
    """Play one kernel launch on the CPU; writes the output buffer(s) (Y, and YS when quantized; OUT and
    BOOK's counters when stage 2 sums tokens) in place. Workgroups run one after another, in grid
    order or, with `shuffle`, in a random order (nothing may depend on which finishes first)."""
    _check_signature(cfg, args)
    if isinstance(cfg, QuantConfig):
        _launch_quant(cfg, args)
        return
    A, W, S, OFS, SID, BE, TW, Y = args[:8]
    AS, YS = args[8:10] if cfg.quantized else (None, None)
    OUT, BOOK = args[8:10] if cfg.sums_tokens else (None, None)
    num_tokens, num_rows, beta, lin_beta = args[-4:]
    if num_rows % cfg.BM:
        raise EmulatorError(f"num_rows {num_rows} is not a multiple of BM {cfg.BM}")
    R, K, N = cfg.weight_rows, cfg.shape.K, cfg.shape.N
    stage1 = cfg.stage == 1
    q = cfg.quantized
    row_bytes = L.qact_row_bytes(K, cfg.act_dtype) if q else K * 2
    sid = _Buffer(SID, "SID")
    if stage1:
        act = _Buffer(A, "X", records=num_tokens * row_bytes)
        act_s = _Buffer(AS, "XS", records=num_tokens * (K // L.GROUP)) if q else None
        out = _Buffer(Y, "INTER", records=num_rows * (L.qact_row_bytes(N, cfg.act_dtype) if q else N * 2))
        out = (out, _Buffer(YS, "INTER_S", records=num_rows * (N // L.GROUP))) if q else out
    else:
        act = _Buffer(A, "INTER", records=num_rows * row_bytes)
        act_s = _Buffer(AS, "INTER_S", records=num_rows * (K // L.GROUP)) if q else None
        tw = _Buffer(TW, "topk_weights", records=num_tokens * cfg.shape.top_k * 4)
        per_token = cfg.shape.top_k * N * 2 if cfg.slot_rows else N * 4
        out = _Buffer(Y, "SLOTS" if cfg.slot_rows else "ACC", records=num_tokens * per_token)
    act = (act, act_s)
    s_bytes = 2 if cfg.weight_format == INT4 else 1
    sentinel = num_tokens * cfg.shape.top_k
    grid = [(bid_m, bid_n, bid_k) for bid_m in range(num_rows // cfg.BM) if _live(cfg, int(BE[bid_m]))
            for bid_n in range(N // cfg.BN) for bid_k in range(cfg.reduction.split_k)]
    if shuffle is not None:
        grid = [grid[i] for i in torch.randperm(len(grid), generator=shuffle).tolist()]
    if cfg.sums_tokens:
        sums = (_Buffer(BOOK, "BOOK"), _Buffer(OUT, "OUT", records=num_tokens * N * 2))
    for bid_m, bid_n, bid_k in grid:
        expert = int(BE[bid_m])
        code_base = L.expert_code_base(expert, R, K)
        group_base = L.expert_group_base(expert, R, K)
        bufs = (_Buffer(W, "W", base=code_base), _Buffer(S, "S", base=group_base * s_bytes),
                _Buffer(OFS, "OFS", base=group_base * 2) if cfg.has_offsets else None)
        _workgroup(cfg, bid_m, bid_n, bid_k, act, sid, bufs, out, None if stage1 else tw, beta, lin_beta, sentinel)
        if cfg.sums_tokens:
            _arrive_and_sum(cfg, bid_m, bid_n, sid, out, *sums, num_tokens)


def _arrive_and_sum(cfg, bid_m, bid_n, sid, y, book, out, num_tokens):
    """_details/top_k_sum.arrive then sum_token: each row counts its arrival on its token's counter for this
    column tile; a token whose count completes here has its output written from its rows in memory."""
    k, BN, N = cfg.shape.top_k, cfg.BN, cfg.shape.N
    slots = _words(sid.load(L.sid_byte_offset(bid_m * cfg.BM + torch.arange(cfg.BM)), 4))[:, 0]
    token = L.slot_token(slots, k)
    local = torch.stack([_words(book.load(L.local_byte_offset(token * k + j), 4))[:, 0] for j in range(k)], 1)
    here = local >= 0
    old = book.count_arrivals(L.counter_byte_offset(token, bid_n, num_tokens * k, N // BN))
    last = (slots < num_tokens * k) & (old + 1 == here.sum(1))
    col = bid_n * BN + 4 * torch.arange(BN // 4)
    for i in torch.nonzero(last)[:, 0].tolist():
        t = int(token[i])
        acc = torch.zeros(BN // 4, 4)
        for j in range(k):
            v = _bf16(y.load(L.slot_out_byte_offset(t * k + j, col, N), 8)).float()
            acc = acc + torch.where(here[i, j], v, torch.zeros(()))
        out.store(L.out_byte_offset(t, col, N), acc.to(torch.bfloat16).contiguous().view(torch.uint8))


ARG_NAMES = ("A", "W", "S", "OFS", "SID", "BE", "TW", "Y", "num_tokens", "num_rows", "beta", "lin_beta")
QUANTIZED_ARG_NAMES = ARG_NAMES[:8] + ("AS", "YS") + ARG_NAMES[8:]
SUMMING_ARG_NAMES = ARG_NAMES[:8] + ("OUT", "BOOK") + ARG_NAMES[8:]
QUANT_ARG_NAMES = ("X", "XQ", "XS", "num_groups")


def _check_signature(cfg: FlyKernelConfig, args: tuple) -> None:
    """The compiled kernels are specialised on each tensor's dtype and rank (the placeholders
    they were compiled with): a launch passing anything else would not match on the GPU."""
    from kimi_k3_moe.kernels.flydsl.build import placeholder_args

    expected = placeholder_args(cfg)
    if len(args) != len(expected):
        raise EmulatorError(f"{cfg.name}: {len(args)} arguments, the launcher takes {len(expected)}")
    names = (QUANT_ARG_NAMES if isinstance(cfg, QuantConfig) else QUANTIZED_ARG_NAMES if cfg.quantized
             else SUMMING_ARG_NAMES if cfg.sums_tokens else ARG_NAMES)
    for name, got, want in zip(names, args, expected):
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.dim() != 1 \
                    or not got.is_contiguous():
                raise EmulatorError(f"{cfg.name}: argument {name} must be a contiguous 1-D {want.dtype} tensor, "
                                    f"got {getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))}")
        elif not isinstance(got, (int, float)) or isinstance(got, bool) or type(got) is not type(want):
            raise EmulatorError(f"{cfg.name}: argument {name} must be a Python {type(want).__name__}, got {got!r}")


def _live(cfg: FlyKernelConfig, expert: int) -> bool:
    """The kernels' block test: -1 marks an unused aligned block; a direct block computes only for an
    id in [0, num_experts)."""
    return 0 <= expert < cfg.rows.direct_experts if cfg.rows.direct else expert >= 0


def _row_slot(cfg: FlyKernelConfig, sid: _Buffer, p: torch.Tensor, sentinel: int) -> torch.Tensor:
    if cfg.rows.direct:
        return L.direct_row_slot(p, sentinel)
    return _words(sid.load(L.sid_byte_offset(p), 4))[:, 0]


def _workgroup(cfg, bid_m, bid_n, bid_k, act, sid, bufs, out, tw, beta, lin_beta, sentinel):
    rw, rs, ro = bufs
    act, act_s = act
    BM, BN, K, N, U, n_rep = cfg.BM, cfg.BN, cfg.shape.K, cfg.shape.N, cfg.tile.kb_unroll, cfg.tile.n_rep
    stage1 = cfg.stage == 1
    m_rep = BM // L.MFMA_TILE
    lane = torch.arange(L.LANES)
    g, r = L.lane_split(lane)
    waves = []
    for w in range(cfg.workgroup_waves):
        wave, wave_k = L.wave_split(w, cfg.tile.waves)
        p_rows = [L.tile_origin(bid_m, bid_n, wave, 0, mi, BM, BN, n_rep)[0] + r for mi in range(m_rep)]
        slots = [_row_slot(cfg, sid, p, sentinel) for p in p_rows]
        a_rows = [L.slot_token(s, cfg.shape.top_k) for s in slots] if stage1 else p_rows
        w_rows = []
        for ni in range(n_rep):
            n0 = L.tile_origin(bid_m, bid_n, wave, ni, 0, BM, BN, n_rep)[1]
            w_rows += [L.gate_up_row(n0 + r, gu, N) for gu in range(2)] if stage1 else [n0 + r]
        accs = [torch.zeros(16, 16) for _ in range(len(w_rows) * m_rep)]
        waves.append((wave, wave_k, p_rows, slots, a_rows, w_rows, accs))

    schedule = cfg.tile.schedule
    lds_plan = _lds_plan(cfg, bid_m, sid, sentinel) if schedule.staged else None
    image = None
    for it in range(cfg.k_iters):
        # a_lds workgroups have one K wave (config), so the staged tile is that wave's
        kb0 = L.k_block(bid_k, 0, it, 0, 1, cfg.k_iters, U)
        lds = None
        if schedule.double_buffered:
            # the kernel stores iteration it+1's tile while other waves may still read iteration it's:
            # played in that order (the next tile written first), a buffer overlap corrupts this one
            if it == 0:
                image = _stage_tile(cfg, act, lds_plan, kb0, image, 0)
            if it + 1 < cfg.k_iters:
                kb_next = L.k_block(bid_k, 0, it + 1, 0, 1, cfg.k_iters, U)
                image = _stage_tile(cfg, act, lds_plan, kb_next, image, it + 1)
            lds = (*image, L.lds_tile_byte_base(it, BM, U, schedule.lds_buffers))
        elif schedule.staged:
            lds = _stage_tile(cfg, act, lds_plan, kb0)
        for _wave, wave_k, _p_rows, _slots, a_rows, w_rows, accs in waves:
            kb0 = L.k_block(bid_k, wave_k, it, 0, cfg.tile.k_waves, cfg.k_iters, U)
            for u in range(U):
                kb = kb0 + u
                if cfg.quantized:
                    _scaled_block(cfg, accs, rw, rs, act, act_s, w_rows, a_rows, kb, g, m_rep)
                    continue
                if cfg.weight_format == INT4:
                    _int4_block(cfg, accs, rw, rs, ro, act, lds, w_rows, a_rows, kb, u, g, r, m_rep)
                    continue
                wq, sc = [], []
                for row in w_rows:
                    gi = L.group_index(row, kb, g, K)
                    wq.append(_words(rw.load(L.w_byte_offset(row, kb, g, K), 16)))
                    b = rs.load(gi, 1)[:, 0].int()
                    sc.append(L.e8m0_f32_bits(b).view(torch.float32))
                xs = []
                for mi in range(m_rep):
                    for j in range(4):
                        if cfg.tile.schedule.staged:
                            lofs = L.lds_byte_offset(mi * L.MFMA_TILE + r, u * L.K_BLOCK + g * L.GROUP + j * 8, U)
                            xs.append(_bf16(_lds_read(lds, lofs)))
                        else:
                            xs.append(_bf16(act.load(L.act_byte_offset(a_rows[mi], kb, g, j, K), 16)))
                for j in range(4):
                    for wi in range(len(w_rows)):
                        w8 = _dequant8(wq[wi][:, j], sc[wi])
                        for mi in range(m_rep):
                            accs[wi * m_rep + mi] = _mfma_issues(cfg, accs[wi * m_rep + mi], w8, xs[mi * 4 + j])

    joined = {(wave, wave_k): accs for wave, wave_k, _p_rows, _slots, _a_rows, _w_rows, accs in waves}
    summed = _reduce_k_waves(cfg, joined, g, r)
    for wave, wave_k, p_rows, slots, _a_rows, _w_rows, _accs in waves:
        if wave_k == 0:      # the first K wave stores
            _epilogue(cfg, wave, bid_m, bid_n, g, r, p_rows, slots, summed[wave], out, tw, beta, lin_beta,
                      sid, sentinel)


def _reduce_k_waves(cfg, partials, g, r):
    """{(wave_n, wave_k): accs} -> {wave_n: accs summed over K waves}. Every wave's partial tiles go
    through an LDS image at the kernel's offsets (checked: in range, no two writes on the same bytes,
    no read of unwritten bytes); the first K wave adds the others' in wave order, as the kernel does."""
    if cfg.tile.k_waves == 1:
        return {wave: accs for (wave, _), accs in partials.items()}
    lane = torch.arange(L.LANES)
    n = len(next(iter(partials.values())))
    words = cfg.workgroup_waves * n * L.LANES * 4
    lds = torch.full((words,), float("nan"))
    written = torch.zeros(words, dtype=torch.bool)
    e = torch.arange(4)
    rows, cols = L.d_row_col(g[:, None], r[:, None], e[None, :])

    def at(wave, wave_k, a):
        off = L.reduce_lds_byte_offset(wave_k, wave, a, lane, cfg.tile.waves, n)
        idx = (off >> 2)[:, None] + e
        if bool((off & 15).any()) or int(idx.min()) < 0 or int(idx.max()) >= words:
            raise EmulatorError("K-wave reduction: LDS offset misaligned or outside the partials")
        return idx

    for (wave, wave_k), accs in partials.items():
        for a, acc in enumerate(accs):
            idx = at(wave, wave_k, a)
            if bool(written[idx].any()):
                raise EmulatorError("K-wave reduction: two partials written to the same LDS bytes")
            written[idx] = True
            lds[idx] = _lane_values(acc, g, r)
    summed = {}
    for (wave, wave_k), accs in partials.items():
        if wave_k:
            continue
        out = []
        for a, total in enumerate(accs):
            for wk in range(1, cfg.tile.k_waves):
                idx = at(wave, wk, a)
                if not bool(written[idx].all()):
                    raise EmulatorError("K-wave reduction: read of LDS bytes no wave wrote")
                tile = torch.empty(16, 16)
                tile[rows, cols] = lds[idx]
                total = total + tile
            out.append(total)
        summed[wave] = out
    return summed


def _scaled_block(cfg, accs, rw, rs, act, act_s, w_rows, a_rows, kb, g, m_rep):
    """One K128 block of a quantized-activation kernel: one scaled MFMA per (weight, row) sub-tile."""
    K = cfg.shape.K
    xs, xsc = [], []
    for mi in range(m_rep):
        halves = (0,) if cfg.act_dtype == FP4 else (0, 1)
        xs.append(torch.cat([act.load(L.qact_byte_offset(a_rows[mi], kb, g, h, K, cfg.act_dtype), 16)
                             for h in halves], dim=1))
        xsc.append(act_s.load(L.act_scale_index(a_rows[mi], kb, g, K), 1)[:, 0])
    for wi, row in enumerate(w_rows):
        w16 = rw.load(L.w_byte_offset(row, kb, g, K), 16)
        wsc = rs.load(L.group_index(row, kb, g, K), 1)[:, 0]
        for mi in range(m_rep):
            a = wi * m_rep + mi
            accs[a] = _mfma_scale(accs[a], w16, FP4, wsc, xs[mi], cfg.act_dtype, xsc[mi])


def _quantize_rows(values: torch.Tensor, act_dtype: str, amax_bits: torch.Tensor | None = None):
    """[L, n] float32 -> ([L, n] int64 codes, [L] e8m0 bytes) with layout.py's rules."""
    if amax_bits is None:
        amax_bits = (TorchOps.bits(values) & 0x7FFFFFFF).amax(dim=1)
    b = L.e8m0_from_amax_bits(amax_bits, act_dtype, TorchOps)
    mult = TorchOps.f32(L.e8m0_reciprocal_bits(b))
    return L.minifloat_code(values * mult[:, None], act_dtype, TorchOps), b


def _pack(codes: torch.Tensor, act_dtype: str) -> torch.Tensor:
    """[L, n] codes -> [L, n or n/2] bytes, element 0 first (low nibble first for e2m1)."""
    if act_dtype == FP8:
        return (codes & 0xFF).to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def _launch_quant(qcfg: QuantConfig, args: tuple) -> None:
    X, XQ, XS, num_groups = args
    act = qcfg.act_dtype
    code_bytes = 4 * L.ACT_CODE_BITS[act]
    xb = _Buffer(X, "X", records=num_groups * 64)
    qb = _Buffer(XQ, "XQ", records=num_groups * code_bytes)
    sb = _Buffer(XS, "XS", records=num_groups)
    blocks = -(-num_groups // qcfg.threads)
    q = torch.arange(blocks * qcfg.threads)                 # every lane of the grid at once
    x_off, q_off, s_off = L.quant_group_offsets(q, act)
    raw = torch.cat([xb.load(x_off + 16 * i, 16) for i in range(4)], dim=1)   # [lanes, 64] bytes
    values = raw.view(torch.bfloat16).float()               # bf16 -> f32 is exact
    codes, b = _quantize_rows(values, act)
    packed = _pack(codes, act)
    for i in range(code_bytes // 16):
        qb.store(q_off + 16 * i, packed[:, 16 * i:16 * i + 16])
    sb.store(s_off, b.to(torch.uint8)[:, None])


def _lds_plan(cfg, bid_m, sid, sentinel):
    tid = torch.arange(cfg.threads)
    plan = []
    for c0 in range(0, cfg.BM * 16 * cfg.tile.kb_unroll, cfg.threads):
        row, cc = L.lds_chunk_coords(tid + c0, cfg.tile.kb_unroll)
        p = bid_m * cfg.BM + row
        a_row = L.slot_token(_row_slot(cfg, sid, p, sentinel), cfg.shape.top_k) if cfg.stage == 1 else p
        plan.append((a_row, row, cc))
    return plan


def _stage_tile(cfg, act, plan, kb0, image=None, it=0):
    """The cooperative copy into LDS, into the buffer iteration `it` reads (the kernel's offsets);
    unwritten bytes hold a poison pattern. `image`: the (bytes, written) of earlier rounds (a double
    buffer keeps the other buffer's tile)."""
    U, buffers = cfg.tile.kb_unroll, cfg.tile.schedule.lds_buffers
    if image is None:
        lds = torch.full((cfg.BM * L.lds_row_bytes(U) * buffers,), 0x7F, dtype=torch.uint8)
        written = torch.zeros_like(lds, dtype=torch.bool)
    else:
        lds, written = image
    base = L.lds_tile_byte_base(it, cfg.BM, U, buffers)
    this_round = torch.zeros_like(written)
    for a_row, row, cc in plan:
        data = act.load(L.staged_act_byte_offset(a_row, kb0, cc, cfg.shape.K), 16)
        word = (base + L.lds_byte_offset(row, cc * 8, U)) >> 2
        idx = (word * 4)[:, None] + torch.arange(16)
        if int(idx.max()) >= lds.numel():
            raise EmulatorError("LDS write past the staged tile")
        if bool(this_round[idx].any()) or idx.reshape(-1).unique().numel() != idx.numel():
            raise EmulatorError("two LDS writes of one staging round hit the same bytes")
        this_round[idx] = True
        lds[idx.reshape(-1)] = data.reshape(-1)
    return lds, written | this_round


def _lds_read(lds_state, lofs):
    """lds_state: (bytes, written[, base of the buffer read])."""
    lds, written, *base = lds_state
    lofs = lofs + (base[0] if base else 0)
    if bool((lofs & 3).any()):
        raise EmulatorError("misaligned LDS read")
    idx = ((lofs >> 2) * 4)[:, None] + torch.arange(16)
    if int(idx.max()) >= lds.numel() or not bool(written[idx].all()):
        raise EmulatorError("LDS read of bytes no thread staged")
    return lds[idx]


def _epilogue_quantized(cfg, wave, bid_m, bid_n, g, r, p_rows, accs, out, beta, lin_beta):
    m_rep = cfg.BM // L.MFMA_TILE
    N, act = cfg.shape.N, cfg.act_dtype
    out, out_s = out
    lane = torch.arange(L.LANES)
    for c in range(cfg.tile.n_rep // 2):
        pair = (2 * c, 2 * c + 1)
        n0s = [L.tile_origin(bid_m, bid_n, wave, ni, 0, cfg.BM, cfg.BN, cfg.tile.n_rep)[1] for ni in pair]
        for mi in range(m_rep):
            ys = torch.cat([_activate(cfg, _lane_values(accs[(ni * 2 + 0) * m_rep + mi], g, r),
                                      _lane_values(accs[(ni * 2 + 1) * m_rep + mi], g, r), beta, lin_beta)
                            for ni in pair], dim=1)                                  # [64, 8] fp32
            amax = (TorchOps.bits(ys) & 0x7FFFFFFF).amax(dim=1)
            for partner in L.amax_partner_lanes(lane):                            # ds_bpermute steps
                amax = torch.maximum(amax, amax[partner])
            codes, b = _quantize_rows(ys, act, amax)
            for j, n0 in enumerate(n0s):
                out.store(L.qinter_byte_offset(p_rows[mi], n0 + g * 4, N, act), _pack(codes[:, 4 * j:4 * j + 4], act))
            out_s.store(L.qinter_scale_offset(p_rows[mi], n0s[0], N), b.to(torch.uint8)[:, None],
                        same_value_ok=True)


def _epilogue_int4(cfg, wave, bid_m, bid_n, g, r, accs, out, tw, sid, beta, lin_beta, sentinel):
    """_details/epilogues._epilogue_int4: register e of lane (g, r) is OUT[m0 + 4g + e][n0 + r]."""
    m_rep = cfg.BM // L.MFMA_TILE
    N = cfg.shape.N
    coords = [L.int4_out_coords(g, r, e) for e in range(4)]
    for mi in range(m_rep):
        p0 = L.tile_origin(bid_m, bid_n, wave, 0, mi, cfg.BM, cfg.BN, cfg.tile.n_rep)[0]
        rows = [p0 + dm for dm, _ in coords]
        if cfg.stage == 2:
            slots = [_row_slot(cfg, sid, p, sentinel) for p in rows]
            weights = [tw.load(L.router_weight_byte_offset(s), 4).contiguous().view(torch.float32)[:, 0]
                       for s in slots]
        for ni in range(cfg.tile.n_rep):
            n0 = L.tile_origin(bid_m, bid_n, wave, ni, 0, cfg.BM, cfg.BN, cfg.tile.n_rep)[1]
            if cfg.stage == 1:
                gate = _lane_values(accs[(ni * 2 + 0) * m_rep + mi], g, r)
                up = _lane_values(accs[(ni * 2 + 1) * m_rep + mi], g, r)
                y = _activate(cfg, gate, up, beta, lin_beta).to(torch.bfloat16)
                for e in range(4):
                    out.store(L.inter_byte_offset(rows[e], n0 + coords[e][1], N),
                              y[:, e:e + 1].contiguous().view(torch.uint8))
                continue
            acc = _lane_values(accs[ni * m_rep + mi], g, r)
            for e in range(4):
                y = acc[:, e] * weights[e]
                n_col = n0 + coords[e][1]
                if cfg.slot_rows:
                    out.store(L.slot_out_byte_offset(slots[e], n_col, N),
                              y.to(torch.bfloat16)[:, None].contiguous().view(torch.uint8))
                else:
                    out.atomic_add_f32(L.acc_byte_offset(L.slot_token(slots[e], cfg.shape.top_k), n_col, N), y)


def _epilogue(cfg, wave, bid_m, bid_n, g, r, p_rows, slots, accs, out, tw, beta, lin_beta, sid=None, sentinel=0):
    m_rep = cfg.BM // L.MFMA_TILE
    N = cfg.shape.N
    if cfg.weight_format == INT4:
        _epilogue_int4(cfg, wave, bid_m, bid_n, g, r, accs, out, tw, sid, beta, lin_beta, sentinel)
        return
    if cfg.stage == 1 and cfg.quantized:
        _epilogue_quantized(cfg, wave, bid_m, bid_n, g, r, p_rows, accs, out, beta, lin_beta)
        return
    if cfg.stage == 1:
        for ni in range(cfg.tile.n_rep):
            n0 = L.tile_origin(bid_m, bid_n, wave, ni, 0, cfg.BM, cfg.BN, cfg.tile.n_rep)[1]
            for mi in range(m_rep):
                gate = _lane_values(accs[(ni * 2 + 0) * m_rep + mi], g, r)
                up = _lane_values(accs[(ni * 2 + 1) * m_rep + mi], g, r)
                y = _activate(cfg, gate, up, beta, lin_beta).to(torch.bfloat16)
                out.store(L.inter_byte_offset(p_rows[mi], n0 + g * 4, N), y.contiguous().view(torch.uint8))
        return
    weights = [tw.load(L.router_weight_byte_offset(s), 4).contiguous().view(torch.float32)[:, 0] for s in slots]
    for ni in range(cfg.tile.n_rep):
        n0 = L.tile_origin(bid_m, bid_n, wave, ni, 0, cfg.BM, cfg.BN, cfg.tile.n_rep)[1]
        for mi in range(m_rep):
            y = _lane_values(accs[ni * m_rep + mi], g, r) * weights[mi][:, None]
            if cfg.slot_rows:
                out.store(L.slot_out_byte_offset(slots[mi], n0 + g * 4, N),
                          y.to(torch.bfloat16).contiguous().view(torch.uint8))
            else:
                token = L.slot_token(slots[mi], cfg.shape.top_k)
                for e in range(4):
                    out.atomic_add_f32(L.acc_byte_offset(token, n0 + g * 4 + e, N), y[:, e])

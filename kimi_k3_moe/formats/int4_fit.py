"""Error-minimising int4 scales (and offsets) for MXFP4 groups, chosen exactly.

An MXFP4 group is 32 e2m1 values times 2^E. With 2^E divided out, every
element is one of 15 values (-6 ... 6), so a group is fully described by E
and a 15-bin histogram: how many of its elements hold each value. A bf16
scale t (and offset u) fitted to the normalised group becomes s = t * 2^E
(o = u * 2^E) without rounding, and the squared error scales by 4^E. Hence:

- a candidate's squared error on a group is the dot product of the group's
  histogram with the candidate's per-value squared errors: one float64
  matmul per class of groups scores all its candidates, and the sums are exact
  (every term is a multiple of 2^-28 below 2^15, see `_check_exact_grid`);
- useful candidates depend only on the group's extreme values (its class),
  so each class gets one table, built once, shared by all its groups;
- the candidate the published amax/7 recipe would pick is row 0 of every
  symmetric table, so a search never does worse than amax/7 on any group.

Symmetric fit ("search"): value = q * t, q in [-8, 7] (two's-complement
nibbles decode -8 too), t of either sign: a negative scale puts the -8 code
on the group's positive side. Candidates: amax/7, +-bf16(m / d) over a fine
grid of divisors d (m = the group's largest magnitude), +-powers of two
(on which many MXFP4 groups convert exactly).

Asymmetric fit ("asym"): value = q * t + u, t > 0, u a bf16 offset on a
2^-14 grid (so q * t + u is exact in fp32 and a kernel's fused multiply-add
gives the same bits). Candidates: the symmetric fit (u = 0), windows of 15
steps placed over [lo, hi] with shrinking widths and several alignments,
power-of-two steps aligned on lo or hi, then a few least-squares refinements of
(t, u) per group, each kept only where it lowers the exact error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kimi_k3_moe.formats import mxfp4

GROUP = 32
CODE_MIN, CODE_MAX = -8, 7
AMAX_DIVISOR = 7
# The 15 values of a normalised MXFP4 group, ascending (+0 and -0 share a bin).
BIN_VALUES = tuple(sorted({s * m for m in mxfp4.E2M1_MAGNITUDES for s in (1.0, -1.0)}))
NUM_BINS = len(BIN_VALUES)
ZERO_BIN = BIN_VALUES.index(0.0)
# e2m1 code (0..15) -> bin: codes 0..7 are +magnitudes, 8..15 the same magnitudes negated.
CODE_BIN = tuple(ZERO_BIN + c if c < 8 else ZERO_BIN - (c - 8) for c in range(16))

# Symmetric candidates: t = +-bf16(m / d). d = 7 is amax/7 with the -8 code
# free; d near 6 puts m on a power-of-two-like grid; d > 8 clips the largest
# element, which pays when the rest fit a finer grid. On MXFP4-quantised
# Gaussian, Student-t and Laplace weights, exhaustive searches over every
# bf16 scale in [m/16, m/4] pick d in [5.9, 8.8]; this grid comes within
# 0.15 points of their error reduction (docs/FORMATS.md, Fidelity).
SYM_DIVISORS = tuple(5.875 + k / 8 for k in range(26))
POW2_EXPONENTS = tuple(range(-5, 2))  # 2^-5 .. 2^1, kept where within [m/16, m/4]
# Asymmetric candidates: 15 steps spanning r/d of the range r = hi - lo, the
# window's low end at lo + alpha * (r - 15 t).
ASYM_DIVISORS = (15.0, 15.5, 16.0, 16.5, 17.0, 18.0, 19.0, 20.0, 22.0)
ASYM_ALIGNS = (0.0, 0.25, 0.5, 0.75, 1.0)
ASYM_POW2_STEPS = (0.25, 0.5, 1.0, 2.0)
LLOYD_ROUNDS = 2  # a third round gains < 0.05 points (measured)
OFFSET_GRID = 2.0 ** -14
# Normalised scales and offsets stay inside these bounds, which keeps every
# product and sum exact (see `_check_exact_grid`) ...
T_MIN, T_MAX, U_MAX = 2.0 ** -6, 4.0, 16.0
# ... and groups whose exponent E would push s = t*2^E or o = u*2^E out of
# bf16's normal range are converted with amax/7 by the element-wise path.
SAFE_SCALE_BYTES = (40, 200)  # e8m0 bytes b with E = b - 127 in [-87, 73]
# Scoring many groups against a class's table is done in blocks, so the
# [groups, candidates] float64 scores never exceed this many entries.
_SCORE_BLOCK = 1 << 21


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float64)


def _snap_offset(u: torch.Tensor) -> torch.Tensor:
    return _bf16(torch.round(u / OFFSET_GRID) * OFFSET_GRID)


@dataclass
class Tables:
    """Per-class candidate tables, padded to a common width with row 0."""

    t: torch.Tensor    # float64 [classes, C] normalised scales
    u: torch.Tensor    # float64 [classes, C] normalised offsets (zeros when symmetric)
    q: torch.Tensor    # int8 [classes, C, 15] the code each value maps to
    se: torch.Tensor   # float64 [classes, C, 15] squared error of each value

    def to(self, device) -> Tables:
        return Tables(*(x.to(device) for x in (self.t, self.u, self.q, self.se)))


def _table_rows(t: list[float], u: list[float], lo: list[int], hi: list[int]):
    """Codes and squared errors of candidates (t, u) with code range [lo, hi]."""
    values = torch.tensor(BIN_VALUES, dtype=torch.float64)
    tt = torch.tensor(t, dtype=torch.float64).unsqueeze(1)
    uu = torch.tensor(u, dtype=torch.float64).unsqueeze(1)
    safe = torch.where(tt != 0, tt, torch.ones_like(tt))
    # fp32 division, as the element-wise amax recipe does it, so row 0 matches it bit for bit.
    ratio = ((values - uu).float() / safe.float()).double()
    q = torch.where(tt != 0, torch.round(ratio), torch.zeros_like(ratio))
    q = torch.maximum(torch.minimum(q, torch.tensor(hi, dtype=torch.float64).unsqueeze(1)),
                      torch.tensor(lo, dtype=torch.float64).unsqueeze(1))
    se = (values - (q * tt + uu)) ** 2
    return q.to(torch.int8), se


def _pad(rows: list[tuple[float, float, int, int]], width: int) -> list[tuple[float, float, int, int]]:
    return rows + [rows[0]] * (width - len(rows))


def _symmetric_rows(m: float) -> list[tuple[float, float, int, int]]:
    """(t, u, code_lo, code_hi) candidates for groups whose largest magnitude is m."""
    if m == 0:
        return [(0.0, 0.0, 0, 0)]
    m32 = torch.tensor(m, dtype=torch.float32)
    rows = [(float(_bf16(m32 / AMAX_DIVISOR)), 0.0, -AMAX_DIVISOR, AMAX_DIVISOR)]
    seen = set()
    scales = [float(_bf16(m32 / d)) for d in SYM_DIVISORS]
    scales += [2.0 ** k for k in POW2_EXPONENTS if m / 16 <= 2.0 ** k <= m / 4]
    for t in scales:
        for signed in (t, -t):
            if signed not in seen:
                seen.add(signed)
                rows.append((signed, 0.0, CODE_MIN, CODE_MAX))
    return rows


def _asymmetric_rows(lo: float, hi: float) -> list[tuple[float, float, int, int]]:
    r = hi - lo
    if r == 0:  # one value: the offset alone carries it
        return [(0.0, float(_snap_offset(torch.tensor(lo, dtype=torch.float64))), 0, 0)]
    rows, seen = [], set()

    def add(t: float, low: float) -> None:
        u = float(_snap_offset(torch.tensor(low + 8 * t, dtype=torch.float64)))
        if T_MIN <= t <= T_MAX and abs(u) <= U_MAX and (t, u) not in seen:
            seen.add((t, u))
            rows.append((t, u, CODE_MIN, CODE_MAX))

    for d in ASYM_DIVISORS:
        t = float(_bf16(torch.tensor(r / d, dtype=torch.float64)))
        for alpha in ASYM_ALIGNS:
            add(t, lo + alpha * (r - 15 * t))
    for t in ASYM_POW2_STEPS:
        if 15 * t >= r / 2:
            add(t, lo)
            add(t, hi - 15 * t)
    return rows


def _build(rows_per_class: list[list[tuple[float, float, int, int]]]) -> Tables:
    width = max(len(rows) for rows in rows_per_class)
    ts, us, qs, ses = [], [], [], []
    for rows in rows_per_class:
        rows = _pad(rows, width)
        t, u, lo, hi = (list(col) for col in zip(*rows))
        q, se = _table_rows(t, u, lo, hi)
        ts.append(torch.tensor(t, dtype=torch.float64))
        us.append(torch.tensor(u, dtype=torch.float64))
        qs.append(q)
        ses.append(se)
    tables = Tables(torch.stack(ts), torch.stack(us), torch.stack(qs), torch.stack(ses))
    _check_exact_grid(tables)
    return tables


def _check_exact_grid(tables: Tables) -> None:
    # Every squared error is a multiple of 2^-28 below 2^10; 32 of them sum
    # below 2^15: 43 significant bits, exact in float64 in any order.
    scaled = tables.se * 2.0 ** 28
    if not (torch.equal(scaled, torch.round(scaled)) and float(tables.se.max()) < 2.0 ** 10):
        raise AssertionError("int4 candidate table left the exact float64 grid")


_TABLES: dict[tuple[str, str], Tables] = {}


def symmetric_tables(device: torch.device | str = "cpu") -> Tables:
    """Class k = index of the group's largest magnitude in E2M1_MAGNITUDES (0..7)."""
    key = ("sym", str(device))
    if key not in _TABLES:
        host = _TABLES.get(("sym", "cpu")) or _build([_symmetric_rows(m) for m in mxfp4.E2M1_MAGNITUDES])
        _TABLES[("sym", "cpu")] = host
        _TABLES[key] = host.to(device)
    return _TABLES[key]


def asymmetric_tables(device: torch.device | str = "cpu") -> Tables:
    """Class lo * 15 + hi: the bins of the group's smallest and largest values."""
    key = ("asym", str(device))
    if key not in _TABLES:
        host = _TABLES.get(("asym", "cpu"))
        if host is None:
            rows = [_asymmetric_rows(BIN_VALUES[a], BIN_VALUES[b]) if a <= b else [(0.0, 0.0, 0, 0)]
                    for a in range(NUM_BINS) for b in range(NUM_BINS)]
            host = _TABLES[("asym", "cpu")] = _build(rows)
        _TABLES[key] = host.to(device)
    return _TABLES[key]


_LUTS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _byte_luts(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte -> its two codes' bins as 8-bit counters in two int64 words."""
    key = str(device)
    if key not in _LUTS:
        words = torch.zeros(2, 256, dtype=torch.int64)
        for byte in range(256):
            for code in (byte & 15, byte >> 4):
                b = CODE_BIN[code]
                words[b // 8, byte] += 1 << (8 * (b % 8))
        _LUTS[key] = (words[0].to(device), words[1].to(device))
    return _LUTS[key]


def histograms(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [G, 16] packed groups -> float64 [G, 15] counts per value bin.

    Each byte looks up its two codes as counters in 8-bit fields of two
    int64 words; summing a group's 16 words cannot carry (counts <= 32).
    """
    low_word, high_word = _byte_luts(packed.device)
    index = packed.long()
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * 8
    low = low_word[index].sum(-1, keepdim=True)
    high = high_word[index].sum(-1, keepdim=True)
    del index
    counts = torch.cat([(low >> shifts) & 255, ((high >> shifts) & 255)[:, : NUM_BINS - 8]], dim=1)
    return counts.to(torch.float64)


def extreme_bins(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bins of each group's smallest and largest value."""
    present = counts > 0
    rank = torch.arange(1, NUM_BINS + 1, device=counts.device)
    # Distinct weights make each argmax unique, whatever a device does with ties.
    lo = (present * rank.flip(0)).argmax(dim=1)
    hi = (present * rank).argmax(dim=1)
    return lo, hi


def _magnitude_class(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    # bin -> index of |value| in E2M1_MAGNITUDES
    to_mag = torch.tensor([mxfp4.E2M1_MAGNITUDES.index(abs(v)) for v in BIN_VALUES],
                          device=lo.device)
    return torch.maximum(to_mag[lo], to_mag[hi])


def best_by_class(counts: torch.Tensor, cls: torch.Tensor, se: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact float64 error, candidate index) of each group's best row of its class's table.

    `counts` is float64 [G, 15]. Groups are sorted by class so each class is
    one matmul; ties go to the lowest row (row 0 is the amax/7 candidate in
    symmetric tables).
    """
    order = torch.sort(cls.to(torch.int32), stable=True).indices
    ordered = counts.index_select(0, order)
    sizes = torch.bincount(cls, minlength=se.shape[0]).tolist()
    se_t = se.transpose(1, 2)
    err = torch.empty(counts.shape[0], dtype=torch.float64, device=counts.device)
    idx = torch.empty(counts.shape[0], dtype=torch.int64, device=counts.device)
    block = max(1, _SCORE_BLOCK // se.shape[1])
    start = 0
    for k, size in enumerate(sizes):
        for a in range(start, start + size, block):
            b = min(start + size, a + block)
            # min returns the first index among equal values
            torch.min(ordered[a:b] @ se_t[k], dim=1, out=(err[a:b], idx[a:b]))
        start += size
    del ordered
    best_err = torch.empty_like(err).index_put_((order,), err)
    best_idx = torch.empty_like(idx).index_put_((order,), idx)
    return best_err, best_idx


@dataclass
class GroupFit:
    """Per group: normalised scale t, offset u (None if symmetric), codes per bin, exact error."""

    t: torch.Tensor              # float64 [G]
    u: torch.Tensor | None       # float64 [G]
    q: torch.Tensor              # int8 [G, 15]
    err: torch.Tensor            # float64 [G], in units of 4^E


def fit_symmetric(counts: torch.Tensor) -> GroupFit:
    """`counts`: float64 [G, 15] histograms (see `histograms`)."""
    tables = symmetric_tables(counts.device)
    lo, hi = extreme_bins(counts)
    cls = _magnitude_class(lo, hi)
    err, idx = best_by_class(counts, cls, tables.se)
    return GroupFit(tables.t[cls, idx], None, tables.q[cls, idx], err)


_VALUES: dict[str, torch.Tensor] = {}


def _bin_values(device) -> torch.Tensor:
    key = str(device)
    if key not in _VALUES:
        _VALUES[key] = torch.tensor(BIN_VALUES, dtype=torch.float64, device=device)
    return _VALUES[key]


def _refine(counts: torch.Tensor, t: torch.Tensor, u: torch.Tensor, q: torch.Tensor, err: torch.Tensor):
    """Least-squares (t, u) for the current codes, rounded to the format; kept where exactly better."""
    values = _bin_values(counts.device)
    sv = (counts * values).sum(1)
    for _ in range(LLOYD_ROUNDS):
        cq = counts * q
        sq, sqq, sqv = cq.sum(1), (cq * q).sum(1), (cq * values).sum(1)
        del cq
        det = GROUP * sqq - sq * sq  # every group has 32 elements
        t_new = _bf16((GROUP * sqv - sq * sv) / torch.where(det > 0, det, torch.ones_like(det)))
        u_new = _snap_offset((sv - t_new * sq) / GROUP)
        valid = (det > 0) & (t_new >= T_MIN) & (t_new <= T_MAX) & (u_new.abs() <= U_MAX)
        t_new = torch.where(valid, t_new, torch.ones_like(t_new))  # placeholders, never kept
        u_new = torch.where(valid, u_new, torch.zeros_like(u_new))
        q_new = torch.round((values - u_new.unsqueeze(1)) / t_new.unsqueeze(1)).clamp_(CODE_MIN, CODE_MAX)
        err_new = (counts * (values - (q_new * t_new.unsqueeze(1) + u_new.unsqueeze(1))).square_()).sum(1)
        better = valid & (err_new < err)
        t, u, err = torch.where(better, t_new, t), torch.where(better, u_new, u), torch.where(better, err_new, err)
        q = torch.where(better.unsqueeze(1), q_new, q)
        del q_new, err_new
    return t, u, q, err


def fit_asymmetric(counts: torch.Tensor, symmetric: GroupFit | None = None) -> GroupFit:
    """Best of the symmetric fit, the class's asymmetric table, and least-squares refinements."""
    sym = symmetric if symmetric is not None else fit_symmetric(counts)
    tables = asymmetric_tables(counts.device)
    lo, hi = extreme_bins(counts)
    cls = lo * NUM_BINS + hi
    err, idx = best_by_class(counts, cls, tables.se)
    t, u, q = tables.t[cls, idx], tables.u[cls, idx], tables.q[cls, idx].to(torch.float64)
    del idx
    t, u, q, err = _refine(counts, t, u, q, err)
    use_sym = sym.err <= err  # ties keep the symmetric fit: no offset is simpler
    return GroupFit(
        torch.where(use_sym, sym.t, t),
        torch.where(use_sym, torch.zeros_like(u), u),
        torch.where(use_sym.unsqueeze(1), sym.q, q.to(torch.int8)),
        torch.where(use_sym, sym.err, err),
    )


_BIN_OF_NIBBLE: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def _nibble_bins(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte -> bin of its low code, and of its high code."""
    key = str(device)
    if key not in _BIN_OF_NIBBLE:
        byte = torch.arange(256)
        code_bin = torch.tensor(CODE_BIN, dtype=torch.int64)
        _BIN_OF_NIBBLE[key] = (code_bin[byte & 15].to(device), code_bin[byte >> 4].to(device))
    return _BIN_OF_NIBBLE[key]


def encode(packed: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes [G, 16] and per-group codes per bin [G, 15] -> int4 bytes [G, 16]."""
    low_bin, high_bin = _nibble_bins(packed.device)
    nibbles = (q.to(torch.int16) & 0x0F).to(torch.uint8)
    index = packed.long()
    low = torch.gather(nibbles, 1, low_bin[index])
    high = torch.gather(nibbles, 1, high_bin[index])
    return low | (high << 4)


def exponent_scale(x: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """Normalised x * 2^(b - 127) as bf16; exact for groups in SAFE_SCALE_BYTES.

    2^E is built from its bits (E + 127 in the exponent field), not with pow,
    so every device computes the same product.
    """
    lo, hi = SAFE_SCALE_BYTES
    biased = scale_bytes.to(torch.int32).clamp(lo, hi)  # others are replaced by the amax fallback
    pow2 = (biased << 23).view(torch.float32)
    return (x.to(torch.float32) * pow2).to(torch.bfloat16)


def safe_groups(scale_bytes: torch.Tensor) -> torch.Tensor:
    lo, hi = SAFE_SCALE_BYTES
    return (scale_bytes >= lo) & (scale_bytes <= hi)


def describe_candidates() -> str:
    sym, asym = symmetric_tables(), asymmetric_tables()
    return (f"symmetric: {sym.t.shape[1]} candidates per class; asymmetric: {asym.t.shape[1]} per "
            f"class + {LLOYD_ROUNDS} least-squares rounds; exact float64 scoring")


assert math.isclose(BIN_VALUES[ZERO_BIN], 0.0) and NUM_BINS == 15

"""Token alignment on the GPU: group (token, slot) pairs by local expert into
blocks of BLOCK_M rows, padding each expert's rows to a multiple of BLOCK_M; with TWO,
into blocks of BLOCK_M_B rows as well (stage 2's own row blocks), from the same counts
and the same slot per pair.

Two launches (one, align_small_kernel, for a small batch), no host synchronisation
(grids are sized by upper bounds):
  count   local expert of each pair (expert_map applied, -1 = not on this rank,
          as is any id outside the range: _details/expert_ids.py), its place
          among its expert's rows (the per-expert counter's value before its
          atomic add), padding rows of `sorted_pairs` set to the sentinel
          `num_pairs` and every block's expert to -1; the program that takes
          the last ticket (a counter after the experts') reads the final counts,
          writes each expert's first row (exclusive prefix sum of the padded
          counts) and the number of rows in use per block size, and zeroes the
          counters and the ticket: they persist between forwards
          (alignment.counters), zero whenever no forward is running;
  scatter each pair's row in each block size's range, and the block -> expert maps.
Both the count and the small kernel also zero up to two int32 buffers of the caller's
(counters and accumulators its kernels after the alignment count or add into, an output
some of whose rows no later kernel writes), so clearing them costs no launch.
"""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.common._details.expert_ids import local_expert
from kimi_k3_moe.kernels.common._details.pdl import enter


@triton.jit(do_not_specialize=["num_pairs", "max_rows", "max_rows_b", "num_zero", "num_zero2"])
def align_count_kernel(ids_ptr, map_ptr, local_ptr, rank_ptr, counters_ptr, sorted_ptr, sorted_b_ptr,
                       block_expert_ptr, block_expert_b_ptr, offsets_ptr, num_rows_ptr, offsets_b_ptr,
                       num_rows_b_ptr, zero_ptr, num_zero, zero2_ptr, num_zero2, num_pairs, max_rows, max_rows_b,
                       num_ids, num_experts,
                       HAS_MAP: tl.constexpr, TWO: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_M_B: tl.constexpr, E_POW2: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < num_pairs
    e = local_expert(tl.load(ids_ptr + offs, mask=valid, other=-1), map_ptr, num_ids, num_experts, HAS_MAP)
    tl.store(local_ptr + offs, e, mask=valid)
    ok = valid & (e >= 0)
    # the count before this pair's is its place among its expert's rows (which place a pair takes
    # changes no row's result); relaxed: the ticket's release orders them before the last program
    # reads them, and an acq_rel atomic would wait for the one before it. Storing the returned
    # value keeps each add complete before the barrier below (an add whose result went unused
    # could still be in flight there on AMD)
    tl.store(rank_ptr + offs, tl.atomic_add(counters_ptr + e, 1, mask=ok, sem="relaxed"), mask=ok)
    _fill_unused(sorted_ptr, block_expert_ptr, max_rows, num_pairs, pid * BLOCK, nprog * BLOCK, BLOCK, BLOCK_M)
    if TWO:
        _fill_unused(sorted_b_ptr, block_expert_b_ptr, max_rows_b, num_pairs, pid * BLOCK, nprog * BLOCK, BLOCK,
                     BLOCK_M_B)
    _zero(zero_ptr, num_zero, pid * ZERO_BLOCK, nprog * ZERO_BLOCK)
    _zero(zero2_ptr, num_zero2, pid * ZERO_BLOCK, nprog * ZERO_BLOCK)
    tl.debug_barrier()  # every thread's counts are in before the program takes its ticket
    ticket = tl.atomic_add(counters_ptr + num_experts, 1)
    if ticket == nprog - 1:
        # the last program: every count is final; read and cleared in one step, so the counters are
        # zero again for the next forward (or graph replay) without a launch to clear them
        x = tl.arange(0, E_POW2)
        inside = x < num_experts
        c = tl.where(inside, tl.atomic_xchg(counters_ptr + x, 0, mask=inside, sem="relaxed"), 0)
        _first_rows(c, x, offsets_ptr, num_rows_ptr, num_experts, BLOCK_M)
        if TWO:
            _first_rows(c, x, offsets_b_ptr, num_rows_b_ptr, num_experts, BLOCK_M_B)
        tl.atomic_xchg(counters_ptr + num_experts, 0, sem="relaxed")


@triton.jit
def _fill_unused(sorted_ptr, block_expert_ptr, max_rows, num_pairs, first, step, BLOCK: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """Every row the padding sentinel and every block expert -1, before the real ones land: kernels
    that read no num_rows (the FlyDSL ones) skip the blocks past the rows in use by that -1 alone."""
    for start in range(first, max_rows, step):
        rows = start + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + rows, tl.full([BLOCK], 0, tl.int32) + num_pairs, mask=rows < max_rows)
        tl.store(block_expert_ptr + rows // BLOCK_M, tl.full([BLOCK], -1, tl.int32),
                 mask=(rows < max_rows) & (rows % BLOCK_M == 0))


ZERO_BLOCK = tl.constexpr(1024)


@triton.jit
def _zero(zero_ptr, num_zero, first, step):
    """int32 zeros over [0, num_zero) of a buffer the caller's next kernels count or add into."""
    for start in range(first, num_zero, step):
        i = start + tl.arange(0, ZERO_BLOCK)
        tl.store(zero_ptr + i, tl.zeros([ZERO_BLOCK], dtype=tl.int32), mask=i < num_zero)


@triton.jit
def _first_rows(c, e, offsets_ptr, num_rows_ptr, num_experts, BLOCK_M: tl.constexpr):
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    inclusive = tl.cumsum(padded, 0)
    tl.store(offsets_ptr + e, inclusive - padded, mask=e < num_experts)
    tl.store(num_rows_ptr, tl.sum(padded, 0))


@triton.jit(do_not_specialize=["num_pairs", "max_rows", "max_rows_b"])
def align_scatter_kernel(local_ptr, rank_ptr, offsets_ptr, sorted_ptr, block_expert_ptr,
                         offsets_b_ptr, sorted_b_ptr, block_expert_b_ptr, num_pairs, max_rows, max_rows_b,
                         BLOCK_M: tl.constexpr, BLOCK_M_B: tl.constexpr, TWO: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    enter(PDL)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(local_ptr + offs, mask=offs < num_pairs, other=-1)
    valid = e >= 0
    slot = tl.load(rank_ptr + offs, mask=valid, other=0)
    _place(offs, e, slot, valid, offsets_ptr, sorted_ptr, block_expert_ptr, max_rows, BLOCK_M)
    if TWO:
        _place(offs, e, slot, valid, offsets_b_ptr, sorted_b_ptr, block_expert_b_ptr, max_rows_b, BLOCK_M_B)


@triton.jit
def _place(pair, e, slot, valid, offsets_ptr, sorted_ptr, block_expert_ptr, max_rows, BLOCK_M: tl.constexpr):
    row = tl.load(offsets_ptr + e, mask=valid, other=0) + slot
    # counters left dirty (a forward stopped mid-launch) give wrong rows, never a write outside
    valid = valid & (row >= 0) & (row < max_rows)
    tl.store(sorted_ptr + row, pair, mask=valid)
    # every block of an expert's range holds at least one real pair, so the
    # pairs alone cover every block that exists (benign same-value writes)
    tl.store(block_expert_ptr + row // BLOCK_M, e, mask=valid)


@triton.jit
def _place_small(pair, e, slot, ok, counts, x, offsets_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, num_experts,
                 max_rows, BLOCK_M: tl.constexpr):
    """One block size of align_small_kernel: what align_count_kernel's last program and align_scatter_kernel do."""
    _first_rows(counts, x, offsets_ptr, num_rows_ptr, num_experts, BLOCK_M)
    tl.debug_barrier()  # each expert's first row, stored by one thread, read by the threads of its pairs
    _place(pair, e, slot, ok, offsets_ptr, sorted_ptr, block_expert_ptr, max_rows, BLOCK_M)


@triton.jit(do_not_specialize=["num_pairs", "max_rows", "max_rows_b", "num_zero", "num_zero2"])
def align_small_kernel(ids_ptr, map_ptr, local_ptr, counts_ptr, fill_ptr, offsets_ptr, sorted_ptr, block_expert_ptr,
                       num_rows_ptr, offsets_b_ptr, sorted_b_ptr, block_expert_b_ptr, num_rows_b_ptr,
                       zero_ptr, num_zero, zero2_ptr, num_zero2, num_pairs, max_rows, max_rows_b, num_ids, num_experts,
                       HAS_MAP: tl.constexpr, TWO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_M_B: tl.constexpr,
                       BLOCK: tl.constexpr, E_POW2: tl.constexpr, PDL: tl.constexpr):
    """The two launches' work in one program, for at most BLOCK pairs: the launch boundaries
    become barriers (the counters' atomics stay within the one CTA)."""
    enter(PDL)
    x = tl.arange(0, E_POW2)
    zeros = tl.zeros([E_POW2], dtype=tl.int32)
    tl.store(counts_ptr + x, zeros, mask=x < num_experts)
    tl.store(fill_ptr + x, zeros, mask=x < num_experts)
    pair = tl.arange(0, BLOCK)
    valid = pair < num_pairs
    e = local_expert(tl.load(ids_ptr + pair, mask=valid, other=-1), map_ptr, num_ids, num_experts, HAS_MAP)
    tl.store(local_ptr + pair, e, mask=valid)
    ok = valid & (e >= 0)
    _fill_unused(sorted_ptr, block_expert_ptr, max_rows, num_pairs, 0, BLOCK, BLOCK, BLOCK_M)
    if TWO:
        _fill_unused(sorted_b_ptr, block_expert_b_ptr, max_rows_b, num_pairs, 0, BLOCK, BLOCK, BLOCK_M_B)
    _zero(zero_ptr, num_zero, 0, ZERO_BLOCK)
    _zero(zero2_ptr, num_zero2, 0, ZERO_BLOCK)
    tl.debug_barrier()  # counters zero and sentinels stored before the counts and the real rows
    tl.atomic_add(counts_ptr + e, 1, mask=ok)
    slot = tl.atomic_add(fill_ptr + e, 1, mask=ok)
    tl.debug_barrier()  # every count complete before it is read
    counts = tl.load(counts_ptr + x, mask=x < num_experts, other=0, cache_modifier=".cg")
    _place_small(pair, e, slot, ok, counts, x, offsets_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr,
                 num_experts, max_rows, BLOCK_M)
    if TWO:
        _place_small(pair, e, slot, ok, counts, x, offsets_b_ptr, sorted_b_ptr, block_expert_b_ptr, num_rows_b_ptr,
                     num_experts, max_rows_b, BLOCK_M_B)


"""Token alignment on the GPU: group (token, slot) pairs by local expert into
blocks of BLOCK_M rows, padding each expert's rows to a multiple of BLOCK_M; with TWO,
into blocks of BLOCK_M_B rows as well (stage 2's own row blocks), from the same counts
and the same slot per pair.

Four launches (one, align_small_kernel, for a small batch), no host synchronisation
(grids are sized by upper bounds):
  zero    clears the per-expert counters (a launch of its own, so a replayed
          CUDA graph starts from zero every time);
  count   local expert of each pair (expert_map applied, -1 = not on this rank,
          as is any id outside the range: _details/expert_ids.py),
          per-expert counts (atomics), padding rows of `sorted_pairs` set to
          the sentinel `num_pairs` and every block's expert to -1;
  offsets one program: exclusive prefix sum of the padded counts -> each
          expert's first row, and the total number of rows (per block size);
  scatter each pair takes a slot in its expert (atomics hand out slots; the
          order inside an expert does not change any row's result), so a row
          in each block size's range, and writes the block -> expert maps.
"""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.triton._details.expert_ids import local_expert
from kimi_k3_moe.kernels.triton._details.pdl import enter


@triton.jit
def align_zero_kernel(ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=offs < n)


@triton.jit(do_not_specialize=["num_pairs", "max_rows"])
def align_count_kernel(ids_ptr, map_ptr, local_ptr, counts_ptr, sorted_ptr, sorted_b_ptr, block_expert_ptr,
                       block_expert_b_ptr, num_pairs, max_rows, max_rows_b, num_ids, num_experts,
                       HAS_MAP: tl.constexpr, TWO: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_M_B: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < num_pairs
    e = local_expert(tl.load(ids_ptr + offs, mask=valid, other=-1), map_ptr, num_ids, num_experts, HAS_MAP)
    tl.store(local_ptr + offs, e, mask=valid)
    tl.atomic_add(counts_ptr + e, 1, mask=valid & (e >= 0))
    _fill_unused(sorted_ptr, block_expert_ptr, max_rows, num_pairs, pid * BLOCK, nprog * BLOCK, BLOCK, BLOCK_M)
    if TWO:
        _fill_unused(sorted_b_ptr, block_expert_b_ptr, max_rows_b, num_pairs, pid * BLOCK, nprog * BLOCK, BLOCK,
                     BLOCK_M_B)


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


@triton.jit
def _first_rows(c, e, offsets_ptr, num_rows_ptr, num_experts, BLOCK_M: tl.constexpr):
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    inclusive = tl.cumsum(padded, 0)
    tl.store(offsets_ptr + e, inclusive - padded, mask=e < num_experts)
    tl.store(num_rows_ptr, tl.sum(padded, 0))


@triton.jit
def align_offsets_kernel(counts_ptr, offsets_ptr, num_rows_ptr, offsets_b_ptr, num_rows_b_ptr, num_experts,
                         BLOCK_M: tl.constexpr, BLOCK_M_B: tl.constexpr, TWO: tl.constexpr, E_POW2: tl.constexpr,
                         PDL: tl.constexpr):
    enter(PDL)
    e = tl.arange(0, E_POW2)
    c = tl.load(counts_ptr + e, mask=e < num_experts, other=0)
    _first_rows(c, e, offsets_ptr, num_rows_ptr, num_experts, BLOCK_M)
    if TWO:
        _first_rows(c, e, offsets_b_ptr, num_rows_b_ptr, num_experts, BLOCK_M_B)


@triton.jit(do_not_specialize=["num_pairs"])
def align_scatter_kernel(local_ptr, fill_ptr, offsets_ptr, sorted_ptr, block_expert_ptr,
                         offsets_b_ptr, sorted_b_ptr, block_expert_b_ptr, num_pairs,
                         BLOCK_M: tl.constexpr, BLOCK_M_B: tl.constexpr, TWO: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    enter(PDL)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(local_ptr + offs, mask=offs < num_pairs, other=-1)
    valid = e >= 0
    slot = tl.atomic_add(fill_ptr + e, 1, mask=valid)
    _place(offs, e, slot, valid, offsets_ptr, sorted_ptr, block_expert_ptr, BLOCK_M)
    if TWO:
        _place(offs, e, slot, valid, offsets_b_ptr, sorted_b_ptr, block_expert_b_ptr, BLOCK_M_B)


@triton.jit
def _place(pair, e, slot, valid, offsets_ptr, sorted_ptr, block_expert_ptr, BLOCK_M: tl.constexpr):
    row = tl.load(offsets_ptr + e, mask=valid, other=0) + slot
    tl.store(sorted_ptr + row, pair, mask=valid)
    # every block of an expert's range holds at least one real pair, so the
    # pairs alone cover every block that exists (benign same-value writes)
    tl.store(block_expert_ptr + row // BLOCK_M, e, mask=valid)


@triton.jit
def _place_small(pair, e, slot, ok, counts, x, offsets_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, num_experts,
                 BLOCK_M: tl.constexpr):
    """One block size of align_small_kernel: what align_offsets_kernel and align_scatter_kernel do."""
    _first_rows(counts, x, offsets_ptr, num_rows_ptr, num_experts, BLOCK_M)
    tl.debug_barrier()  # each expert's first row, stored by one thread, read by the threads of its pairs
    _place(pair, e, slot, ok, offsets_ptr, sorted_ptr, block_expert_ptr, BLOCK_M)


@triton.jit(do_not_specialize=["num_pairs", "max_rows", "max_rows_b"])
def align_small_kernel(ids_ptr, map_ptr, local_ptr, counts_ptr, fill_ptr, offsets_ptr, sorted_ptr, block_expert_ptr,
                       num_rows_ptr, offsets_b_ptr, sorted_b_ptr, block_expert_b_ptr, num_rows_b_ptr,
                       num_pairs, max_rows, max_rows_b, num_ids, num_experts,
                       HAS_MAP: tl.constexpr, TWO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_M_B: tl.constexpr,
                       BLOCK: tl.constexpr, E_POW2: tl.constexpr, PDL: tl.constexpr):
    """The four launches' work in one program, for at most BLOCK pairs: the launch boundaries
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
    tl.debug_barrier()  # counters zero and sentinels stored before the counts and the real rows
    tl.atomic_add(counts_ptr + e, 1, mask=ok)
    slot = tl.atomic_add(fill_ptr + e, 1, mask=ok)
    tl.debug_barrier()  # every count complete before it is read
    counts = tl.load(counts_ptr + x, mask=x < num_experts, other=0, cache_modifier=".cg")
    _place_small(pair, e, slot, ok, counts, x, offsets_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr,
                 num_experts, BLOCK_M)
    if TWO:
        _place_small(pair, e, slot, ok, counts, x, offsets_b_ptr, sorted_b_ptr, block_expert_b_ptr, num_rows_b_ptr,
                     num_experts, BLOCK_M_B)


"""Token alignment on the GPU: group (token, slot) pairs by local expert into
blocks of BLOCK_M rows, padding each expert's rows to a multiple of BLOCK_M.

Four launches, no host synchronisation (grids are sized by upper bounds):
  zero    clears the per-expert counters (a launch of its own, so a replayed
          CUDA graph starts from zero every time);
  count   local expert of each pair (expert_map applied, -1 = not on this rank),
          per-expert counts (atomics), padding rows of `sorted_pairs` set to
          the sentinel `num_pairs`;
  offsets one program: exclusive prefix sum of the padded counts -> each
          expert's first row, and the total number of rows;
  scatter each pair takes a row in its expert's range (atomics hand out slots;
          the order inside an expert does not change any row's result) and
          writes the block -> expert map.
"""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.triton._details.pdl import enter


@triton.jit
def align_zero_kernel(ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=offs < n)


@triton.jit(do_not_specialize=["num_pairs", "max_rows"])
def align_count_kernel(ids_ptr, map_ptr, local_ptr, counts_ptr, sorted_ptr,
                       num_pairs, max_rows,
                       HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    valid = offs < num_pairs
    e = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
    if HAS_MAP:
        e = tl.load(map_ptr + e, mask=valid & (e >= 0), other=-1).to(tl.int32)
    tl.store(local_ptr + offs, e, mask=valid)
    tl.atomic_add(counts_ptr + e, 1, mask=valid & (e >= 0))
    for start in range(pid * BLOCK, max_rows, nprog * BLOCK):
        rows = start + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + rows, tl.full([BLOCK], 0, tl.int32) + num_pairs, mask=rows < max_rows)


@triton.jit
def align_offsets_kernel(counts_ptr, offsets_ptr, num_rows_ptr, num_experts,
                         BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    e = tl.arange(0, E_POW2)
    c = tl.load(counts_ptr + e, mask=e < num_experts, other=0)
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    inclusive = tl.cumsum(padded, 0)
    tl.store(offsets_ptr + e, inclusive - padded, mask=e < num_experts)
    tl.store(num_rows_ptr, tl.sum(padded, 0))


@triton.jit(do_not_specialize=["num_pairs"])
def align_scatter_kernel(local_ptr, offsets_ptr, fill_ptr, sorted_ptr, block_expert_ptr,
                         num_pairs, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(local_ptr + offs, mask=offs < num_pairs, other=-1)
    valid = e >= 0
    slot = tl.atomic_add(fill_ptr + e, 1, mask=valid)
    row = tl.load(offsets_ptr + e, mask=valid, other=0) + slot
    tl.store(sorted_ptr + row, offs, mask=valid)
    # every block of an expert's range holds at least one real pair, so the
    # pairs alone cover every block that exists (benign same-value writes)
    tl.store(block_expert_ptr + row // BLOCK_M, e, mask=valid)

"""Which pairs a program's row block holds: aligned blocks (a main tile and an optional tail tile of
the expert-sorted order) or the direct path's one pair per block; shared by both stage kernels."""
import triton
import triton.language as tl

from kimi_k3_moe.kernels.common._details.expert_ids import local_expert_at
from kimi_k3_moe.kernels.triton._details import constants as C

PATH_ALIGNED = tl.constexpr(C.PATH_ALIGNED)
PATH_DIRECT_MAP = tl.constexpr(C.PATH_DIRECT_MAP)


@triton.jit
def _row_tile(sorted_ptr, start, num_pairs, ROWS: tl.constexpr):
    """Rows start .. start + ROWS of the aligned order: (their pairs, real-row mask)."""
    pair = tl.load(sorted_ptr + (start + tl.arange(0, ROWS)))
    return pair, pair < num_pairs


@triton.jit
def _direct_tile(pid_m, num_pairs, ROWS: tl.constexpr):
    """Path "direct": block pid_m is pair pid_m in its first row, padding after it."""
    r = tl.arange(0, ROWS)
    pair = tl.where(r == 0, pid_m, num_pairs)
    return pair, pair < num_pairs


@triton.jit
def row_block(pid_m, routing, num_pairs, num_ids, num_local, PATH: tl.constexpr, BLOCK_M: tl.constexpr,
               TAIL_M: tl.constexpr):
    """Row block pid_m of a Routing (_details/groups.py): (whether it holds rows, its expert (int64), the
    main tile's pairs and real-row mask, the tail tile's (the main ones when TAIL_M is 0)). PATH_DIRECT:
    block pid_m is pair pid_m (path "direct"), its expert read from topk_ids (routing.block_expert),
    through the expert map with PATH_DIRECT_MAP; it holds rows when that expert is on this rank."""
    if PATH != PATH_ALIGNED:
        tl.static_assert(TAIL_M == 0, "a direct block is one pair")
        e = local_expert_at(routing.block_expert, routing.map, pid_m, num_ids, num_local, PATH == PATH_DIRECT_MAP)
        live = e >= 0
        pair, row_ok = _direct_tile(pid_m, num_pairs, BLOCK_M)
        pair_t, row_ok_t = pair, row_ok
    else:
        # every program's block lies within the buffers (max_blocks of block_m rows), so reading them
        # for a block past the rows in use is harmless: the caller returns before using them
        start = pid_m * (BLOCK_M + TAIL_M)
        live = start < tl.load(routing.num_rows)
        e = tl.load(routing.block_expert + pid_m)
        pair, row_ok = _row_tile(routing.sorted, start, num_pairs, BLOCK_M)
        if TAIL_M > 0:
            pair_t, row_ok_t = _row_tile(routing.sorted, start + BLOCK_M, num_pairs, TAIL_M)
        else:
            pair_t, row_ok_t = pair, row_ok
    return live, e.to(tl.int64), pair, row_ok, pair_t, row_ok_t

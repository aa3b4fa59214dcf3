"""Token alignment: (token, slot) pairs grouped by local expert into blocks of
`block_m` rows, on the GPU, without host synchronisation (see _details/align_kernels.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kimi_k3_moe.kernels.common._details import align_kernels as K
from kimi_k3_moe.kernels.common.launch import Launch, cdiv, next_pow2

BLOCK = 256
# up to this many pairs (16 tokens at top-16) one program aligns them in one launch instead of two
SMALL_PAIRS = 256
SMALL_WARPS = 8
_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}


def counters(device: torch.device | str, num_experts: int) -> torch.Tensor:
    """The per-expert counters and the ticket of the two-launch alignment (int32 [E + 1]): zeroed
    once here, left zero by every alignment's last program, so no launch clears them. One set per
    device and expert count, kept for the process (a captured graph holds their address), shared by
    the forwards on that device, which run one after another. The backends make them when they
    prepare a layer: made inside a graph capture, their zeroing would run only when that one graph
    replays, so that is refused."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), num_experts)
    if key not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the alignment's counters for {device} and {num_experts} experts do not exist "
                               "yet: prepare the experts (or run one forward) before capturing a graph")
        _COUNTERS[key] = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    return _COUNTERS[key]


@dataclass
class AlignedPairs:
    """Where each pair's row lives. Sizes are upper bounds; `num_rows` is on the device."""

    block_m: int
    num_pairs: int
    max_blocks: int
    local: torch.Tensor         # int32 [P]: local expert per pair, -1 = not on this rank
    sorted_pairs: torch.Tensor  # int32 [max_blocks * block_m]: pair per row, num_pairs = padding
    block_expert: torch.Tensor  # int32 [max_blocks]: expert of each block, -1 past num_rows
    num_rows: torch.Tensor      # int32 [1]: rows in use (a multiple of block_m)
    offsets: torch.Tensor       # int32 [E]: first row of each expert
    # path "direct" (direct_pairs): block b is pair b alone; block_expert and local are topk_ids as
    # given, the kernels apply expert_map and the id bounds themselves (_details/expert_ids.py);
    # sorted_pairs, num_rows and offsets are unused
    direct: bool = False
    expert_map: torch.Tensor | None = None
    num_experts: int = 0  # local experts: ids (through the map) outside [0, num_experts) are not here

    @property
    def num_ids(self) -> int:
        """Ids in [0, num_ids) can name an expert: the map's length, else the local experts'."""
        return self.num_experts if self.expert_map is None else self.expert_map.numel()

    @property
    def max_rows(self) -> int:
        return self.max_blocks * self.block_m


def max_blocks_for(num_pairs: int, num_experts: int, block_m: int) -> int:
    # sum over experts of ceil(c_e / block_m) <= num_pairs / block_m + (experts in use)
    return cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def direct_pairs(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, block_m: int,
                 num_experts: int) -> AlignedPairs:
    """Path "direct": every (token, slot) pair is a block of its own (its one row first, block_m - 1
    padding rows), so nothing is launched to group them. With a few tokens nearly every pair has an
    expert to itself, and grouping cost more launches than it saved."""
    ids = topk_ids.reshape(-1)
    return AlignedPairs(block_m=block_m, num_pairs=ids.numel(), max_blocks=ids.numel(), local=ids,
                        sorted_pairs=ids, block_expert=ids, num_rows=ids, offsets=ids, direct=True,
                        expert_map=expert_map, num_experts=num_experts)


def align_launches(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int,
                   block_ms: tuple[int, ...], book: torch.Tensor | None = None,
                   clear: torch.Tensor | None = None) -> tuple[list[AlignedPairs], list[Launch]]:
    """The pairs aligned to each of one or two block sizes (an AlignedPairs each, in that order) and
    the launches that do it: one up to SMALL_PAIRS pairs, else two; both block sizes share the
    counts and each pair's slot. `book` (contiguous int32, at least one element per pair): the
    pairs' local experts go to its start, and the launches zero the rest of it; they zero `clear`
    (contiguous int32) too."""
    if not 1 <= len(block_ms) <= 2:
        raise ValueError(f"alignment takes one or two block sizes, got {block_ms}")
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    device = ids.device
    if book is None:
        book = torch.empty(num_pairs, dtype=torch.int32, device=device)
    elif book.dtype != torch.int32 or book.dim() != 1 or not book.is_contiguous() or book.numel() < num_pairs:
        raise ValueError(f"book must be a contiguous 1-D int32 tensor of >= {num_pairs} elements, got "
                         f"{book.dtype} {tuple(book.shape)}")
    if clear is not None and (clear.dtype != torch.int32 or clear.dim() != 1 or not clear.is_contiguous()):
        raise ValueError(f"clear must be a contiguous 1-D int32 tensor, got {clear.dtype} {tuple(clear.shape)}")
    local, zero = book[:num_pairs], book[num_pairs:]
    zero_args = dict(zero_ptr=zero if zero.numel() else local, num_zero=zero.numel(),
                     zero2_ptr=local if clear is None else clear, num_zero2=0 if clear is None else clear.numel())
    out = [_aligned_buffers(num_pairs, num_experts, bm, local) for bm in block_ms]
    num_ids = num_experts if expert_map is None else expert_map.numel()
    a, b = out[0], out[-1]
    two = len(out) == 2
    if num_pairs <= SMALL_PAIRS:
        scratch = torch.empty(2 * num_experts, dtype=torch.int32, device=device)
        counts, fill = scratch[:num_experts], scratch[num_experts:]
        return out, [_small_launch(ids, expert_map, num_ids, local, counts, fill, a, b, two, zero_args)]
    rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
    grid = (max(1, cdiv(num_pairs, BLOCK)),)
    launches = [
        Launch(K.align_count_kernel, grid, dict(
            ids_ptr=ids, map_ptr=ids if expert_map is None else expert_map, local_ptr=local, rank_ptr=rank,
            counters_ptr=counters(device, num_experts), sorted_ptr=a.sorted_pairs, sorted_b_ptr=b.sorted_pairs,
            block_expert_ptr=a.block_expert, block_expert_b_ptr=b.block_expert, offsets_ptr=a.offsets,
            num_rows_ptr=a.num_rows, offsets_b_ptr=b.offsets, num_rows_b_ptr=b.num_rows, **zero_args,
            num_pairs=num_pairs,
            max_rows=a.max_rows, max_rows_b=b.max_rows, num_ids=num_ids, num_experts=num_experts,
            HAS_MAP=expert_map is not None, TWO=two, BLOCK=BLOCK, BLOCK_M=a.block_m, BLOCK_M_B=b.block_m,
            E_POW2=max(16, next_pow2(num_experts)), PDL=False), num_warps=4, num_stages=1, label="align.count"),
        Launch(K.align_scatter_kernel, grid, dict(
            local_ptr=local, rank_ptr=rank, offsets_ptr=a.offsets, sorted_ptr=a.sorted_pairs,
            block_expert_ptr=a.block_expert, offsets_b_ptr=b.offsets, sorted_b_ptr=b.sorted_pairs,
            block_expert_b_ptr=b.block_expert, num_pairs=num_pairs, max_rows=a.max_rows, max_rows_b=b.max_rows,
            BLOCK_M=a.block_m, BLOCK_M_B=b.block_m, TWO=two, BLOCK=BLOCK, PDL=False),
            num_warps=4, num_stages=1, label="align.scatter"),
    ]
    return out, launches


def _small_launch(ids, expert_map, num_ids, local, counts, fill, a: AlignedPairs, b: AlignedPairs,
                  two: bool, zero_args: dict) -> Launch:
    num_experts = a.offsets.numel()
    return Launch(K.align_small_kernel, (1,), dict(
        ids_ptr=ids, map_ptr=ids if expert_map is None else expert_map, local_ptr=local, counts_ptr=counts,
        fill_ptr=fill, offsets_ptr=a.offsets, sorted_ptr=a.sorted_pairs, block_expert_ptr=a.block_expert,
        num_rows_ptr=a.num_rows, offsets_b_ptr=b.offsets, sorted_b_ptr=b.sorted_pairs,
        block_expert_b_ptr=b.block_expert, num_rows_b_ptr=b.num_rows, **zero_args, num_pairs=ids.numel(),
        max_rows=a.max_rows,
        max_rows_b=b.max_rows, num_ids=num_ids, num_experts=num_experts, HAS_MAP=expert_map is not None, TWO=two,
        BLOCK_M=a.block_m, BLOCK_M_B=b.block_m, BLOCK=max(16, next_pow2(ids.numel())),
        E_POW2=max(16, next_pow2(num_experts)), PDL=False),
        num_warps=SMALL_WARPS, num_stages=1, label="align.small")


def _aligned_buffers(num_pairs: int, num_experts: int, block_m: int, local: torch.Tensor) -> AlignedPairs:
    max_blocks = max_blocks_for(num_pairs, num_experts, block_m)
    device = local.device
    return AlignedPairs(
        block_m=block_m, num_pairs=num_pairs, max_blocks=max_blocks, local=local,
        sorted_pairs=torch.empty(max_blocks * block_m, dtype=torch.int32, device=device),
        block_expert=torch.empty(max_blocks, dtype=torch.int32, device=device),
        num_rows=torch.empty(1, dtype=torch.int32, device=device),
        offsets=torch.empty(num_experts, dtype=torch.int32, device=device),
        num_experts=num_experts,
    )


def misplaced(pairs: AlignedPairs, local: torch.Tensor) -> str | None:
    """What is wrong with an alignment's rows for pairs whose local experts are `local` ([P], -1: on
    no rank), worked out again with PyTorch; None if nothing. The GPU check and the tests use it."""
    local = local.long()
    mine = local >= 0
    counts = torch.bincount(local[mine], minlength=pairs.offsets.numel())
    padded = (counts + pairs.block_m - 1) // pairs.block_m * pairs.block_m
    num_rows = int(pairs.num_rows.item())
    if not torch.equal(pairs.offsets.long(), torch.cumsum(padded, 0) - padded):
        return "an expert's first row is not the padded sum of the counts before it"
    if num_rows != int(padded.sum()) or num_rows > pairs.max_rows:
        return f"num_rows {num_rows}, the padded counts sum to {int(padded.sum())} (at most {pairs.max_rows})"
    rows = pairs.sorted_pairs[:num_rows].long()
    real = rows < local.numel()
    if not torch.equal(torch.sort(rows[real]).values, torch.nonzero(mine).flatten()):
        return "the rows do not hold each pair of this rank exactly once"
    if not bool((pairs.sorted_pairs[num_rows:] == local.numel()).all()):
        return "a row past num_rows is not padding"
    if not bool((pairs.block_expert[num_rows // pairs.block_m:] == -1).all()):
        return "a block past num_rows names an expert"  # kernels without num_rows skip by it
    block_of = torch.arange(num_rows, device=rows.device) // pairs.block_m
    if not torch.equal(local[rows[real]], pairs.block_expert[block_of[real]].long()):
        return "a pair sits in a block of another expert"
    has_pair = torch.zeros(num_rows // pairs.block_m, dtype=torch.bool, device=rows.device)
    has_pair[block_of[real]] = True
    if not bool(has_pair.all()):
        return "a block without pairs"
    return None

"""The named groups the kernels' helpers take instead of long positional lists.

Triton turns each constexpr inside a tuple assigned to a plain name into a runtime value, so
a group that may hold one is built where it is passed or bound with an annotation,
`cfg: tl.constexpr = TileConfig(...)` (unannotated, `tl.arange(0, cfg.BLOCK_K)` fails); passed
on to another helper, a group keeps its members' kinds, nested groups included. Besides the
declared constexprs that counts the kernel's integer arguments: the JIT makes one that equals 1
a constexpr. So the groups a kernel names (RowTile, WeightTile, Expert, Routing) hold only
tensors it computed and its pointers, and those holding its integer arguments (ExpertWeights,
SlotRouting) are built in a call's arguments. Triton 3.6, 3.8 and 3.9 behave alike here,
compiled for sm_90, gfx942 and gfx950 or interpreted.
"""
import typing

import triton.language as tl


class RowTile(typing.NamedTuple):
    """A row tile of activations. rows: [ROWS, 1] pointers to each row; words / plain: the same
    plus the columns of a K step in word order (BLOCK_K/8 wide) / in plain or pair order (BLOCK_K
    wide); ka: the columns of an interleaved step's first half (decode.word_k_offsets); ok: the
    real rows; pair: each row's (token, slot) pair, where its output goes."""
    rows: tl.tensor
    words: tl.tensor
    plain: tl.tensor
    ka: tl.tensor
    ok: tl.tensor
    pair: tl.tensor


class WeightTile(typing.NamedTuple):
    """An N tile of an expert's weights: [BLOCK_N, 1] pointers to each row's codes, scales and
    offsets, and the rows to load (mask)."""
    rows: tl.tensor
    scales: tl.tensor
    offsets: tl.tensor
    mask: tl.tensor


class Expert(typing.NamedTuple):
    """One expert's weights before a tile is chosen: the codes, scales and offsets pointers and
    the expert's element offset into the codes (w_base) and into the scales and offsets (s_base)."""
    w: tl.tensor
    s: tl.tensor
    o: tl.tensor
    w_base: tl.tensor
    s_base: tl.tensor


class Routing(typing.NamedTuple):
    """Where the row blocks come from: the aligned order's pairs, each block's expert (path
    "direct": topk_ids), the number of aligned rows, and the expert map (or a stand-in)."""
    sorted: tl.tensor
    block_expert: tl.tensor
    num_rows: tl.tensor
    map: tl.tensor


class ExpertWeights(typing.NamedTuple):
    """All experts' weights as the kernel receives them: codes, scales and offsets with their expert
    and row strides (built in a call's arguments: the strides are the kernel's)."""
    w: tl.tensor
    stride_we: int
    stride_wn: int
    s: tl.tensor
    stride_se: int
    stride_sn: int
    o: tl.tensor


class SlotRouting(typing.NamedTuple):
    """A token's slots as the gemv kernels read them: topk_ids, the expert map, the router weights,
    and the map's size and number of local experts (built in a call's arguments)."""
    ids: tl.tensor
    map: tl.tensor
    topk_w: tl.tensor
    num_ids: int
    num_local: int


class WeightCode(typing.NamedTuple):
    """How a kernel's weights decode (constexprs; _details/constants.py): their format, whether
    int4 offsets come with the scales, and the decoder."""
    FMT: tl.constexpr
    HAS_OFFSETS: tl.constexpr
    DECODE: tl.constexpr


class TileConfig(typing.NamedTuple):
    """A matmul kernel's compile-time choices (_details/matmul_kernels.py): its WeightCode, SWAP and
    the K order, the main and tail row tiles, and the N and K tile sizes."""
    CODE: WeightCode
    SWAP: tl.constexpr
    ORDER: tl.constexpr
    BLOCK_M: tl.constexpr
    TAIL_M: tl.constexpr
    BLOCK_N: tl.constexpr
    BLOCK_K: tl.constexpr

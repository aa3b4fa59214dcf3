"""The one rule every Triton kernel applies to an expert id read from topk_ids.

An id names an expert of this rank only when it lies in [0, num_ids) (num_ids:
the expert map's length, or the number of local experts without a map) and,
through the map, lands in [0, num_local). Anything else, -1 included, means
"not on this rank": the pair reads nothing and contributes nothing. The bounds
are compared in the id's own width, so an int64 id past 2^31 cannot wrap into
range when narrowed; no tensor value can steer a load outside the map or the
experts. Nothing here reads device memory from the host, so a bad id costs no
synchronisation; `reference.check_expert_ids` is the opt-in check that names it.
"""
import triton
import triton.language as tl


@triton.jit
def local_expert(gid, map_ptr, num_ids, num_local, HAS_MAP: tl.constexpr):
    """int32 local expert of the global id(s) `gid` (a scalar or a block, any integer dtype); -1 when
    not on this rank."""
    inside = (gid >= 0) & (gid < num_ids)
    e = tl.where(inside, gid, 0).to(tl.int32)
    if HAS_MAP:
        e = tl.load(map_ptr + e, mask=inside, other=-1).to(tl.int32)
        inside = inside & (e >= 0) & (e < num_local)
    return tl.where(inside, e, -1)


@triton.jit
def local_expert_at(ids_ptr, map_ptr, i, num_ids, num_local, HAS_MAP: tl.constexpr):
    """The local expert of pair i (topk_ids through expert_map; -1: not on this rank, or out of range)."""
    return local_expert(tl.load(ids_ptr + i), map_ptr, num_ids, num_local, HAS_MAP)

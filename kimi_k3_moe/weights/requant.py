"""Load-time conversion of a layer's MXFP4 experts to packed int4 (gfx942).

A real layer is ~2 GB per rank and a model has 92 of them, so conversion
runs on the GPU when there is one, a chunk of rows at a time, with a
progress bar; its scratch memory stays within two chunks whatever the layer
size (tests check it on the CPU).
"""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from kimi_k3_moe.experts import INT4, Int4Experts, Mxfp4Experts, WeightFormat, require_format
from kimi_k3_moe.formats import int4

# Scratch budget of one chunk. On a GPU a larger chunk amortises the
# per-class loop of the search (a few hundred small kernels per chunk).
CPU_CHUNK_BYTES = 256 << 20
GPU_CHUNK_BYTES = 1 << 30


def conversion_device(preferred: torch.device | str | None, source: torch.device) -> torch.device:
    """`preferred` if given; else the source's GPU, else the first GPU there is, else the CPU."""
    if preferred is not None:
        return torch.device(preferred)
    if source.type != "cpu":
        return source
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def requantize_experts(
    experts: Mxfp4Experts,
    *,
    method: str = int4.DEFAULT_METHOD,
    chunk_bytes: int | None = None,
    device: torch.device | str | None = None,
    out_device: torch.device | str | None = None,
    progress: bool = True,
    desc: str = "MXFP4 -> int4",
) -> Int4Experts:
    """Convert every expert of `experts`.

    Computes on `device` (default: see `conversion_device`), writes the
    result to `out_device` (default: where the experts are). Each chunk's
    scratch stays near `chunk_bytes`; the result is the same bits for any
    chunk size and device.
    """
    compute = conversion_device(device, experts.device)
    if chunk_bytes is None:
        chunk_bytes = CPU_CHUNK_BYTES if compute.type == "cpu" else GPU_CHUNK_BYTES
    out = experts.device if out_device is None else torch.device(out_device)
    total = 2 * experts.num_experts
    with tqdm(total=total, desc=f"{desc} ({method}, {compute.type})", unit="expert",
              disable=not progress, leave=False) as bar:
        w13 = int4.requantize(experts.w13_packed, experts.w13_scale, method=method, name="w13",
                              chunk_bytes=chunk_bytes, progress=bar.update, device=compute,
                              out_device=out)
        w2 = int4.requantize(experts.w2_packed, experts.w2_scale, method=method, name="w2",
                             chunk_bytes=chunk_bytes, progress=bar.update, device=compute,
                             out_device=out)
    return Int4Experts(w13, w2)


def to_format(experts, weight_format: WeightFormat, where: str = "the load path"):
    """`experts` in `weight_format`: MXFP4 Mxfp4Experts as they are, or converted to int4 with `weight_format`'s method.

    Pre-converted experts (a `kimi-k3-moe convert` checkpoint) are taken only
    when their method is `weight_format`'s: methods are never mixed silently. Anything
    else (a backend's own prepared form) passes through for the backend to judge.
    """
    if weight_format.kind == INT4 and isinstance(experts, Mxfp4Experts):
        return requantize_experts(experts, method=weight_format.method)
    if isinstance(experts, (Mxfp4Experts, Int4Experts)):
        require_format(experts, weight_format, where)
    return experts

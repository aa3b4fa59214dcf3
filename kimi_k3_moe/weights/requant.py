"""Load-time conversion of a layer's MXFP4 experts to packed int4 (gfx942).

A real layer is ~2 GB per rank and a model has 92 of them, so conversion
runs on the GPU when there is one, a chunk of rows at a time, with a
progress bar; its scratch memory stays within two chunks whatever the layer
size (`benchmarks/requant_load.py` measures it, tests check it on the CPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from kimi_k3_moe.formats import int4
from kimi_k3_moe.kernels.base import ExpertWeights

# Scratch budget of one chunk. On a GPU a larger chunk amortises the
# per-class loop of the search (a few hundred small kernels per chunk).
CPU_CHUNK_BYTES = 256 << 20
GPU_CHUNK_BYTES = 1 << 30


@dataclass
class Int4Experts:
    """A layer's experts after conversion: w13 [E, 2I, H] and w2 [E, H, I] in int4."""

    w13: int4.Int4Weights
    w2: int4.Int4Weights

    def __post_init__(self) -> None:
        e, two_i, h = self.w13.shape
        if self.w13.packed.dim() != 3 or two_i % 2:
            raise ValueError(f"Int4Experts.w13 must be [E, 2I, H], got {self.w13.shape}")
        if self.w2.shape != (e, h, two_i // 2):
            raise ValueError(f"Int4Experts.w2 shape {self.w2.shape} != {(e, h, two_i // 2)} "
                             f"(from w13 {self.w13.shape})")
        if self.w13.method != self.w2.method:
            raise ValueError(f"Int4Experts mixes methods: w13 {self.w13.method!r}, w2 {self.w2.method!r}")

    @property
    def method(self) -> str:
        return self.w13.method

    @property
    def num_experts(self) -> int:
        return self.w13.packed.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.w13.packed.device

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    def dequantize(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w13[expert].dequantize(), self.w2[expert].dequantize()

    def select(self, experts) -> "Int4Experts":
        """The experts at these local indices (a list, tensor or slice)."""
        return Int4Experts(self.w13[experts], self.w2[experts])

    def to(self, device: torch.device | str) -> "Int4Experts":
        return Int4Experts(self.w13.to(device), self.w2.to(device))


def conversion_device(preferred: torch.device | str | None, source: torch.device) -> torch.device:
    """`preferred` if given; else the source's GPU, else the first GPU there is, else the CPU."""
    if preferred is not None:
        return torch.device(preferred)
    if source.type != "cpu":
        return source
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def requantize_experts(
    experts: ExpertWeights,
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


def int4_experts_for(experts: ExpertWeights | Int4Experts, method: str, backend: str) -> Int4Experts:
    """What an int4 backend runs: `experts` converted with `method`, or pre-converted ones.

    Pre-converted experts (a `kimi-k3-moe convert` checkpoint) are taken only
    when their method is the backend's: methods are never mixed silently.
    """
    if isinstance(experts, Int4Experts):
        if experts.method != method:
            raise ValueError(f"{backend}: pre-converted experts use int4 method {experts.method!r}, "
                             f"but this backend is configured for {method!r}")
        return experts
    if not isinstance(experts, ExpertWeights):
        raise TypeError(f"{backend}: expected ExpertWeights or Int4Experts, got {type(experts).__name__}")
    return requantize_experts(experts, method=method)

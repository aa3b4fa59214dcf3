"""A layer's experts as the FlyDSL kernels read them.

MXFP4: no re-layout, the checkpoint's byte order. int4: `Int4KernelLayout`, a
permutation of each row's 64-byte K128 blocks and an offset-binary flip of every
nibble (`layout.int4_swizzle_plan`), so one 16-byte load per lane holds a dword of
each of the block's four scale groups and a dword decodes to bf16 pairs in five
integer ops. Scales and offsets stay as the format holds them. `dequantize`
undoes the layout and decodes with the formats' own decoder, which the self-check
compares against. Every tensor must be contiguous: the kernels take flat buffers.
  w13 [E, 2I, H/2] uint8 (gate rows, then up), w2 [E, H, I/2] uint8
  scales [.., K/32]: uint8 e8m0 (MXFP4) or bf16 (int4); offsets bf16 or None (int4 only)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kimi_k3_moe.experts import PackedExperts
from kimi_k3_moe.experts.format import INT4
from kimi_k3_moe.experts.packed import Layout
from kimi_k3_moe.kernels.flydsl import layout as L

_BLOCK_BYTES = L.K_BLOCK // 2


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> [..., n/4, 8] nibbles of each little-endian dword, bit position 4p at p."""
    b = packed.reshape(*packed.shape[:-1], -1, 4)
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(*b.shape[:-1], 8)


def _pack(nib: torch.Tensor) -> torch.Tensor:
    """Inverse of _nibbles."""
    pairs = nib.reshape(*nib.shape[:-1], 4, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).reshape(*nib.shape[:-2], -1)


def _permute(packed: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Apply (or undo) the int4 kernel order on whole 64-byte blocks; a ragged tail is left
    as it is (no kernel tiles such a K: `prepare` refuses the layer)."""
    full = packed.shape[-1] // _BLOCK_BYTES * _BLOCK_BYTES
    dwords, nibbles = (torch.tensor(t) for t in L.int4_swizzle_plan())
    if inverse:
        dwords, nibbles = torch.argsort(dwords), torch.argsort(nibbles)
    out = packed.contiguous().clone()
    if full:
        head = packed[..., :full] ^ L.INT4_XOR if inverse else packed[..., :full]
        nib = _nibbles(head).unflatten(-2, (-1, 16))           # [..., blocks, 16 dwords, 8 nibbles]
        nib = nib[..., dwords, :][..., nibbles]
        head = _pack(nib.flatten(-3, -2))
        out[..., :full] = head if inverse else head ^ L.INT4_XOR
    return out


class Int4KernelLayout(Layout):
    """The FlyDSL int4 byte order (module docstring); MXFP4 keeps the checkpoint's."""

    name = "flydsl-int4-groups"

    def swizzle(self, packed: torch.Tensor, kind: str) -> torch.Tensor:
        return _permute(packed, inverse=False) if kind == INT4 else packed.contiguous()

    def unswizzle(self, codes: torch.Tensor, kind: str) -> torch.Tensor:
        return _permute(codes, inverse=True) if kind == INT4 else codes


@dataclass
class FlyDSLExperts(PackedExperts):
    contiguous: ClassVar[bool] = True
    layout: ClassVar[Layout] = Int4KernelLayout()

    def kernel_args(self, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scales, offsets) of "w13" or "w2", flat as the kernels take them.

        Without offsets a one-element bf16 tensor fills the offsets argument: never read (so left
        uninitialised: filling it would be a launch per forward), but of the dtype the kernels were
        specialised for."""
        codes, scale = getattr(self, which), getattr(self, f"{which}_scale")
        offset = getattr(self, f"{which}_offset")
        if offset is None:
            offset = torch.empty(1, dtype=torch.bfloat16, device=codes.device)
        return codes.reshape(-1), scale.reshape(-1), offset.reshape(-1)

"""Load-time validation of a layer's expert tensors, before any kernel sees them.

A NaN e8m0 scale byte (0xFF) or a scale so large that the decoded weights
overflow turns every output row routed to that expert into NaN/inf on the
kernel paths, silently, and the self-check samples a few experts only. So
every expert's tensors are scanned here, on the device they are on, a chunk
of experts at a time (byte reductions: cheap next to reading the weights).

The rule for MXFP4 scale bytes `b` (docs/FORMATS.md, "Scale bytes refused
at load"):
- `b == 0xFF` is NaN: refused anywhere (0 x NaN is NaN).
- `b > MAX_SCALE_BYTE` (222, 0xDE) in a block with any nonzero code is
  refused: past it the kernels' bf16/fp32 K-sums may overflow (the
  derivation is in docs/FORMATS.md). Trained weights sit near b = 120.
Pre-converted int4 experts: scales (and offsets) must be finite.

`KIMI_K3_MOE_VALIDATE_WEIGHTS=off` skips the scan (documented in README).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kimi_k3_moe import settings
from kimi_k3_moe.formats import mxfp4

NAN_BYTE = mxfp4.E8M0_NAN
MAX_SCALE_BYTE = 222
CHUNK_BYTES = 64 << 20
OPT_OUT = f"set {settings.VALIDATE_WEIGHTS}=off to load anyway"


class WeightValidationError(ValueError):
    """A layer's expert tensors would make the kernels compute NaN/inf or garbage."""


def validate_experts(experts: Any, *, layer: str = "", env: Mapping[str, str] | None = None,
                     chunk_bytes: int = CHUNK_BYTES) -> None:
    """Raise WeightValidationError naming layer, expert, tensor, byte and count; no-op when opted out."""
    if settings.choice(settings.VALIDATE_WEIGHTS, env) == "off":
        return
    problems = find_problems(experts, layer=layer, chunk_bytes=chunk_bytes)
    if problems:
        raise WeightValidationError("; ".join(problems) + f" ({OPT_OUT})")


def find_problems(experts: Any, *, layer: str = "", chunk_bytes: int = CHUNK_BYTES) -> list[str]:
    """One message per (tensor, kind of problem); empty when the experts are fit to serve."""
    where = f"{layer}: " if layer else ""
    if hasattr(experts, "w13_scale"):
        try:
            experts.validate()  # dtypes and shapes (cheap; the tensors may have been swapped since)
        except (TypeError, ValueError) as exc:
            return [f"{where}{exc}"]
        inter = experts.intermediate_size
        return [where + p for field, packed, scale in (("w13", experts.w13_packed, experts.w13_scale),
                                                       ("w2", experts.w2_packed, experts.w2_scale))
                for p in _scan_mxfp4(field, packed, scale, inter, chunk_bytes)]
    if hasattr(experts, "w13") and hasattr(experts.w13, "scales"):
        return [where + p for field, w in (("w13", experts.w13), ("w2", experts.w2))
                for kind in ("scales", "offsets") if getattr(w, kind, None) is not None
                for p in _scan_finite(f"{field}.{kind}", getattr(w, kind), chunk_bytes)]
    raise TypeError(f"cannot validate experts of type {type(experts).__name__}")


def _checkpoint_name(field: str, row: int, inter: int) -> str:
    if field == "w2":
        return f"checkpoint w2 (down) row {row}"
    return f"checkpoint w1 (gate) row {row}" if row < inter else f"checkpoint w3 (up) row {row - inter}"


def _experts_per_chunk(t: torch.Tensor, chunk_bytes: int) -> int:
    per_expert = max(1, t[0].numel() * t.element_size()) if t.shape[0] else 1
    return max(1, chunk_bytes // (4 * per_expert))  # headroom for temporaries


def _scan_mxfp4(field: str, packed: torch.Tensor, scale: torch.Tensor, inter: int,
                chunk_bytes: int) -> list[str]:
    # One max per expert (a fast uint8 reduction, one sync per chunk) finds the rare suspects;
    # only their bytes are counted and their codes looked at.
    suspects = []
    step = _experts_per_chunk(scale, chunk_bytes)
    for e0 in range(0, scale.shape[0], step):
        top = scale[e0:e0 + step].flatten(1).amax(1).cpu()
        suspects += [e0 + int(k) for k in (top > MAX_SCALE_BYTE).nonzero().flatten()]
    nan_counts, high_counts = {}, {}
    for e in suspects:
        nan = scale[e] == NAN_BYTE
        high = _overflowing(packed[e], scale[e])
        nan_counts[e], high_counts[e] = int(nan.sum()), int(high.sum())
    problems = []
    for counts, kind in ((nan_counts, "nan"), (high_counts, "high")):
        bad = [e for e in suspects if counts[e]]
        if not bad:
            continue
        e = bad[0]
        mask = scale[e] == NAN_BYTE if kind == "nan" else _overflowing(packed[e], scale[e])
        row, block = (int(v) for v in mask.nonzero()[0].tolist())
        byte = int(scale[e, row, block])
        what = (f"{counts[e]} NaN scale byte(s) 0xFF" if kind == "nan" else
                f"{counts[e]} scale byte(s) above 0x{MAX_SCALE_BYTE:X} in blocks with nonzero codes "
                f"(decoded weights up to 6 x 2^({byte}-127) overflow the kernels' bf16/fp32 sums)")
        others = f"; {len(bad) - 1} more expert(s) of this layer too: {bad[1:9]}" if len(bad) > 1 else ""
        problems.append(f"expert {e} tensor {field}_scale holds {what}, first 0x{byte:02X} at "
                        f"[row {row}, block {block}] = {_checkpoint_name(field, row, inter)}{others}")
    return problems


def _overflowing(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Scale bytes above the rule (not NaN) whose block of 32 codes holds a nonzero magnitude."""
    nonzero = ((packed.unflatten(-1, (-1, mxfp4.BLOCK_SIZE // 2)) & 0x77) != 0).any(-1)
    return (scale > MAX_SCALE_BYTE) & (scale != NAN_BYTE) & nonzero


def _scan_finite(field: str, t: torch.Tensor, chunk_bytes: int) -> list[str]:
    per_expert = []
    step = _experts_per_chunk(t, chunk_bytes)
    for e0 in range(0, t.shape[0], step):
        per_expert.append((~torch.isfinite(t[e0:e0 + step])).flatten(1).sum(1).cpu())
    if not per_expert:
        return []
    counts = torch.cat(per_expert)
    bad = counts.nonzero().flatten().tolist()
    if not bad:
        return []
    e = bad[0]
    first = [int(v) for v in (~torch.isfinite(t[e])).nonzero()[0].tolist()]
    others = f"; {len(bad) - 1} more expert(s) too: {bad[1:9]}" if len(bad) > 1 else ""
    return [f"expert {e} tensor {field} holds {int(counts[e])} non-finite value(s), first "
            f"{float(t[e][tuple(first)])} at {first}{others}"]

"""Peak memory a call allocates beyond what it keeps: CUDA allocator stats, or the CPU allocator's events.

On a GPU the caching allocator counts every byte (`max_memory_allocated`).
The CPU allocator has no such counter; PyTorch's profiler with
`profile_memory=True` records each CPU allocation and free with its size and
time, and their running sum is the allocated bytes at every moment.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PeakMemory:
    device: str
    peak_bytes: int      # most bytes allocated at once during the call, above the start
    retained_bytes: int  # bytes still allocated when it returned (its result), above the start

    @property
    def extra_bytes(self) -> int:
        """Scratch: the peak less what the call returns."""
        return max(0, self.peak_bytes - self.retained_bytes)


def measure_peak(fn: Callable[[], Any], device: torch.device | str) -> tuple[Any, PeakMemory]:
    device = torch.device(device)
    if device.type == "cpu":
        return _measure_cpu(fn)
    return _measure_cuda(fn, device)


def _measure_cuda(fn: Callable[[], Any], device: torch.device) -> tuple[Any, PeakMemory]:
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - start
    retained = torch.cuda.memory_allocated(device) - start
    return result, PeakMemory(str(device), peak, retained)


def _measure_cpu(fn: Callable[[], Any]) -> tuple[Any, PeakMemory]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    deltas = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    level = peak = 0
    for _, nbytes in deltas:
        level += nbytes
        peak = max(peak, level)
    return result, PeakMemory("cpu", peak, level)

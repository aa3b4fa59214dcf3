"""The one timing method: CUDA/HIP graph replay, L2 flushed before each replay, median.

The ceilings (device copy bandwidth, bf16 matmul rate) are measured in the same
run as the kernels they judge. `FakeClock` stands in for the GPU timer where no
GPU exists (CPU tests, emulators): it reports a time given by the caller without
running the callable again, so the tune/bench loops run end to end without a device.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

L2_FLUSH_BYTES = 256 << 20  # larger than any current L2 / Infinity Cache slice the kernels see
DEFAULT_REPS = 25


class GraphTimer:
    """Times a callable as a graph replay, flushing L2 before each replay (median, min)."""

    method = "graph replay, L2 flushed before each replay, median"

    def __init__(self, device=None, reps: int = DEFAULT_REPS, warmup: int = 2):
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device or "cuda")
        self.reps, self.warmup = reps, warmup

    def time(self, fn: Callable[[], object], reps: int | None = None) -> dict:
        reps = reps or self.reps
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):  # compiles, autotunes and allocates outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        del graph
        return {"median_us": statistics.median(times), "min_us": min(times), "reps": reps}


class FakeClock:
    """For runs without a GPU: `clock(label)` gives the time in us of the callable labelled `label`."""

    method = "fake clock (no GPU): times are the test's, not measurements"

    def __init__(self, clock: Callable[[str], float]):
        self.clock = clock
        self.label = ""

    def time(self, fn: Callable[[], object], reps: int | None = None) -> dict:
        # not run: its callers check a callable's output before timing it, and under an interpreter
        # a second run would double their time for a figure the clock makes up anyway
        t = float(self.clock(self.label))
        return {"median_us": t, "min_us": t, "reps": 1}


def copy_bandwidth_gbps(device="cuda", nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy, bytes read plus written per second (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9


def bf16_matmul_tflops(device="cuda", n: int = 8192, reps: int = 10) -> float:
    """A large bf16 matmul on random data (mean of `reps` after 3 warm-ups)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def mxfp4_bytes_per_expert(hidden: int, inter: int) -> int:
    """Packed codes plus e8m0 scales of w13 and w2 of one expert."""
    return 2 * inter * (hidden // 2 + hidden // 32) + hidden * (inter // 2 + inter // 32)


def moe_flops(num_tokens: int, topk: int, hidden: int, inter: int) -> float:
    return 2.0 * num_tokens * topk * (hidden * 2 * inter + inter * hidden)

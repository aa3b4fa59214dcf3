"""Ahead-of-time compilation of the backend's launches, no GPU needed.

`plan_for_shape` builds the launches the backend would run for a shape and a
config on meta tensors (shapes, strides and dtypes without memory);
`compile_launch` compiles one of them for a target such as
("cuda", 90, 32), ("hip", "gfx942", 64) or ("hip", "gfx950", 64) and reads
registers, spills and shared memory back from the compiled artifacts.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass

import torch

from kimi_k3_moe import platform
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.amd_archs import AMD_ARCHS
from kimi_k3_moe.experts import INT4, MXFP4
from kimi_k3_moe.kernels.common.launch import Launch
from kimi_k3_moe.kernels.triton.layout import TritonExperts
from kimi_k3_moe.kernels.triton.table import MoEConfig

TARGETS = {"sm_90": ("cuda", 90, 32), **{a: ("hip", a, t.wave_size) for a, t in AMD_ARCHS.items()}}


def blocks_per_sm(target: str, registers: int, num_warps: int, shared: int) -> int | None:
    """How many blocks of a kernel one SM runs at once (None off NVIDIA: AMD's waves per SIMD
    follow other rules, k3lab/flydsl/artifacts.py). Two or more let one block's decode and
    stores run beside another's MMAs; a large-batch stage 2 that holds one per SM on the H200 leaves
    its tensor cores idle during the decode."""
    lim = platform.SM_LIMITS.get(target)
    if lim is None:
        return None
    per_warp = -(-registers * 32 // lim.register_unit) * lim.register_unit
    by_regs = lim.registers // (per_warp * num_warps) if registers else lim.blocks
    by_shared = lim.shared // (shared + lim.shared_reserved)
    return min(by_regs, by_shared, lim.warps // num_warps, lim.blocks)


def meta_experts(weight_format: str, num_experts: int, hidden: int, inter: int, offsets: bool = False) -> TritonExperts:
    dev = "meta"
    scale_dtype = torch.uint8 if weight_format == MXFP4 else torch.bfloat16

    def side(n, k):
        return (torch.empty(num_experts, n, k // 2, dtype=torch.uint8, device=dev),
                torch.empty(num_experts, n, k // 32, dtype=scale_dtype, device=dev))
    w13, s13 = side(2 * inter, hidden)
    w2, s2 = side(hidden, inter)
    o13 = torch.empty_like(s13) if offsets and weight_format == INT4 else None
    o2 = torch.empty_like(s2) if offsets and weight_format == INT4 else None
    return TritonExperts(weight_format, w13, s13, w2, s2, o13, o2)


def plan_for_shape(experts, num_tokens: int, topk: int, activation: ActivationSpec,
                   config: MoEConfig, *, expert_map: bool = False) -> list[Launch]:
    """TritonExperts -> the launches the backend runs."""
    from kimi_k3_moe.kernels.triton.moe import plan_moe
    dev = experts.device
    hidden = torch.empty(num_tokens, experts.hidden_size, dtype=torch.bfloat16, device=dev)
    ids = torch.empty(num_tokens, topk, dtype=torch.int32, device=dev)
    weights = torch.empty(num_tokens, topk, dtype=torch.float32, device=dev)
    emap = torch.empty(experts.num_experts, dtype=torch.int32, device=dev) if expert_map else None
    out = torch.empty_like(hidden)
    return plan_moe(experts, hidden, weights, ids, activation, emap, out, config)


def _signature(launch: Launch):
    """(signature, constexprs, attrs) as the JIT would specialise these arguments."""
    from triton.runtime.jit import mangle_type
    kernel = launch.kernel
    dns = set(kernel.do_not_specialize) | {kernel.arg_names[i] for i in kernel.do_not_specialize
                                           if isinstance(i, int)}
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = launch.args[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
            continue
        if isinstance(v, torch.Tensor):
            signature[p.name] = mangle_type(v)
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 256-byte aligned
        elif isinstance(v, bool):
            raise TypeError(f"{launch.name}.{p.name}: bool argument not declared constexpr")
        elif isinstance(v, int):
            if p.name in dns:
                signature[p.name] = "i64" if abs(v) >= 2**31 else "i32"
            elif v == 1:
                signature[p.name] = "constexpr"
                constexprs[p.name] = 1
            else:
                signature[p.name] = mangle_type(v, True)
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{launch.name}.{p.name}: cannot type {type(v).__name__}")
    return signature, constexprs, attrs


@dataclass
class CompileReport:
    kernel: str
    target: str
    label: str
    num_warps: int
    num_stages: int
    constexprs: str
    hash: str
    registers: int          # per thread (VGPRs on AMD)
    sgprs: int | None       # AMD scalar registers
    spills: int             # bytes of spill stores (NVIDIA) / spilled registers (AMD)
    stack: int              # stack frame / private segment bytes
    shared: int             # shared memory / LDS bytes
    seconds: float
    blocks_per_sm: int | None = None  # NVIDIA only (blocks_per_sm)

    def row(self) -> dict:
        return asdict(self)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout


def cuda_sass(cubin: bytes) -> str:
    """The SASS of a compiled sm_90 kernel (Triton's cuobjdump)."""
    return _cuobjdump(cubin, "-sass")


def _cuda_resources(cubin: bytes) -> dict:
    text = _cuobjdump(cubin, "--dump-resource-usage")
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k: int(v) for k, v in fields.items()}


def _amd_resources(amdgcn: str) -> dict:
    def one(key):
        m = re.findall(rf"\.{key}:\s*(\d+)", amdgcn)
        return int(m[0]) if m else 0
    return {k: one(k) for k in ("vgpr_count", "sgpr_count", "vgpr_spill_count", "sgpr_spill_count",
                                 "group_segment_fixed_size", "private_segment_fixed_size")}


def compile_launch(launch: Launch, target: str) -> tuple[CompileReport, object]:
    """Compile `launch`'s kernel for `target` (a TARGETS key). Returns the report and the kernel."""
    import time

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = _signature(launch)
    src = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    start = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget(*TARGETS[target]),
                              options=launch.options())
    seconds = time.perf_counter() - start
    md = compiled.metadata
    shown = ",".join(f"{k}={v}" for k, v in constexprs.items())
    if target.startswith("sm_"):
        res = _cuda_resources(compiled.asm["cubin"])
        regs, sgprs = res.get("REG", 0), None
        stack = res.get("STACK", 0) + res.get("LOCAL", 0)
        spills = stack  # ptxas puts spills in the stack frame; these kernels use no local arrays
        shared = max(md.shared, res.get("SHARED", 0))
    else:
        res = _amd_resources(compiled.asm["amdgcn"])
        regs, sgprs = res["vgpr_count"], res["sgpr_count"]
        spills = res["vgpr_spill_count"] + res["sgpr_spill_count"]
        stack = res["private_segment_fixed_size"]
        shared = max(md.shared, res["group_segment_fixed_size"])
    report = CompileReport(launch.name, target, launch.label, launch.num_warps, launch.num_stages, shown,
                           md.hash, regs, sgprs, spills, stack, shared, round(seconds, 2),
                           blocks_per_sm(target, regs, md.num_warps, shared))
    return report, compiled

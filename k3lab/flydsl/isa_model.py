"""A speed MODEL for compiled AMDGPU kernels, read from their ISA text (nothing here ran on AMD).

One wave's critical path is simulated from the kernel body: in-order issue with a
cost per instruction class, the matrix pipe running beside the vector pipe,
`s_waitcnt vmcnt(N)/lgkmcnt(N)` blocking until at most N accesses remain
outstanding, every global access (vector or scalar) completing `latency` cycles
after issue, in order. Loops run their trip count (from the work a wave must do,
counted in MFMAs). A launch then costs

    T0 + max(rounds x max(critical path, resident waves x issue cycles) / clock,
             HBM bytes / (eta x peak))

where `rounds` is how many times the GPU must be filled with workgroups at the
occupancy the registers and LDS allow. T0, the latency and eta are fitted on
published timings (`fit`). Pure Python: no flydsl import.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from k3lab.flydsl import artifacts
from kimi_k3_moe.amd_archs import AMD_ARCHS, GFX942, GFX950, AmdArch

# Issue cycles of one wave64 instruction on a 16-lane SIMD. MFMA: 16 cycles for the bf16
# 16x16x32 (gfx950) and 16x16x16 (gfx942) forms, derived from AMD's published dense bf16
# peaks (MI355X ~2.5 PFLOP/s at 2.4 GHz, MI300X ~1.3 PFLOP/s at 2.1 GHz, 4 SIMDs per CU).
VALU_CYCLES = 4
TRANS_CYCLES = 16
SALU_CYCLES = 1
MFMA_CYCLES = 16
MFMA_ISSUE = 4            # the vector pipe is free again after this; the matrix pipe stays busy
VMEM_CYCLES_PER_DWORD = 4  # address/data path: a dwordx4 wave access moves 1 KiB
LDS_LATENCY = 64          # cycles; LDS is on the CU, far below HBM latency
TRANSCENDENTAL = re.compile(r"^v_(exp|log|rcp|rsq|sqrt|sin|cos)_")

_LABEL = re.compile(r"^([.\w$]+):")
_WAIT = re.compile(r"(vmcnt|lgkmcnt)\((\d+)\)")
_REG = re.compile(r"\b([va])(?:\[(\d+):(\d+)\]|(\d+)\b)")
_DWORDS = re.compile(r"(?:dword|b)(?:x(\d+)|(\d+))?")


@dataclass(frozen=True)
class Instr:
    op: str
    args: str
    target: str | None = None     # branch target label
    cls: str = field(init=False)
    reads: frozenset = field(init=False)    # registers read (only MFMA results are tracked)
    writes: frozenset = field(init=False)

    def __post_init__(self) -> None:
        cls = instr_class(self.op)
        dst, _, rest = self.args.partition(",")
        stores = cls == "vmem" and ("store" in self.op or "atomic" in self.op)
        object.__setattr__(self, "cls", cls)
        object.__setattr__(self, "reads", frozenset(_regs(self.args if stores else rest)))
        object.__setattr__(self, "writes", frozenset(_regs(dst)) if cls == "mfma" else frozenset())


@dataclass(frozen=True)
class Kernel:
    """The instructions of one kernel body, its labels, and its resource directives."""
    name: str
    instrs: tuple[Instr, ...]
    labels: dict
    vgpr: int
    agpr: int
    accum_offset: int | None
    lds_bytes: int
    waves_per_workgroup: int

    def mfma_count(self, start: int = 0, stop: int | None = None) -> int:
        return sum(i.op.startswith(("v_mfma", "v_smfmac")) for i in self.instrs[start:stop])

    def loops(self) -> list[tuple[int, int]]:
        """(first instruction, back-branch index) of every backward branch."""
        return [(self.labels[i.target], n) for n, i in enumerate(self.instrs)
                if i.target is not None and self.labels.get(i.target, n + 1) <= n]


def _field(text: str, pattern: str, default=None):
    m = re.search(pattern, text, re.M)
    return int(m.group(1)) if m else default


def parse(isa: str, name: str | None = None) -> Kernel:
    """The first kernel of an ISA dump (FlyDSL's *_final_isa.s or our build's .s)."""
    instrs: list[Instr] = []
    labels: dict[str, int] = {}
    started = False
    for raw in isa.splitlines():
        line = raw.split(";")[0].split("//")[0].strip()
        if not line:
            continue
        label = _LABEL.match(line)
        if label:
            if not started and not label.group(1).startswith("."):
                started, name = True, name or label.group(1)
            elif started:
                labels[label.group(1)] = len(instrs)
            continue
        if not started or line.startswith("."):
            continue
        op, _, args = line.partition(" ")
        target = args.strip() if op.startswith(("s_cbranch", "s_branch")) else None
        instrs.append(Instr(op, args.strip(), target))
    if not instrs:
        raise ValueError("no kernel body found in the ISA text")
    body_end = max([n for n, i in enumerate(instrs) if i.op == "s_endpgm"], default=len(instrs) - 1)
    instrs = instrs[:body_end + 1]
    return Kernel(
        name=name or "?", instrs=tuple(instrs), labels=labels,
        vgpr=_field(isa, r"^\s*(?:-\s+)?\.vgpr_count:\s+(\d+)", _field(isa, r"\.amdhsa_next_free_vgpr\s+(\d+)", 0)),
        agpr=_field(isa, r"^\s*(?:-\s+)?\.agpr_count:\s+(\d+)", 0),
        accum_offset=_field(isa, r"\.amdhsa_accum_offset\s+(\d+)"),
        lds_bytes=_field(isa, r"\.amdhsa_group_segment_fixed_size\s+(\d+)", 0),
        waves_per_workgroup=max(1, _field(isa, r"^\s*(?:-\s+)?\.max_flat_workgroup_size:\s+(\d+)", 256) // 64))


# ------------------------------------------------------------------ one wave
def instr_class(op: str) -> str:
    if op.startswith(("v_mfma", "v_smfmac")):
        return "mfma"
    if op.startswith(("buffer_", "global_", "flat_", "scratch_")):
        return "vmem"
    if op.startswith(("s_load", "s_buffer_load")):
        return "smem"
    if op.startswith("ds_"):
        return "lds"
    if op.startswith("v_"):
        return "trans" if TRANSCENDENTAL.match(op) else "valu"
    return "salu"


def _regs(text: str) -> set:
    out = set()
    for kind, lo, hi, one in _REG.findall(text):
        first, last = (int(one), int(one)) if one else (int(lo), int(hi))
        out.update((kind, r) for r in range(first, last + 1))
    return out


def _vmem_cycles(op: str) -> int:
    m = _DWORDS.search(op.split("_", 2)[-1])
    if not m or not (m.group(1) or m.group(2)):
        return VMEM_CYCLES_PER_DWORD
    if m.group(1):
        return VMEM_CYCLES_PER_DWORD * int(m.group(1))
    return VMEM_CYCLES_PER_DWORD * max(1, int(m.group(2)) // 32)


@dataclass(frozen=True)
class WaveTime:
    critical: float     # cycles from the first issue to the last completion of one wave
    issue: float        # cycles the wave occupies the SIMD's issue (what other waves cannot use)
    instructions: int


def simulate(kernel: Kernel, latency: float, trips: dict[int, int] | None = None,
             mfma_cycles: int = MFMA_CYCLES) -> WaveTime:
    """One wave through the body. `trips`: back-branch index -> times the loop body runs.

    Forward branches fall through (both sides of a branch are charged: the kernels'
    guards skip little); a backward branch is taken until its loop has run its trips.
    """
    trips = trips or {}
    t = 0.0
    issue = 0.0
    matrix_free = 0.0
    vm: list[float] = []     # completion times of outstanding vector-memory ops, oldest first
    lgkm: list[float] = []
    ready: dict = {}         # register -> cycle its MFMA result is written
    taken: dict[int, int] = {}
    pc, count = 0, 0
    instrs = kernel.instrs
    while pc < len(instrs):
        ins = instrs[pc]
        count += 1
        op = ins.op
        if op == "s_endpgm":
            if pc == len(instrs) - 1:
                break
            pc += 1     # an exit laid out mid-body serves workgroups without work: the modelled wave goes on
            continue
        if op == "s_waitcnt":
            for which, n in _WAIT.findall(ins.args):
                queue = vm if which == "vmcnt" else lgkm
                while len(queue) > int(n):
                    t = max(t, queue.pop(0))
            pc += 1
            continue
        cls = ins.cls
        if ready and cls != "mfma":
            wait = max((ready.get(r, 0.0) for r in ins.reads), default=0.0)
            t = max(t, wait)
        if cls == "mfma":
            start = max(t, matrix_free)
            matrix_free = start + mfma_cycles
            for r in ins.writes:
                ready[r] = matrix_free
            t = start + MFMA_ISSUE
            issue += mfma_cycles
        elif cls in ("valu", "trans"):
            cost = TRANS_CYCLES if cls == "trans" else VALU_CYCLES
            t += cost
            issue += cost
        elif cls == "vmem":
            cost = _vmem_cycles(op)
            t += cost
            issue += cost
            vm.append(max(t + latency, vm[-1] if vm else 0.0))
        elif cls == "smem":
            t += SALU_CYCLES
            issue += SALU_CYCLES
            lgkm.append(max(t + latency, lgkm[-1] if lgkm else 0.0))
        elif cls == "lds":
            t += VALU_CYCLES
            issue += VALU_CYCLES
            lgkm.append(max(t + LDS_LATENCY, lgkm[-1] if lgkm else 0.0))
        else:
            cost = SALU_CYCLES
            if op == "s_nop":
                cost = int(ins.args.split()[0], 0) + 1 if ins.args else 1
            t += cost
            issue += cost
        if ins.target is not None and kernel.labels.get(ins.target, pc + 1) <= pc:
            done = taken.get(pc, 0) + 1
            if done < trips.get(pc, 1):
                taken[pc] = done
                pc = kernel.labels[ins.target]
                continue
            taken[pc] = 0
        pc += 1
    end = max([t, matrix_free] + vm[-1:] + lgkm[-1:])
    return WaveTime(end, issue, count)


def loop_trips(kernel: Kernel, mfma_per_wave: int) -> dict[int, int]:
    """Trip counts that make a wave issue `mfma_per_wave` MFMAs: every loop holding MFMAs
    runs t times with outside + t x inside = mfma_per_wave; loops without MFMAs run once."""
    loops = kernel.loops()
    inside = {end: kernel.mfma_count(start, end + 1) for start, end in loops}
    in_loops = sum(inside.values())
    if not in_loops:
        return {}
    outside = kernel.mfma_count() - in_loops
    t = max(1, round((mfma_per_wave - outside) / in_loops))
    return {end: (t if n else 1) for end, n in inside.items()}


# ------------------------------------------------------------------ one launch
@dataclass(frozen=True)
class Device:
    name: str
    arch: str
    cus: int
    clock_ghz: float
    peak_tbs: float
    simds: int
    mfma_cycles: int = MFMA_CYCLES

    @classmethod
    def of(cls, t: AmdArch) -> Device:
        """The product an arch's traits name, with AMD's published CU count, clock and HBM peak."""
        return cls(t.product, t.arch, t.cus, t.clock_ghz, t.hbm_tbs, t.simds_per_cu, t.mfma_cycles)


DEVICES = {arch: Device.of(t) for arch, t in AMD_ARCHS.items()}
MI355X, MI300X = DEVICES[GFX950.arch], DEVICES[GFX942.arch]


@dataclass(frozen=True)
class Params:
    t0_us: float = 1.0        # per-launch cost beyond the kernel's own work
    latency_ns: float = 600.0  # one global access, issue to data
    eta: float = 0.70          # fraction of peak HBM bandwidth a streaming kernel reaches


@dataclass(frozen=True)
class Launch:
    """One kernel launch: its code, how many workgroups do work, what it moves through HBM."""
    label: str
    kernel: Kernel
    workgroups: int
    hbm_bytes: float
    mfma_per_wave: int


@dataclass(frozen=True)
class LaunchTime:
    us: float
    compute_us: float
    memory_us: float
    rounds: int
    waves_per_simd: int
    critical_us: float


def launch_time(launch: Launch, device: Device, params: Params, wave: WaveTime | None = None) -> LaunchTime:
    k = launch.kernel
    if wave is None:
        wave = simulate(k, params.latency_ns * device.clock_ghz, loop_trips(k, launch.mfma_per_wave),
                        mfma_cycles=device.mfma_cycles)
    occ = artifacts.occupancy(device.arch, vgpr=k.vgpr, agpr=k.agpr, accum_offset=k.accum_offset,
                              lds_bytes=k.lds_bytes, waves_per_workgroup=k.waves_per_workgroup)
    per_cu = max(1, occ["waves_per_simd"] * device.simds // k.waves_per_workgroup)
    slots = device.cus * per_cu
    groups = max(1, launch.workgroups)
    rounds = math.ceil(groups / slots)
    resident = min(occ["waves_per_simd"],
                   math.ceil(min(groups, slots) * k.waves_per_workgroup / (device.cus * device.simds)))
    per_round = max(wave.critical, resident * wave.issue)
    compute = rounds * per_round / (device.clock_ghz * 1e3)
    memory = launch.hbm_bytes / (params.eta * device.peak_tbs * 1e12) * 1e6
    return LaunchTime(params.t0_us + max(compute, memory), compute, memory, rounds, occ["waves_per_simd"],
                      wave.critical / (device.clock_ghz * 1e3))


# ------------------------------------------------------------------ fitting
def _grid(lo: float, hi: float, step: float) -> list[float]:
    return [lo + i * step for i in range(int(round((hi - lo) / step)) + 1)]


def rms_log_error(pred: list[float], measured: list[float]) -> float:
    return math.sqrt(sum(math.log(p / m) ** 2 for p, m in zip(pred, measured)) / len(measured))


def fit(observations: list[tuple[Launch, Device, float]], *, t0=(0.0, 4.0, 0.1), latency=(200.0, 1500.0, 25.0),
        eta=(0.40, 1.00, 0.01)) -> tuple[Params, float]:
    """(T0, latency, eta) minimising the RMS log error over (launch, device, measured us), by grid search.

    The wave simulation depends on the latency only, so it runs once per latency value.
    """
    measured = [m for _, _, m in observations]
    best = (math.inf, Params())
    for lat in _grid(*latency):
        base = Params(0.0, lat, 1.0)
        parts = []
        for launch, device, _ in observations:
            lt = launch_time(launch, device, base)
            parts.append((lt.compute_us, lt.memory_us))
        for e in _grid(*eta):
            core = [max(c, m / e) for c, m in parts]
            for t in _grid(*t0):
                err = rms_log_error([t + c for c in core], measured)
                if err < best[0]:
                    best = (err, Params(round(t, 6), round(lat, 6), round(e, 6)))
    return best[1], best[0]



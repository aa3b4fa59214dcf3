"""What a compiled FlyDSL kernel's ISA shows, beyond the compile report: the K loop's shape (its
waits, its loads, its VALU per weight), the top-k sum's memory ordering, the MFMAs a config must
use, and the occupancy its registers and LDS allow (amd_archs traits).

Pure Python (no flydsl import). The compile report itself (code object metadata, instruction
counts) is kimi_k3_moe/kernels/flydsl/code_object.py; `compile_summary` adds these figures to the
reports of a sweep for the CI checks and the resource table in docs/FLYDSL_RESOURCES.md.
"""
from __future__ import annotations

import re
from pathlib import Path

from kimi_k3_moe.amd_archs import traits
from kimi_k3_moe.kernels.flydsl.code_object import MFMA_RE

REGISTERS_PER_LANE = 512   # unified arch VGPR + AGPR file on gfx90a and later
REGISTER_GRANULE = 8

SCALED_MFMA = "v_mfma_scale_f32_16x16x128_f8f6f4"   # gfx950, fp8/fp4 activations


def expected_mfma(cfg) -> set[str]:
    """The matrix instructions a compiled config must use, and only those."""
    if cfg.stage == 0:            # activation quantization kernel
        return set()
    if cfg.quantized:
        return {SCALED_MFMA}
    return {f"v_mfma_f32_{cfg.mfma}_bf16"}   # the arch's bf16 MFMA (amd_archs traits)

_LABEL_RE = re.compile(r"^(\.LBB\w+):", re.M)
_GLOBAL_LOAD_RE = re.compile(r"^\s*(buffer_load|global_load)\w*\s")
_VMCNT_RE = re.compile(r"^\s*s_waitcnt\s.*vmcnt\((\d+)\)")


def k_loop_self_waits(isa: str) -> list[str]:
    """Where a K loop (a block of MFMAs that branches back to its own label) makes MFMAs wait for
    loads it issued itself in the same pass: `s_waitcnt vmcnt(n)` after its k-th global load with
    n < k, with an MFMA after it in the pass. A pipelined loop waits only for the loads of the pass
    before (at its top, before it issues the next block's) or, rotated by the compiler, for its own
    loads once all of its MFMAs are issued (the next pass computes on them); either way the MFMAs
    never stall on the block being prefetched. Empty: every K loop is pipelined."""
    lines = isa.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL_RE.match(line))}
    found = []
    for end, line in enumerate(lines):
        m = re.match(r"^\s*s_cbranch_\w+\s+(\.LBB\w+)", line)
        start = labels.get(m.group(1)) if m else None
        if start is None or start >= end:
            continue
        body = lines[start + 1:end]
        if not any("v_mfma" in b for b in body):
            continue
        issued = 0
        for i, b in enumerate(body):
            if _GLOBAL_LOAD_RE.match(b):
                issued += 1
            elif (w := _VMCNT_RE.match(b)) and issued and int(w.group(1)) < issued \
                    and any("v_mfma" in later for later in body[i + 1:]):
                found.append(f"loop {m.group(1)}: '{b.strip()}' after {issued} loads of the same pass")
                break
    return found


_STORE_RE = re.compile(r"^(buffer|global)_(store|atomic)")


def token_sum_ordering(isa: str) -> list[str]:
    """What is wrong with a token-summing stage 2's memory ordering (empty: nothing). Its one returning
    `global_atomic_add` (the arrival count) must come after `buffer_wbl2 sc1` (this XCD's L2 written
    back), `s_waitcnt vmcnt(0)` (every store and atomic done) and `s_barrier` (every wave's), in that
    order with no store or atomic between the write-back and the count; and `buffer_inv sc1` must
    come after it, before any global load (reading what other XCDs wrote, not a stale L2 line)."""
    ops = [line.split(";")[0].strip() for line in isa.splitlines()]
    ops = [op for op in ops if op and not op.startswith(".") and not op.endswith(":")]
    counts = [i for i, op in enumerate(ops) if op.startswith("global_atomic_add ") and op.endswith(" sc0")]
    if len(counts) != 1:
        return [f"{len(counts)} returning global_atomic_add, expected the one arrival count"]
    at = counts[0]
    problems = []
    wb = max((i for i, op in enumerate(ops[:at]) if re.match(r"buffer_wbl2\b.*\bsc1\b", op)), default=None)
    if wb is None:
        problems.append("no buffer_wbl2 sc1 before the arrival count")
    else:
        between = ops[wb + 1:at]
        wait = next((i for i, op in enumerate(between) if re.match(r"s_waitcnt\b.*vmcnt\(0\)", op)), None)
        barrier = next((i for i, op in enumerate(between) if op.startswith("s_barrier")), None)
        if wait is None or barrier is None or wait > barrier:
            problems.append("the write-back is not followed by s_waitcnt vmcnt(0) and then s_barrier")
        if any(_STORE_RE.match(op) for op in between):
            problems.append("a store or atomic between the write-back and the arrival count")
    after = ops[at + 1:]
    inv = next((i for i, op in enumerate(after) if re.match(r"buffer_inv\b.*\bsc1\b", op)), None)
    load = next((i for i, op in enumerate(after) if _GLOBAL_LOAD_RE.match(op)), None)
    if inv is None:
        problems.append("no buffer_inv sc1 after the arrival count")
    elif load is not None and load < inv:
        problems.append(f"'{after[load]}' reads before buffer_inv sc1")
    return problems


def k_loop_loads_after_first_barrier(isa: str) -> int:
    """Global loads the K loop issues after its first `s_barrier` (the staged tile's): 0 when every
    load of an iteration is in flight before the wave waits for the tile (a load_first schedule)."""
    body = k_loop_body(isa).splitlines()
    first = next((i for i, line in enumerate(body) if re.match(r"^\s*s_barrier\b", line)), len(body))
    return sum(1 for line in body[first:] if _GLOBAL_LOAD_RE.match(line))


def k_loop_loads_after_first_mfma(isa: str) -> int:
    """Global loads the K loop issues after its first MFMA: 0 when the next block's loads (a
    double-buffered schedule's tile share and weights) are all in flight before this block's MFMAs."""
    body = k_loop_body(isa).splitlines()
    first = next((i for i, line in enumerate(body) if MFMA_RE.search(line)), len(body))
    return sum(1 for line in body[first:] if _GLOBAL_LOAD_RE.match(line))


def k_loop_barriers(isa: str) -> int:
    """`s_barrier`s in the K loop (a double-buffered staged tile needs one per iteration)."""
    return sum(1 for line in k_loop_body(isa).splitlines() if re.match(r"^\s*s_barrier\b", line))


def occupancy(arch: str, *, vgpr: int, agpr: int, accum_offset: int | None, lds_bytes: int,
              waves_per_workgroup: int) -> dict:
    """Waves per SIMD (at most 8) allowed by registers and by LDS on CDNA3/CDNA4.

    Arch VGPRs take [0, accum_offset) of the unified 512-entry file when AGPRs are
    used, AGPRs follow; allocation granule 8. An estimate from the metadata: the
    hardware may round differently, nothing here was measured on a GPU.
    """
    base = accum_offset if (agpr and accum_offset) else vgpr
    regs = max(REGISTER_GRANULE, -(-(base + (agpr or 0)) // REGISTER_GRANULE) * REGISTER_GRANULE)
    t = traits(arch)
    by_regs = min(t.max_waves_per_simd, REGISTERS_PER_LANE // regs)
    if lds_bytes:
        groups = t.lds_bytes // lds_bytes
        by_lds = min(t.max_waves_per_simd, groups * waves_per_workgroup // t.simds_per_cu)
    else:
        by_lds = t.max_waves_per_simd
    return {"registers": regs, "waves_by_regs": by_regs, "waves_by_lds": by_lds,
            "waves_per_simd": min(by_regs, by_lds)}


# --------------------------------------------------------------------- K-loop VALU per 1K weights
_BRANCH_RE = re.compile(r"^\s*s_cbranch_\w+\s+(\.LBB\w+)", re.M)
_VALU_RE = re.compile(r"^\s*(v_\w+)", re.M)


def k_loop_body(isa: str) -> str:
    """The ISA text of the K loop: from a label to the backward branch that closes it.

    The kernels have one runtime loop (the K loop); a backward branch is one whose target
    label comes before it. With several, the one holding MFMAs (there is just one today).
    """
    labels = {m.group(1): m.end() for m in _LABEL_RE.finditer(isa)}
    loops = [isa[labels[m.group(1)]:m.start()] for m in _BRANCH_RE.finditer(isa)
             if m.group(1) in labels and labels[m.group(1)] < m.start()]
    loops = [body for body in loops if MFMA_RE.search(body)]
    if len(loops) != 1:
        raise ValueError(f"expected one K loop with MFMAs in the ISA, found {len(loops)}")
    return loops[0]


def weights_per_iteration(cfg) -> int:
    """Weights one wave streams per K-loop iteration: its weight rows x 128 x kb_unroll."""
    tiles = cfg.tile.n_rep * (2 if cfg.stage == 1 else 1)          # stage 1: gate and up rows
    return tiles * 16 * 128 * cfg.tile.kb_unroll


def valu_per_1k_weights(isa: str, cfg) -> float:
    """VALU instructions per 1024 weights a wave streams through the K loop.

    Counted in the dumped ISA: every `v_` instruction in the K-loop body (`k_loop_body`)
    except the matrix ones (v_mfma*, v_smfmac*: the MFMA pipe), i.e. decode, scaling,
    address arithmetic and moves alike, one per instruction (a packed v_pk_* op counts
    once), divided by `weights_per_iteration(cfg)` / 1024. Issue-slot cost, not cycles.
    """
    body = k_loop_body(isa)
    valu = [m for m in _VALU_RE.findall(body) if not m.startswith(("v_mfma", "v_smfmac"))]
    return len(valu) * 1024 / weights_per_iteration(cfg)


# --------------------------------------------------------------------- a sweep's summary
def with_resources(report: dict, cfg) -> dict:
    """A compile report (build.compile_here) with the occupancy estimate and, for a GEMM stage,
    the K loop's VALU per 1K weights (None when LLVM unrolled the loop away)."""
    isa = Path(report["isa_file"]).read_text()
    meta = report["metadata"]
    valu = {}
    if cfg.stage:
        try:
            valu = {"valu_per_1k_weights": round(valu_per_1k_weights(isa, cfg), 1)}
        except ValueError:   # no single K loop: nothing to count per iteration
            valu = {"valu_per_1k_weights": None}
    occ = occupancy(cfg.arch, vgpr=meta["vgpr_count"], agpr=meta["agpr_count"],
                    accum_offset=report["isa"]["accum_offset"], lds_bytes=meta["group_segment_fixed_size"],
                    waves_per_workgroup=cfg.workgroup_waves)
    return {**report, "isa": {**report["isa"], **valu}, "occupancy": occ}


def compile_summary(results, wall_s: float) -> dict:
    """The summary.json of a compile sweep (build.compile_many's results, their reports given
    `with_resources`): what benchmarks/flydsl_resources.py turns into docs/FLYDSL_RESOURCES.md's table."""
    for r in results:
        if r.report is not None:
            r.report = with_resources(r.report, r.config)
    return {"wall_s": round(wall_s, 1), "kernels": [
        {"name": r.config.name, "status": r.status, "wall_s": round(r.wall_s, 2), "report": r.report,
         "llvm_errors": r.llvm_errors} for r in results]}

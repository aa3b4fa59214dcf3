"""What a compiled FlyDSL kernel is made of: code object, AMDGPU metadata, ISA figures.

Pure Python (no flydsl import): it reads the ELF code object FlyDSL produced,
decodes its NT_AMDGPU_METADATA note (msgpack), counts instructions in the ISA
text, and estimates occupancy from registers and LDS (amd_archs traits). Used by the compile
driver, the CI checks and the resource table in docs/PERF.md.
"""
from __future__ import annotations

import re
import struct

from kimi_k3_moe.amd_archs import traits

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

_MFMA_RE = re.compile(r"^\s*(v_mfma\w*|v_smfmac\w*)\s", re.M)
_SCRATCH_RE = re.compile(r"^\s*scratch_(load|store)\w*\s", re.M)
_INSTR_RE = re.compile(r"^\s*(s_|v_|buffer_|ds_|global_|flat_|scratch_)\w*", re.M)


# --------------------------------------------------------------------- msgpack / ELF
def _msgpack(buf: bytes, i: int = 0):
    """Minimal msgpack decoder: enough for the AMDGPU metadata note."""
    b = buf[i]
    if b <= 0x7F:
        return b, i + 1
    if 0x80 <= b <= 0x8F:
        return _mp_map(buf, i + 1, b & 0x0F)
    if 0x90 <= b <= 0x9F:
        return _mp_array(buf, i + 1, b & 0x0F)
    if 0xA0 <= b <= 0xBF:
        n = b & 0x1F
        return buf[i + 1:i + 1 + n].decode(), i + 1 + n
    if b >= 0xE0:
        return b - 0x100, i + 1
    if b in (0xC0, 0xC2, 0xC3):
        return {0xC0: None, 0xC2: False, 0xC3: True}[b], i + 1
    fixed = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i",
             0xD3: ">q", 0xCA: ">f", 0xCB: ">d"}
    if b in fixed:
        return struct.unpack_from(fixed[b], buf, i + 1)[0], i + 1 + struct.calcsize(fixed[b])
    sized = {0xD9: (">B", "str"), 0xDA: (">H", "str"), 0xDB: (">I", "str"),
             0xC4: (">B", "bin"), 0xC5: (">H", "bin"), 0xC6: (">I", "bin"),
             0xDC: (">H", "arr"), 0xDD: (">I", "arr"), 0xDE: (">H", "map"), 0xDF: (">I", "map")}
    if b not in sized:
        raise ValueError(f"msgpack type byte 0x{b:02x} at {i} is not handled")
    weight_format, kind = sized[b]
    n = struct.unpack_from(weight_format, buf, i + 1)[0]
    o = i + 1 + struct.calcsize(weight_format)
    if kind == "str":
        return buf[o:o + n].decode(), o + n
    if kind == "bin":
        return bytes(buf[o:o + n]), o + n
    return (_mp_array if kind == "arr" else _mp_map)(buf, o, n)


def _mp_array(buf, i, n):
    out = []
    for _ in range(n):
        v, i = _msgpack(buf, i)
        out.append(v)
    return out, i


def _mp_map(buf, i, n):
    out = {}
    for _ in range(n):
        k, i = _msgpack(buf, i)
        out[k], i = _msgpack(buf, i)
    return out, i


def amdgpu_metadata(elf: bytes) -> dict:
    """The decoded NT_AMDGPU_METADATA note (type 32, owner "AMDGPU") of a code object."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not an ELF64 code object")
    e_shoff, = struct.unpack_from("<Q", elf, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", elf, 0x3A)
    for s in range(e_shnum):
        sh = e_shoff + s * e_shentsize
        if struct.unpack_from("<I", elf, sh + 4)[0] != 7:   # SHT_NOTE
            continue
        off, size = struct.unpack_from("<QQ", elf, sh + 0x18)
        p = off
        while p < off + size:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, p)
            name = elf[p + 12:p + 12 + namesz].rstrip(b"\0")
            desc = p + 12 + ((namesz + 3) & ~3)
            if name == b"AMDGPU" and ntype == 32:
                return _msgpack(elf, desc)[0]
            p = desc + ((descsz + 3) & ~3)
    return {}


KERNEL_FIELDS = (".name", ".vgpr_count", ".agpr_count", ".sgpr_count", ".vgpr_spill_count",
                 ".sgpr_spill_count", ".group_segment_fixed_size", ".private_segment_fixed_size",
                 ".max_flat_workgroup_size", ".kernarg_segment_size", ".wavefront_size")


def kernel_metadata(elf: bytes) -> list[dict]:
    meta = amdgpu_metadata(elf)
    target = meta.get("amdhsa.target")
    return [{**{f.lstrip("."): k.get(f) for f in KERNEL_FIELDS}, "target": target}
            for k in meta.get("amdhsa.kernels", [])]


# --------------------------------------------------------------------- ISA text
def isa_stats(isa: str) -> dict:
    mfma: dict[str, int] = {}
    for m in _MFMA_RE.finditer(isa):
        mfma[m.group(1)] = mfma.get(m.group(1), 0) + 1
    accum = re.search(r"\.amdhsa_accum_offset\s+(\d+)", isa)
    return {
        "mfma": mfma,
        "instructions": len(_INSTR_RE.findall(isa)),
        "scratch_instructions": len(_SCRATCH_RE.findall(isa)),
        "accum_offset": int(accum.group(1)) if accum else None,
        "v_exp_f32": len(re.findall(r"^\s*v_exp_f32", isa, re.M)),
        "v_rcp_f32": len(re.findall(r"^\s*v_rcp_f32", isa, re.M)),
        "buffer_atomics": sorted(set(re.findall(r"^\s*(buffer_atomic_\w+)", isa, re.M))),
        "ds_bpermute": len(re.findall(r"^\s*ds_bpermute_b32", isa, re.M)),
        "scaled_mfma_formats": sorted(set(re.findall(r"^\s*v_mfma_scale\w*\s.*?((?:cbsz|blgp):\d.*)$", isa, re.M))),
    }


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
_LABEL_RE = re.compile(r"^(\.LBB\w+):", re.M)
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
    loops = [body for body in loops if _MFMA_RE.search(body)]
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

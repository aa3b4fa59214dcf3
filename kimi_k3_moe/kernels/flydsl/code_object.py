"""What the compile driver reads back from a FlyDSL kernel it compiled: the code object's AMDGPU
metadata (registers, LDS, scratch, spills) and instruction counts of the ISA text.

build.py puts both in its compile report; the tuner skips a kernel that uses scratch. The
metadata is the NT_AMDGPU_METADATA note (owner "AMDGPU") of the ELF code object, a msgpack map,
read with pyelftools and msgpack (the `flydsl` extra). Deeper reading of the ISA (K-loop shape,
occupancy, the speed model) is development tooling: k3lab/flydsl/.
"""
from __future__ import annotations

import io
import re

NT_AMDGPU_METADATA = 32
KERNEL_FIELDS = (".name", ".vgpr_count", ".agpr_count", ".sgpr_count", ".vgpr_spill_count",
                 ".sgpr_spill_count", ".group_segment_fixed_size", ".private_segment_fixed_size",
                 ".max_flat_workgroup_size", ".kernarg_segment_size", ".wavefront_size")

MFMA_RE = re.compile(r"^\s*(v_mfma\w*|v_smfmac\w*)\s", re.M)
_SCRATCH_RE = re.compile(r"^\s*scratch_(load|store)\w*\s", re.M)
_INSTR_RE = re.compile(r"^\s*(s_|v_|buffer_|ds_|global_|flat_|scratch_)\w*", re.M)


def amdgpu_metadata(elf: bytes) -> dict:
    """The decoded NT_AMDGPU_METADATA note of a code object ({} if it has none)."""
    import msgpack
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        code = ELFFile(io.BytesIO(elf))
    except ELFError as exc:
        raise ValueError(f"not an ELF code object ({exc})") from None
    if code.elfclass != 64:
        raise ValueError(f"not an ELF64 code object (ELF{code.elfclass})")
    for section in code.iter_sections():
        if section["sh_type"] != "SHT_NOTE":
            continue
        for note in section.iter_notes():
            if note["n_name"] == "AMDGPU" and note["n_type"] == NT_AMDGPU_METADATA:
                return msgpack.unpackb(note["n_descdata"], raw=False, strict_map_key=False)
    return {}


def kernel_metadata(elf: bytes) -> list[dict]:
    """One dict per kernel of the code object: KERNEL_FIELDS without their dot, and the target."""
    meta = amdgpu_metadata(elf)
    target = meta.get("amdhsa.target")
    return [{**{f.lstrip("."): k.get(f) for f in KERNEL_FIELDS}, "target": target}
            for k in meta.get("amdhsa.kernels", [])]


def isa_stats(isa: str) -> dict:
    """Instruction counts of a kernel's ISA text (scratch instructions: it spills)."""
    mfma: dict[str, int] = {}
    for m in MFMA_RE.finditer(isa):
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

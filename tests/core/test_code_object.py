"""The compile report's code object reader (kernels/flydsl/code_object.py) on ELF files written here:
the AMDGPU metadata note comes back as encoded, and bad input is one clear error. Compiled code
objects are read in tests/flydsl/test_compile.py (against the ISA listing's own copy of the metadata)."""
from __future__ import annotations

import random
import struct

import msgpack
import pytest

from kimi_k3_moe.kernels.flydsl import code_object


def _aligned4(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 4)


def _note(owner: bytes, ntype: int, desc: bytes) -> bytes:
    name = owner + b"\0"
    return struct.pack("<III", len(name), len(desc), ntype) + _aligned4(name) + _aligned4(desc)


def _elf(notes: bytes, elf_class: int = 2) -> bytes:
    """A minimal ELF64 code object: a header, one SHT_NOTE section, the section name table."""
    names = b"\0.note\0.shstrtab\0"
    note_at = 64
    names_at = note_at + len(notes)
    sections_at = names_at + len(names) + (-(names_at + len(names)) % 8)
    ident = b"\x7fELF" + bytes([elf_class, 1, 1, 0x40, 3]) + b"\0" * 7
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, 224, 1, 0, 0, sections_at, 0, 64, 56, 0, 64, 3, 2)
    section = struct.Struct("<IIQQQQIIQQ")
    table = (section.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
             + section.pack(1, 7, 2, 0, note_at, len(notes), 0, 0, 4, 0)          # .note, SHT_NOTE
             + section.pack(7, 3, 0, 0, names_at, len(names), 0, 0, 1, 0))        # .shstrtab
    body = header + notes + names
    return body + b"\0" * (sections_at - len(body)) + table


def _metadata(rng: random.Random) -> dict:
    kernel = {f: rng.randrange(1, 1 << rng.choice((7, 15, 31))) for f in code_object.KERNEL_FIELDS[1:]}
    kernel.update({".name": f"k3moe_s{rng.randrange(3)}_test", ".symbol": "k.kd",
                   ".args": [{".size": 8, ".offset": 8 * i, ".value_kind": "global_buffer"} for i in range(3)]})
    return {"amdhsa.version": [1, 2], "amdhsa.target": "amdgcn-amd-amdhsa--gfx950", "amdhsa.kernels": [kernel]}


def test_the_metadata_note_comes_back_as_encoded():
    rng = random.Random()
    meta = _metadata(rng)
    elf = _elf(_note(b"GNU", 3, b"\x01" * 20) + _note(b"AMDGPU", 32, msgpack.packb(meta)))
    assert code_object.amdgpu_metadata(elf) == meta
    kernel, = code_object.kernel_metadata(elf)
    assert kernel["target"] == "amdgcn-amd-amdhsa--gfx950"
    assert kernel["vgpr_count"] == meta["amdhsa.kernels"][0][".vgpr_count"] and kernel["name"].startswith("k3moe_")
    assert set(kernel) == {f.lstrip(".") for f in code_object.KERNEL_FIELDS} | {"target"}


def test_a_code_object_without_the_note_has_no_kernels():
    assert code_object.kernel_metadata(_elf(_note(b"AMDGPU", 31, b"\0" * 4))) == []


@pytest.mark.parametrize("data, says", [(b"MZ\x90\x00" + b"\0" * 60, "not an ELF code object"),
                                        (_elf(b"", elf_class=1), "not an ELF64 code object")])
def test_bad_input_is_one_clear_error(data, says):
    with pytest.raises(ValueError, match=says):
        code_object.amdgpu_metadata(data)


def test_isa_counts_see_scratch_and_mfma():
    isa = ("\tv_mfma_f32_16x16x32_bf16 a[0:3], v[0:3], v[4:7], a[0:3]\n"
           "\tscratch_store_dword off, v1, s0\n\tscratch_load_dword v2, off, s0\n\ts_endpgm\n"
           "\t.amdhsa_accum_offset 64\n")
    stats = code_object.isa_stats(isa)
    assert stats["mfma"] == {"v_mfma_f32_16x16x32_bf16": 1}
    assert stats["scratch_instructions"] == 2 and stats["instructions"] == 4 and stats["accum_offset"] == 64

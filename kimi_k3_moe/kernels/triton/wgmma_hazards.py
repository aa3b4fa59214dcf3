"""Register hazards of in-flight wgmmas, read from sm_90 SASS.

A wgmma whose A operand is in registers (HGMMA R.., R.., gdesc) reads those registers after it issues,
until a WARPGROUP.DEPBAR retires its group; ptxas allocates registers from the PTX's own liveness, and
Triton's wait keeps 16-bit operands alive as 16-bit halves, not as the 32-bit registers the wgmma reads.
So a kernel that keeps such wgmmas in flight while it computes the next operands can have ptxas put new
values in registers a pending wgmma still reads (docs/TRITON.md, "Warp-specialised stages"). This
module finds such writes in every loop that issues HGMMAs: the kernels must have none.
"""
from __future__ import annotations

import re

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_HEX = re.compile(r"0x([0-9a-f]+)")
# opcodes whose first operand is not a general register they write
_NO_DEST = {"ST", "STS", "STG", "STL", "BAR", "SYNCS", "BRA", "WARPGROUP", "FENCE", "MEMBAR", "RED", "ATOM",
            "LDGSTS", "ARRIVES", "EXIT", "RET", "NOP", "DEPBAR", "ERRBAR", "CCTL", "WARPSYNC", "BSYNC", "BSSY",
            "YIELD", "CALL", "LDGDEPBAR", "HGMMA"}


def _instructions(sass: str) -> list[tuple[int, str, str]]:
    return [(int(a, 16), op, args.strip()) for a, op, args in _INSTR.findall(sass)]


def _written(op: str, args: str) -> set[int]:
    """The general registers an instruction writes: its first register operand, after at most one
    predicate it also writes (SHFL's, LOP3's), and the registers a wide result takes after it."""
    m = re.match(r"(?:U?P(?:T|\d+),\s*)?R(\d+)\b", args)
    if not m or op.split(".")[0] in _NO_DEST:
        return set()
    last = op.rsplit(".", 1)[-1]
    if op.startswith("LDSM") and last in ("2", "4"):
        width = int(last)
    elif ".128" in op:
        width = 4
    elif ".64" in op or op.startswith(("CS2R", "IMAD.WIDE")) or op.endswith(".U64") and op.startswith("F2I"):
        width = 2
    else:
        width = 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def wgmma_hazards(sass: str) -> list[str]:
    """Writes to a register that an issued, not yet retired HGMMA reads as its A operand, in each loop
    (a backward branch) that issues HGMMAs, followed over two trips so a write in one trip to the
    previous trip's operands counts. Empty when there are none."""
    ins = _instructions(sass)
    found = set()
    for addr, op, args in ins:
        target = _HEX.search(args) if op == "BRA" else None
        if target is None or int(target.group(1), 16) >= addr:
            continue
        body = [x for x in ins if int(target.group(1), 16) <= x[0] <= addr]
        if not any(o.startswith("HGMMA") for _, o, _ in body):
            continue
        groups: list[set[int]] = []  # committed groups in flight, oldest first
        open_group: set[int] = set()
        for _ in range(2):
            for a, o, arg in body:
                if o.startswith("HGMMA"):
                    operand = arg.split(",")[1].strip()
                    if operand.startswith("R"):  # four registers: 8 bf16 / 16 fp8 of A per thread
                        open_group |= set(range(int(operand[1:]), int(operand[1:]) + 4))
                    if "gsb0" in arg:
                        groups.append(open_group)
                        open_group = set()
                elif o.startswith("WARPGROUP.DEPBAR"):
                    keep = int(_HEX.search(arg).group(1), 16)
                    groups = groups[len(groups) - keep:] if keep else []
                else:
                    hit = _written(o, arg) & set().union(open_group, *groups)
                    if hit:
                        found.add(f"{a:#06x} {o} {arg} writes R{min(hit)} while a wgmma reads it")
    return sorted(found)

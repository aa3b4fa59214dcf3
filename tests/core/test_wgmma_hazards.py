"""kernels/triton/wgmma_hazards.py on SASS written by hand (the compile suite runs it on the real kernels):
a register an issued HGMMA reads as its A operand must not be written before a WARPGROUP.DEPBAR retires
that HGMMA's group, also across the loop's back edge."""
from kimi_k3_moe.kernels.triton.wgmma_hazards import wgmma_hazards


def _sass(*lines: str) -> str:
    """cuobjdump's layout: /*addr*/ instruction ; /* encoding */, then the encoding's second word."""
    out = []
    for n, line in enumerate(lines):
        out.append(f"        /*{n * 16:04x}*/                   {line} ;   /* 0x0000000000000000 */")
        out.append("                                                        /* 0x0000000000000000 */")
    return "\n".join(out)


LOOP = ("LDSM.16.M88.2 R88, [R20+0x18000]",        # 0x00: this step's words, two registers
        "HMUL2.BF16_V2 R90, R88, R98",             # 0x10: decoded: R88..R91 are the A operand
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR4], R24, gsb0",
        "{wait}",
        "BAR.SYNC.DEFER_BLOCKING 0x0, 0x100",
        "@P0 BRA 0x0")


def _loop(wait: str) -> str:
    return _sass(*(line.format(wait=wait) for line in LOOP))


def test_a_step_that_leaves_its_wgmma_in_flight_across_the_back_edge_overwrites_its_operand():
    found = wgmma_hazards(_loop("WARPGROUP.DEPBAR.LE gsb0, 0x1"))
    assert found and all("R88" in f or "R90" in f for f in found), found
    assert any(f.startswith("0x0000 LDSM") for f in found), found


def test_waiting_for_every_group_before_the_next_step_is_safe():
    assert wgmma_hazards(_loop("WARPGROUP.DEPBAR.LE gsb0, 0x0")) == []


def test_two_steps_on_their_own_registers_are_safe_with_one_group_in_flight():
    step = ("LDSM.16.M88.2 R{r}, [R20+0x18000]", "HMUL2.BF16_V2 R{r2}, R{r}, R98", "WARPGROUP.ARRIVE",
            "HGMMA.64x128x16.F32.BF16 R24, R{r}, gdesc[UR4], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x1")
    body = [s.format(r=88, r2=90) for s in step] + [s.format(r=92, r2=94) for s in step] + ["@P0 BRA 0x0"]
    assert wgmma_hazards(_sass(*body)) == []


def test_shared_memory_operands_and_stores_are_not_writes():
    sass = _sass("WARPGROUP.ARRIVE", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24, gsb0",
                 "STS.128 [R88], R4", "MOV R88, R5", "WARPGROUP.DEPBAR.LE gsb0, 0x1", "@P0 BRA 0x0")
    assert wgmma_hazards(sass) == []


def test_a_loop_without_wgmmas_is_not_checked():
    assert wgmma_hazards(_sass("MOV R88, R5", "IADD3 R1, R1, 0x1, RZ", "@P0 BRA 0x0")) == []


def test_a_register_written_after_a_predicate_counts():
    """SHFL and LOP3 may write a predicate first and the register second; a compare writes none."""
    def between(write):
        return _sass("WARPGROUP.ARRIVE", "HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR4], R24, gsb0", write,
                     "WARPGROUP.DEPBAR.LE gsb0, 0x0", "@P0 BRA 0x0")
    assert wgmma_hazards(between("SHFL.IDX PT, R89, R5, RZ, 0x1f"))
    assert wgmma_hazards(between("LOP3.LUT P0, R90, R0, 0xff, RZ, 0xc0, !PT"))
    assert wgmma_hazards(between("ISETP.GE.AND P0, PT, R89, R2, PT")) == []

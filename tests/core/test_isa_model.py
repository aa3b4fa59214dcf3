"""The ISA speed model on hand-written ISA: waits, overlap, MFMA issue, loops, occupancy, the fit."""
from __future__ import annotations

import pytest

from k3lab.flydsl import isa_model as m

LOAD = "buffer_load_dword v1, v0, s[0:3], 0 offen"
MFMA = "v_mfma_f32_16x16x32_bf16 v[0:3], v[4:7], v[8:11], v[0:3]"


def kernel(*body: str, vgpr: int = 32, agpr: int = 0, lds: int = 0, threads: int = 256) -> m.Kernel:
    text = "\n".join([
        '\t.amdgcn_target "amdgcn-amd-amdhsa--gfx950"', "\t.text", "k:",
        *("\t" + line if not line.endswith(":") else line for line in body),
        ".Lfunc_end0:", "\t.amdhsa_kernel k", f"\t\t.amdhsa_group_segment_fixed_size {lds}",
        f"\t\t.amdhsa_accum_offset {vgpr}", "\t.end_amdhsa_kernel", "---", "amdhsa.kernels:",
        f"  - .agpr_count:     {agpr}", f"    .max_flat_workgroup_size: {threads}", f"    .vgpr_count:     {vgpr}",
        "..."])
    return m.parse(text)


def test_parse_reads_body_and_resources():
    k = kernel("s_mov_b32 s0, 0", LOAD, "s_endpgm", vgpr=96, agpr=16, lds=8192, threads=128)
    assert [i.op for i in k.instrs] == ["s_mov_b32", "buffer_load_dword", "s_endpgm"]
    assert (k.vgpr, k.agpr, k.accum_offset, k.lds_bytes, k.waves_per_workgroup) == (96, 16, 96, 8192, 2)


def test_wait_right_after_a_load_costs_the_latency():
    w = m.simulate(kernel(LOAD, "s_waitcnt vmcnt(0)", "s_endpgm"), latency=1000)
    assert w.critical == m.VMEM_CYCLES_PER_DWORD + 1000


def test_independent_loads_overlap_and_waits_count_outstanding():
    four = [LOAD] * 4
    together = m.simulate(kernel(*four, "s_waitcnt vmcnt(0)", "s_endpgm"), latency=1000).critical
    assert together == 4 * m.VMEM_CYCLES_PER_DWORD + 1000
    serial = m.simulate(kernel(*[x for ld in four for x in (ld, "s_waitcnt vmcnt(0)")], "s_endpgm"),
                        latency=1000).critical
    assert serial == 4 * (m.VMEM_CYCLES_PER_DWORD + 1000)
    # vmcnt(3) after four loads waits for the oldest only: 300 VALU after it run before the rest land
    early = m.simulate(kernel(*four, "s_waitcnt vmcnt(3)", *["v_mov_b32 v9, 0"] * 300, "s_endpgm"), latency=1000)
    assert early.critical == m.VMEM_CYCLES_PER_DWORD + 1000 + 300 * m.VALU_CYCLES


def test_wide_loads_and_lds_and_scalar_waits():
    w = m.simulate(kernel("buffer_load_dwordx4 v[0:3], v8, s[0:3], 0 offen", "s_waitcnt vmcnt(0)", "s_endpgm"), 500)
    assert w.critical == 4 * m.VMEM_CYCLES_PER_DWORD + 500
    w = m.simulate(kernel("ds_read_b128 v[0:3], v8", "s_waitcnt lgkmcnt(0)", "s_endpgm"), 500)
    assert w.critical == m.VALU_CYCLES + m.LDS_LATENCY
    w = m.simulate(kernel("s_load_dwordx2 s[4:5], s[0:1], 0x0", "s_waitcnt lgkmcnt(0)", "s_endpgm"), 500)
    assert w.critical == m.SALU_CYCLES + 500


def test_mfma_issue_cycles_add_up_and_valu_overlaps_them():
    assert m.simulate(kernel(*[MFMA] * 5, "s_endpgm"), 0).critical == 5 * m.MFMA_CYCLES
    # VALU work beside the matrix pipe costs nothing extra while it fits under the MFMAs
    mixed = [x for _ in range(5) for x in (MFMA, "v_add_u32_e32 v20, v21, v22")]
    assert m.simulate(kernel(*mixed, "s_endpgm"), 0).critical == 5 * m.MFMA_CYCLES
    # reading an MFMA result waits for it
    read = m.simulate(kernel(MFMA, "v_add_f32_e32 v20, v0, v1", "s_endpgm"), 0).critical
    assert read == m.MFMA_CYCLES + m.VALU_CYCLES


def test_valu_transcendental_salu_and_nop_costs():
    w = m.simulate(kernel("v_mov_b32 v0, 0", "v_add_f32_e32 v1, v0, v0", "v_exp_f32_e32 v2, v1",
                          "s_add_u32 s0, s0, 1", "s_nop 3", "s_endpgm"), 0)
    assert w.critical == 2 * m.VALU_CYCLES + m.TRANS_CYCLES + m.SALU_CYCLES + 4
    assert w.issue == w.critical


def test_loops_run_the_trips_the_work_needs():
    k = kernel("s_mov_b32 s4, 0", ".LBB0_1:", LOAD, "s_waitcnt vmcnt(0)", MFMA, MFMA, "s_add_u32 s4, s4, 1",
               "s_cmp_lg_u32 s4, 7", "s_cbranch_scc1 .LBB0_1", MFMA, "s_endpgm")
    trips = m.loop_trips(k, mfma_per_wave=15)     # 1 outside + 7 x 2 inside
    assert list(trips.values()) == [7]
    (branch,) = trips
    once, twice, seven = (m.simulate(k, 1000, {branch: n}).critical for n in (1, 2, 7))
    assert twice - once >= 1000 + 2 * m.MFMA_CYCLES      # each trip waits for its load
    assert seven - once == 6 * (twice - once)


def test_occupancy_rounds_from_registers_and_lds():
    dev = m.MI355X
    fat = kernel("s_endpgm", vgpr=128)              # 512 / 128 = 4 waves per SIMD -> 4 workgroups of 4 waves per CU
    t = m.launch_time(m.Launch("x", fat, workgroups=2 * 4 * dev.cus, hbm_bytes=0, mfma_per_wave=0), dev, m.Params())
    assert (t.waves_per_simd, t.rounds) == (4, 2)
    thin = kernel("s_endpgm", vgpr=64)              # 8 waves per SIMD: one round
    t = m.launch_time(m.Launch("x", thin, workgroups=2 * 4 * dev.cus, hbm_bytes=0, mfma_per_wave=0), dev, m.Params())
    assert (t.waves_per_simd, t.rounds) == (8, 1)
    lds = kernel("s_endpgm", vgpr=64, lds=80 * 1024)  # two workgroups fit the 160 KiB of a gfx950 CU
    t = m.launch_time(m.Launch("x", lds, workgroups=4 * dev.cus, hbm_bytes=0, mfma_per_wave=0), dev, m.Params())
    assert (t.waves_per_simd, t.rounds) == (2, 2)


def test_launch_time_is_the_larger_of_compute_and_memory_plus_t0():
    dev, p = m.MI300X, m.Params(t0_us=2.0, latency_ns=500.0, eta=0.5)
    k = kernel(LOAD, "s_waitcnt vmcnt(0)", "s_endpgm")
    small = m.launch_time(m.Launch("x", k, 1, 0, 0), dev, p)
    assert small.us == pytest.approx(2.0 + (4 + 500 * dev.clock_ghz) / (dev.clock_ghz * 1e3))
    big = m.launch_time(m.Launch("x", k, 1, 5.3e9, 0), dev, p)    # 5.3 GB at half of 5.3 TB/s: 2 ms
    assert big.us == pytest.approx(2.0 + 2000.0)


def test_fit_recovers_known_constants():
    dev, truth = m.MI355X, m.Params(t0_us=1.5, latency_ns=700.0, eta=0.8)
    chain = kernel(*[x for _ in range(6) for x in (LOAD, "s_waitcnt vmcnt(0)")], "s_endpgm")
    stream = kernel(*[LOAD] * 8, "s_waitcnt vmcnt(0)", "s_endpgm")
    launches = [m.Launch("chain", chain, 64, 1e5, 0), m.Launch("chain big", chain, 40 * dev.cus * 8, 1e6, 0),
                m.Launch("tiny", stream, 1, 0, 0), m.Launch("stream", stream, 1024, 2e9, 0),
                m.Launch("stream 2", stream, 1024, 8e8, 0), m.Launch("mid", chain, 512, 3e7, 0)]
    obs = [(x, dev, m.launch_time(x, dev, truth).us) for x in launches]
    params, err = m.fit(obs)
    assert err < 1e-3
    assert params.t0_us == pytest.approx(truth.t0_us, abs=0.11)
    assert params.latency_ns == pytest.approx(truth.latency_ns, abs=26)
    assert params.eta == pytest.approx(truth.eta, abs=0.011)

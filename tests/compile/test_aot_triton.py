"""Every kernel specialisation the tables (and the heuristic) can launch compiles for
sm_90, gfx942 and gfx950; registers, spills and shared memory are read from the
compiled artifacts and recorded for all of them. A spill fails the test wherever
that config can run: a device's table runs on that vendor's targets (the H200
table on sm_90) and each section of it is judged under the Triton it was tuned with
(the section's version; `make test-compile-triton` runs the suite under each section's
Triton too), the heuristic everywhere. The Makefile also runs it for sm_90 under the
engines' users' Triton (3.8): every entry must compile there, and its spills are reported,
failing only for entries tuned with that Triton (an entry served under another Triton is
spill-checked at lookup, on the user's machine: kernels/triton/table.py). The H200 table compiled for gfx942 and
gfx950 (a portability check: AMD devices never load it) must compile; its spills
there are recorded and printed, not failed.

Each (kernel, constexprs, warps, stages) compiles once per target, in worker
processes (an LLVM abort takes down a worker, not the suite). The report lands
in build/aot_triton_report.json (and build/aot_triton_report_<triton>.json for the sm_90 reruns).
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from importlib import resources
from pathlib import Path

import pytest

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.kernels.triton import table as tt
from kimi_k3_moe.platform import SHARED_PER_BLOCK

# the Makefile's second run (a table's own Triton) builds for that table's vendor only
TARGETS = tuple(os.environ.get("KIMI_K3_MOE_AOT_TARGETS", "sm_90,gfx942,gfx950").split(","))
SITU = ("situv2", 4.0, 25.0)
REPORT = Path(os.environ.get("KIMI_K3_MOE_AOT_REPORT", "build/aot_triton_report.json"))
WORKERS = int(os.environ.get("KIMI_K3_MOE_AOT_WORKERS", "2"))
TABLES = Path(str(resources.files("kimi_k3_moe.configs").joinpath("tables")))


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def same_triton(origin: str) -> bool:
    """Whether this run's Triton is the one a table section was tuned with (heuristics: any).

    Register allocation moves between Triton releases (an H200 entry tuned under 3.6 spills 8-88
    bytes under 3.9), so a section's entries are judged for spills under its own Triton; the Makefile
    runs this suite again under each section's Triton (`test-compile-triton`)."""
    import triton
    return origin.startswith("heuristic") or origin.split()[1] == _minor(triton.__version__)


def runs_on(target: str, origin: str) -> bool:
    """Whether a config of this origin is what the lookup returns on a `target` device."""
    if origin.startswith("heuristic-hip"):
        return not target.startswith("sm_")
    if origin.startswith("heuristic"):
        return target.startswith("sm_")
    device = origin.split()[0][len("triton_"):]
    return device.startswith("nvidia") == target.startswith("sm_")


def table_configs():
    """(weight_format, E, H, I, MoEConfig, origin) for every tier of every shipped table, plus the heuristic."""
    out = []
    for path in sorted(TABLES.glob("triton_*.json")):
        table = json.loads(path.read_text())
        for version, section in table["tritons"].items():
            for key, entry in section["entries"].items():
                weight_format, e, n, k = tt.parse_shape_key(key)
                for tier, cfg in entry["tiers"].items():
                    out.append((weight_format, e, k, n // 2, tt.MoEConfig.from_json(cfg),
                                f"{path.stem} {version} {key} T{tier}"))
    for weight_format in ("mxfp4", "int4"):
        for e, h, i in ((896, 3584, 384), (896, 3584, 192)):
            for t in (1, 64, 512, 2048, 16384):
                for is_cuda in (True, False):  # the heuristic differs per vendor (LDS size)
                    out.append((weight_format, e, h, i, tt.heuristic_config(h, i, t, is_cuda=is_cuda),
                                f"heuristic{'' if is_cuda else '-hip'} T{t}"))
    return out


def _specs(target: str, weight_format, e, h, i, cfg, act=SITU, offsets=False):
    from kimi_k3_moe.kernels.triton.aot import meta_experts, plan_for_shape
    cfg = cfg.for_target(target.startswith("sm_"))
    return plan_for_shape(meta_experts(weight_format, e, h, i, offsets=offsets), 64, 16, ActivationSpec(*act), cfg)


def _key(launch, target):
    return (target, launch.name, tuple(sorted(launch.constexprs().items())), launch.num_warps, launch.num_stages)


def _compile_one(job):
    target, weight_format, e, h, i, cfg_json, act, offsets, index, gate, origin = job
    from kimi_k3_moe.kernels.triton.aot import compile_launch
    launch = _specs(target, weight_format, e, h, i, tt.MoEConfig.from_json(cfg_json), act, offsets)[index]
    try:
        report, _ = compile_launch(launch, target)
        return {**report.row(), "gated": gate, "origin": origin}
    except Exception as exc:  # reported per kernel; the test fails on it
        return {"kernel": launch.name, "target": target, "label": launch.label, "origin": origin,
                "error": f"{type(exc).__name__}: {exc}"[-600:]}


def collect_jobs():
    jobs = {}
    for target in TARGETS:
        for weight_format, e, h, i, cfg, origin in table_configs():
            gate = runs_on(target, origin)
            if origin.startswith("heuristic") and not gate:
                continue  # the other vendor's heuristic never runs on this target
            # int4 offsets add a load and an FMA per group; compiled for the heuristic configs
            # (what an untuned device runs) to keep CI's compile time modest
            offsets = weight_format == "int4" and origin.startswith("heuristic")
            variants = [(SITU, False)] + ([(SITU, True)] if offsets else [])
            for act, offsets in variants:
                for index, launch in enumerate(_specs(target, weight_format, e, h, i, cfg, act, offsets)):
                    key = _key(launch, target)
                    gated = gate and same_triton(origin)
                    if key not in jobs or (gated and not jobs[key][-2]):
                        jobs[key] = (target, weight_format, e, h, i, cfg.to_json(), act, offsets, index, gated, origin)
    return list(jobs.values())


@pytest.fixture(scope="module")
def compiled():
    jobs = collect_jobs()
    with ProcessPoolExecutor(max_workers=WORKERS) as pool:
        rows = list(pool.map(_compile_one, jobs))
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(rows, indent=1))
    print(f"\n{len(rows)} kernel specialisations compiled; report in {REPORT}")
    for target in TARGETS:
        mine = [r for r in rows if r["target"] == target and "error" not in r]
        gated = [r for r in mine if r["gated"]]
        if mine:
            print(f"  {target}: {len(mine)} kernels ({len(gated)} that run there), registers max "
                  f"{max(r['registers'] for r in mine)}, shared max {max(r['shared'] for r in mine)} B, "
                  f"spilled kernels: {sum(1 for r in gated if r['spills'])} of those that run there, "
                  f"{sum(1 for r in mine if r['spills'] and not r['gated'])} on another target or under another "
                  f"Triton than the entry was tuned with (recorded only)")
    return rows


def test_the_expected_triton_runs():
    """The Makefile's second run puts the tables' Triton first on the path; this checks it took."""
    import triton
    want = os.environ.get("KIMI_K3_MOE_AOT_EXPECT_TRITON")
    if want:
        assert _minor(triton.__version__) == _minor(want), (triton.__version__, want)


def test_every_specialisation_compiles_for_every_target(compiled):
    errors = [r for r in compiled if "error" in r]
    assert not errors, "\n".join(f"{r['target']} {r['label']}: {r['error']}" for r in errors)
    assert {r["target"] for r in compiled} == set(TARGETS)


def test_no_spills_and_shared_memory_fits(compiled):
    ok = [r for r in compiled if "error" not in r and r["gated"]]
    spilled = [r for r in ok if r["spills"]]
    assert not spilled, "\n".join(f"{r['target']} {r['label']} {r['constexprs']} warps={r['num_warps']}: "
                                  f"{r['spills']} spilled, {r['registers']} registers" for r in spilled)
    too_big = [r for r in ok if r["shared"] > SHARED_PER_BLOCK[r["target"]]]
    assert not too_big, [(r["target"], r["label"], r["shared"]) for r in too_big]
    # every kernel reported what it uses
    assert all(r["registers"] > 0 for r in ok)


def test_the_package_declares_bf16_activations_only():
    """The fp8 kernels were removed (kernels/triton/__init__.py says why): nothing else is built."""
    from kimi_k3_moe.kernels.triton import supported_act_dtypes
    assert all(supported_act_dtypes(target) == ("bf16",) for target in TARGETS)


def test_activation_and_betas_cannot_share_a_binary():
    """ACT is compiled in (silu, situv2, situv2 without linear beta: three binaries); the betas are
    fp32 runtime arguments, so two beta pairs run the same binary with their own values and can
    never be served by a binary built for other betas (K3_FACTS defect class 2)."""
    from kimi_k3_moe.kernels.triton.aot import _signature, compile_launch
    cfg_small = tt.heuristic_config(3584, 384, 1, is_cuda=True)
    cfg_big = tt.heuristic_config(3584, 384, 4096, is_cuda=True)
    def stage1(cfg, act):
        return next(l for l in _specs("sm_90", "mxfp4", 896, 3584, 384, cfg, act)
                    if l.label in ("stage1.gemv", "stage1.aligned"))

    for cfg in (cfg_small, cfg_big):
        hashes = {}
        for act in (("silu", None, None), ("situv2", 4.0, 25.0), ("situv2", 4.0, None)):
            launch = stage1(cfg, act)
            signature, constexprs, _ = _signature(launch)
            assert signature["beta"] == "fp32" and signature["linear_beta"] == "fp32"
            assert "beta" not in constexprs and "linear_beta" not in constexprs
            report, _ = compile_launch(launch, "sm_90")
            hashes[act] = (constexprs["ACT"], report.hash)
        assert len({h for _, h in hashes.values()}) == 3, hashes
        assert len({a for a, _ in hashes.values()}) == 3, hashes
        a = stage1(cfg, ("situv2", 4.0, 25.0))
        b = stage1(cfg, ("situv2", 2.0, 1.5))
        assert (a.args["beta"], a.args["linear_beta"]) == (4.0, 25.0)
        assert (b.args["beta"], b.args["linear_beta"]) == (2.0, 1.5)
        assert _signature(a) == _signature(b)  # same binary, betas passed at launch


def test_pdl_kernels_wait_for_their_predecessor_on_sm90_only():
    """A pdl config's kernels carry griddepcontrol (let the next launch start, wait for the one
    before) for sm_90; for AMD the config loses pdl before planning (for_target), so none is built."""
    from kimi_k3_moe.kernels.triton.aot import compile_launch
    cfg = tt.MoEConfig("direct", 16, tt.KernelConfig(32, 256, order=tt.KOrder.STACKED),
                       tt.KernelConfig(64, 128, order=tt.KOrder.PAIRS, n_tiles=2), "ptx", pdl=True)
    for target in ("sm_90", "gfx942"):
        launches = _specs(target, "mxfp4", 896, 3584, 384, cfg)
        assert [l.pdl for l in launches] == ([False] + [True] * 3 if target == "sm_90" else [False] * 4)
        s1 = next(l for l in launches if l.label == "stage1.aligned")
        _, kernel = compile_launch(s1, target)
        code = kernel.asm["ptx" if target == "sm_90" else "amdgcn"]
        assert ("griddepcontrol.wait" in code and "griddepcontrol.launch_dependents" in code) == (target == "sm_90")


@pytest.mark.parametrize("weight_format,block_n,mma", [("mxfp4", 32, "wgmma"), ("int4", 32, "wgmma"),
                                                        ("mxfp4", 16, "mma.sync")])
def test_the_split_stage1_compiles_for_sm90_without_spills(weight_format, block_n, mma):
    """The split stage 1 (K in 7 parts, EP16's expert map, on both stage 2s) compiles for sm_90 under the
    running Triton: no spills, its MMA on the tensor cores (a 64-row stacked tile is a wgmma, a 32-row one
    mma.sync), one atomic (the ticket) and the PDL instructions."""
    from kimi_k3_moe.kernels.triton.aot import compile_launch, meta_experts, plan_for_shape
    s1 = tt.KernelConfig(block_n, 256, 4, 3, order=tt.KOrder.STACKED, k_split=7)
    for cfg in (tt.MoEConfig("split", 16, s1, tt.KernelConfig(8, 128, 4, 2), "ptx", pdl=True),
                tt.MoEConfig("direct", 16, s1, tt.KernelConfig(64, 128, order=tt.KOrder.PAIRS), "ptx", pdl=True)):
        launches = plan_for_shape(meta_experts(weight_format, 56, 3584, 3072), 16, 16, ActivationSpec(*SITU), cfg,
                                  expert_map=True)
        split = next(lc for lc in launches if lc.label == "stage1.split")
        report, kernel = compile_launch(split, "sm_90")
        ptx = kernel.asm["ptx"]
        assert report.spills == 0 and mma in ptx and ptx.count("atom.") == 1, report.row()
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


def test_blocks_per_sm_follows_cudas_occupancy_rules():
    from kimi_k3_moe.kernels.triton.aot import blocks_per_sm
    assert blocks_per_sm("sm_90", 255, 8, 194 * 1024) == 1      # registers and shared memory both allow one
    assert blocks_per_sm("sm_90", 127, 8, 52 * 1024) == 2       # 128 per thread after rounding: two
    assert blocks_per_sm("sm_90", 129, 8, 1024) == 1            # 136 per thread: one
    assert blocks_per_sm("sm_90", 124, 4, 40 * 1024) == 4       # 128 x 128 x 4 = the register file
    assert blocks_per_sm("sm_90", 32, 4, 0) == 16               # 64 warps per SM
    assert blocks_per_sm("sm_90", 32, 1, 0) == 32               # 32 blocks per SM
    assert blocks_per_sm("sm_90", 64, 4, 113 * 1024) == 2       # 2 x (113 + 1 reserved) KB = 228 KB
    assert blocks_per_sm("sm_90", 64, 4, 114 * 1024) == 1
    assert blocks_per_sm("gfx942", 64, 4, 1024) is None         # AMD: waves per SIMD, not this rule


def test_the_many_tile_stage_2_runs_two_blocks_per_sm_under_the_tables_triton():
    """tuning_space.TAIL_S2_TILES on the H200 table's 4096-token tail blocks: no spills and two blocks
    per SM (one block's decode and loads beside another's wgmmas; what the tiles won with), under the
    Triton the table is tuned with (register counts move between releases)."""
    import triton

    from kimi_k3_moe.kernels.triton import tuning_space as ts
    from kimi_k3_moe.kernels.triton.aot import compile_launch, meta_experts, plan_for_shape
    running = _minor(triton.__version__)
    table = tt.load_table("nvidia_h200")
    if running not in table["tritons"]:
        pytest.skip(f"register counts are judged under the table's Tritons {sorted(table['tritons'])} "
                    "(make test-compile-triton)")
    base = tt.lookup("nvidia_h200", "mxfp4", 896, 3584, 384, 4096, is_cuda=True, table=table, triton=running).config
    assert base.block_ms[0] == 96
    for t in ts.TAIL_S2_TILES:
        cfg = replace(base, stage2=ts.kc(t), stage2_block_m=None)
        plan = plan_for_shape(meta_experts("mxfp4", 896, 3584, 384), 4096, 16, ActivationSpec(*SITU),
                              cfg.validate(3584, 384))
        report, _ = compile_launch(next(l for l in plan if l.label == "stage2.aligned"), "sm_90")
        assert report.spills == 0 and report.blocks_per_sm >= 2, (cfg.to_json(), report.row())


def test_the_resource_tool_reports_a_table_entrys_stage_kernels(tmp_path):
    """benchmarks/triton_resources.py (docs/PERF.md, "Compiled resources") compiles a
    table entry's two stage kernels and reports registers, shared memory and blocks per SM."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import triton_resources
    cfg = triton_resources.table_tiers("triton_nvidia_h200", "mxfp4/E896_N768_K3584", "3.8")["4096"]
    rows = triton_resources.rows_for("mxfp4", (896, 3584, 384), 4096, "table", cfg, "sm_90", False)
    assert [r["stage"] for r in rows] == ["stage1.aligned", "stage2.aligned"]
    for r in rows:
        assert r["registers"] > 0 and r["shared"] > 0 and r["blocks_per_sm"] >= 1


@pytest.mark.parametrize("tokens", [16, 16384])
def test_the_flydsl_forwards_triton_glue_compiles_for_amd_without_spills(tokens):
    """The FlyDSL forward's alignment and top-k sum are Triton kernels that run on gfx942/gfx950 (the ROCm
    engines' Triton): compiled for this run's targets at Kimi-K3's TP8 shape (E 896, top-16, hidden 3584)."""
    import torch

    from kimi_k3_moe.kernels.common.alignment import align_launches
    from kimi_k3_moe.kernels.common.elementwise import cast_copy, zero_fill
    from kimi_k3_moe.kernels.common.topk_sum import topk_reduce
    from kimi_k3_moe.kernels.triton.aot import compile_launch
    ids = torch.empty(tokens, 16, dtype=torch.int32, device="meta")
    (pairs,), align = align_launches(ids, None, 896, (16,))
    y = torch.empty(tokens * 16, 3584, dtype=torch.bfloat16, device="meta")
    out = torch.empty(tokens, 3584, dtype=torch.bfloat16, device="meta")
    reduce = topk_reduce(y, pairs, out, 16)
    acc = torch.empty(tokens * 3584, dtype=torch.float32, device="meta")   # the atomic top-k sum's
    for launch in (*align, reduce, zero_fill(acc), cast_copy(acc, out.view(-1))):
        for target in TARGETS:
            report, _ = compile_launch(launch, target)
            assert report.spills == 0 and report.stack == 0, report


def test_an_entry_tuned_under_another_triton_serves_only_once_it_compiles_without_spills(monkeypatch):
    """The backend's check (kernels/triton/backend.spill_check) behind the table lookup: an entry of
    another Triton's section is compiled under this one for the device's arch before it serves; a
    spill (or an arch with no compile check) gives the heuristic, and the source says why."""
    from types import SimpleNamespace

    from kimi_k3_moe.kernels.triton import aot, backend
    table = tt.load_table("nvidia_h200")
    args = ("nvidia_h200", "mxfp4", 56, 3584, 3072, 64)            # EP16: 3.8 is the section nearest 9.9
    backend._spills.cache_clear()
    found = tt.lookup(*args, is_cuda=True, table=table, triton="9.9", verify=backend.spill_check("sm_90"))
    prefix = "table nvidia_h200 triton 3.8 mxfp4/E56_N6144_K3584 tier 64"
    assert found.source == f"{prefix} (tuned under Triton 3.8; compiled without spills under Triton 9.9)" \
        or found.source.startswith(f"heuristic ({prefix}, tuned under Triton 3.8: "), found.source
    unknown = tt.lookup(*args, is_cuda=True, table=table, triton="9.9", verify=backend.spill_check("sm_120"))
    assert unknown.source.startswith("heuristic (") and "no compile check for sm_120 under Triton 9.9" in unknown.source
    backend._spills.cache_clear()
    monkeypatch.setattr(aot, "compile_launch", lambda launch, target: (SimpleNamespace(spills=8), None))
    spilled = tt.lookup(*args, is_cuda=True, table=table, triton="9.9", verify=backend.spill_check("sm_90"))
    assert spilled.source.startswith(f"heuristic ({prefix}, tuned under Triton 3.8: ")
    assert "spills 8 bytes under Triton 9.9" in spilled.source
    assert spilled.config == tt.heuristic_config(3584, 3072, 64, is_cuda=True)
    backend._spills.cache_clear()

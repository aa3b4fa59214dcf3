"""Compiling for benchmarks/flydsl_model.py: ours through the package's builder, aiter's kernels from
FlyDSL's standalone copy, one process each (an LLVM abort loses one kernel), each ISA kept in the
output folder and reused on the next run. Run as a script, it is the child that builds one of
aiter's kernels: `python flydsl_model_compile.py SPEC_JSON OUT.s` (with compile_env's variables).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flydsl_model import FORMAT, ROOT, TOP_K, E, H, I, PeerSpec, log  # noqa: E402

from k3lab.flydsl import isa_model  # noqa: E402

CHILD_MEMORY = 12 << 30   # address-space cap of one compile process


def _limit_memory():
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))


def compile_ours(configs, out: Path, rocm: str, python: str, fresh: bool) -> dict:
    from kimi_k3_moe.kernels.flydsl.build import compile_in_subprocess

    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    found = {}
    for n, cfg in enumerate(configs, 1):
        isa = out / f"{cfg.name}.s"
        if isa.exists() and not fresh:
            log(f"[ours {n}/{len(configs)}] {cfg.name}: reusing {isa.name}")
        else:
            t0 = time.perf_counter()
            result = compile_in_subprocess(cfg, out, rocm=rocm, python=python)
            log(f"[ours {n}/{len(configs)}] {cfg.name}: {result.status} ({time.perf_counter() - t0:.0f} s)")
            if not result.ok:
                log(result.log_tail[-800:])
                continue
        found[cfg.name] = isa_model.parse(isa.read_text(), cfg.name)
    return found


def compile_peer(specs, out: Path, src: Path, rocm: str, python: str, fresh: bool) -> tuple[dict, dict]:
    from kimi_k3_moe.kernels.flydsl.toolchain import compile_env

    found, failed = {}, {}
    for n, spec in enumerate(specs, 1):
        isa = out / f"{spec.key}.s"
        if not (isa.exists() and not fresh):
            t0 = time.perf_counter()
            env = compile_env(spec.arch, rocm=rocm, dump_dir=out / "dump" / spec.key)
            env["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT)])
            try:
                proc = subprocess.run([python, __file__, json.dumps(asdict(spec)), str(isa)], env=env,
                                      capture_output=True, text=True, timeout=900, preexec_fn=_limit_memory)
                status = "ok" if proc.returncode == 0 and isa.exists() else (
                    "sigabrt" if proc.returncode == -6 else f"failed (rc {proc.returncode})")
                tail = (proc.stdout + proc.stderr)[-600:]
            except subprocess.TimeoutExpired:
                status, tail = "timeout", ""
            log(f"[aiter {n}/{len(specs)}] {spec.key}: {status} ({time.perf_counter() - t0:.0f} s)")
            if status != "ok":
                failed[spec.key] = status + ": " + " ".join(tail.split())[-300:]
                continue
        else:
            log(f"[aiter {n}/{len(specs)}] {spec.key}: reusing {isa.name}")
        found[spec.key] = isa_model.parse(isa.read_text(), spec.key)
    return found, failed


def peer_compile_child(spec: dict, out: str) -> int:
    """In a fresh process with FLYDSL_GPU_ARCH etc. set: build one aiter kernel and copy its ISA dump.
    Arguments as aiter's host passes them for an a16w4 table row (waves_per_eu None, no persist)."""
    import flydsl.expr as fx
    s = PeerSpec(**spec)
    w = FORMAT[s.arch]
    if s.stage == 1:
        from kernels.moe.moe_2stage_a16wmix.gemm1 import compile_gemm1_a16w4_port
        launch = compile_gemm1_a16w4_port(BM=s.BM, D_HIDDEN=H, D_INTER=I, NE=E, TOPK=TOP_K, TILE_N=s.tile_n,
                                          TILE_K=s.tile_k, act="situv2", b_cache_mod=s.b_cache_mod,
                                          xcd_swizzle=s.xcd, waves_per_eu=None, w_dtype=w, k_wave=s.k_wave)
        launch(0, 0, 0, 0, 0, 0, 1, 1, 4.0, 0.25, 25.0, 0.04, math.inf, 0, fx.Stream(None))
    else:
        from kernels.moe.moe_2stage_a16wmix.gemm2 import compile_gemm2_a16w4_port
        launch = compile_gemm2_a16w4_port(BM=s.BM, NE=E, N_OUT=H, D_INTER=I, TILE_N=s.tile_n, TILE_K=s.tile_k,
                                          b_cache_mod=s.b_cache_mod, xcd_swizzle=s.xcd, waves_per_eu=None,
                                          w_dtype=w, persist=False)
        launch(0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, fx.Stream(None))
    dumps = sorted(Path(os.environ["FLYDSL_DUMP_DIR"]).glob("**/*_final_isa.s"))
    if len(dumps) != 1:
        print(f"expected one ISA dump, found {len(dumps)}", file=sys.stderr)
        return 1
    Path(out).write_text(dumps[0].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(peer_compile_child(json.loads(sys.argv[1]), sys.argv[2]))

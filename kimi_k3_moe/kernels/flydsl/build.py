"""Building FlyDSL kernels: the launcher memo the backend uses, and the compile-only
driver CI and benchmarks/flydsl_resources.py use.

An instruction the target lacks aborts LLVM (SIGABRT, "Cannot select"), so the
driver compiles each configuration in its own process:

    python -m kimi_k3_moe.kernels.flydsl.build --config '<config_to_json(cfg)>' --out DIR

writes DIR/<name>.{hsaco,s,json} and prints one `REPORT {json}` line.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kimi_k3_moe.experts.format import INT4
from kimi_k3_moe.kernels.flydsl import code_object
from kimi_k3_moe.kernels.flydsl.config import (
    Activation,
    FlyKernelConfig,
    GemmShape,
    QuantConfig,
    Reduction,
    RowBlocks,
    Tile,
)
from kimi_k3_moe.kernels.flydsl.toolchain import compile_env


@functools.cache
def launcher(cfg: FlyKernelConfig | QuantConfig):
    """The @flyc.jit launcher of `cfg`, built once per process (keyed by every codegen field)."""
    from kimi_k3_moe.kernels.flydsl._details import act_quant_kernel, moe_gemm
    return act_quant_kernel.build(cfg) if isinstance(cfg, QuantConfig) else moe_gemm.build(cfg)


def placeholder_args(cfg: FlyKernelConfig | QuantConfig) -> tuple:
    """CPU tensors of the right dtypes and rank: all a compile-only trace looks at."""
    import torch

    u8, bf16, i32, f32 = torch.uint8, torch.bfloat16, torch.int32, torch.float32
    if isinstance(cfg, QuantConfig):
        return torch.zeros(64, dtype=bf16), torch.zeros(64, dtype=u8), torch.zeros(4, dtype=u8), 2
    scale_dtype = bf16 if cfg.weight_format == INT4 else u8
    act_dtype = u8 if cfg.quantized else bf16
    if cfg.stage == 2:
        y_dtype = f32 if cfg.reduction.kind == "atomic" else bf16
    else:
        y_dtype = act_dtype
    tensors = (torch.zeros(64, dtype=act_dtype), torch.zeros(64, dtype=u8), torch.zeros(64, dtype=scale_dtype),
               torch.zeros(64, dtype=bf16), torch.zeros(64, dtype=i32), torch.zeros(4, dtype=i32),
               torch.zeros(64, dtype=f32), torch.zeros(64, dtype=y_dtype))
    if cfg.quantized:
        extra = (torch.zeros(4, dtype=u8), torch.zeros(4, dtype=u8))              # AS, YS
    elif cfg.sums_tokens:
        extra = (torch.zeros(64, dtype=bf16), torch.zeros(64, dtype=i32))         # OUT, BOOK
    else:
        extra = ()
    return (*tensors, *extra, 1, cfg.BM, 4.0, 25.0)


def config_to_json(cfg: FlyKernelConfig | QuantConfig) -> str:
    """The config as JSON (the compile child's argument, the build report's "config"), with its stage."""
    if isinstance(cfg, QuantConfig):
        return json.dumps({"stage": 0, **asdict(cfg)}, sort_keys=True)
    out = asdict(replace(cfg, epilogue=Reduction()))
    out["tile"] = cfg.tile.to_row()
    out["epilogue"] = asdict(cfg.epilogue)
    return json.dumps({"stage": cfg.stage, **out}, sort_keys=True)


def config_from_json(text: str) -> FlyKernelConfig | QuantConfig:
    data = json.loads(text)
    stage = data.pop("stage")
    if stage == 0:
        return QuantConfig(**data)
    epilogue = (Activation if stage == 1 else Reduction)(**data.pop("epilogue"))
    return FlyKernelConfig(**{**data, "shape": GemmShape(**data["shape"]), "rows": RowBlocks(**data["rows"]),
                              "tile": Tile.from_row(data["tile"]), "epilogue": epilogue})



# ------------------------------------------------------------------ in the child process
def _hsaco_from_artifact(artifact) -> bytes:
    """The ELF code object inside a CompiledArtifact (its one gpu.binary, object 0)."""
    from flydsl._mlir import ir
    from flydsl._mlir.dialects import gpu
    from flydsl.compiler.jit_function import _create_mlir_context

    found = []

    def visit(op):
        if op.name == "gpu.binary":
            found.append(bytes(gpu.ObjectAttr(ir.ArrayAttr(op.attributes["objects"])[0]).object))
        return ir.WalkResult.ADVANCE

    with _create_mlir_context():
        ir.Module.parse(artifact.ir).operation.walk(visit)
    if len(found) != 1:
        raise RuntimeError(f"expected one gpu.binary in the compiled module, found {len(found)}")
    return found[0]


def compile_here(cfg: FlyKernelConfig | QuantConfig, out_dir: str | os.PathLike) -> dict:
    """Compile `cfg` in this process (env from toolchain.compile_env) and describe the result."""
    arch = os.environ.get("FLYDSL_GPU_ARCH")
    if arch != cfg.arch or os.environ.get("ARCH", arch) != arch or os.environ.get("COMPILE_ONLY") != "1":
        raise RuntimeError(f"compile_here({cfg.arch}) needs COMPILE_ONLY=1 and FLYDSL_GPU_ARCH=ARCH={cfg.arch}; "
                           f"got FLYDSL_GPU_ARCH={arch!r} ARCH={os.environ.get('ARCH')!r}")
    from flydsl.compiler.jit_function import _disk_cache_key

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    launch = launcher(cfg)
    t0 = time.perf_counter()
    launch(*placeholder_args(cfg))
    seconds = time.perf_counter() - t0
    artifact_key, artifact = launch._last_compiled
    elf = _hsaco_from_artifact(artifact)
    (out_dir / f"{cfg.name}.hsaco").write_bytes(elf)
    kernels = code_object.kernel_metadata(elf)
    if [k["name"] for k in kernels] != [cfg.name]:
        raise RuntimeError(f"code object holds kernels {[k['name'] for k in kernels]}, expected [{cfg.name!r}]")
    meta = kernels[0]
    isa_files = sorted(Path(os.environ["FLYDSL_DUMP_DIR"]).glob(f"{cfg.name}/*_final_isa.s"))
    if not isa_files:
        raise RuntimeError(f"no ISA dump for {cfg.name} under {os.environ['FLYDSL_DUMP_DIR']}")
    isa = isa_files[-1].read_text()
    (out_dir / f"{cfg.name}.s").write_text(isa)
    report = {
        "name": cfg.name, "config": json.loads(config_to_json(cfg)), "compile_s": round(seconds, 2),
        "artifact_key": artifact_key, "disk_cache_key": _disk_cache_key(artifact_key),
        "jit_name": launch.func.__name__, "hsaco_bytes": len(elf), "metadata": meta,
        "isa": code_object.isa_stats(isa),
        "isa_file": str(out_dir / f"{cfg.name}.s"), "hsaco_file": str(out_dir / f"{cfg.name}.hsaco"),
    }
    (out_dir / f"{cfg.name}.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="compile one FlyDSL MoE kernel (compile-only)")
    parser.add_argument("--config", required=True, help="config_to_json of a FlyKernelConfig or QuantConfig")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    report = compile_here(config_from_json(args.config), args.out)
    print("REPORT " + json.dumps(report), flush=True)
    return 0


# ------------------------------------------------------------------ the driver
@dataclass
class CompileResult:
    config: FlyKernelConfig
    status: str                  # ok | sigabrt | failed | llvm-errors | timeout
    wall_s: float
    report: dict | None = None
    llvm_errors: list[str] = field(default_factory=list)
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def compile_in_subprocess(cfg: FlyKernelConfig, out_dir: str | os.PathLike, *, rocm: str | os.PathLike,
                          timeout: float = 600.0, python: str = sys.executable) -> CompileResult:
    """Compile `cfg` in a fresh interpreter; an LLVM abort only loses this config.

    LLVM prints some codegen errors and still "succeeds" (e.g. "no libcall available
    for ftanh"): any `error:` / `LLVM ERROR` line on stderr marks the result failed.
    """
    out_dir = Path(out_dir)
    env = compile_env(cfg.arch, rocm=rocm, dump_dir=out_dir / "dump" / cfg.name)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([python, "-m", "kimi_k3_moe.kernels.flydsl.build", "--config", config_to_json(cfg),
                               "--out", str(out_dir)], capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return CompileResult(cfg, "timeout", time.perf_counter() - t0, log_tail=str(exc)[-2000:])
    wall = time.perf_counter() - t0
    report = None
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            report = json.loads(line[len("REPORT "):])
    errors = [ln.strip() for ln in proc.stderr.splitlines()
              if ln.strip().lower().startswith("error:") or "LLVM ERROR" in ln]
    if proc.returncode == -6:
        status = "sigabrt"
    elif proc.returncode != 0 or report is None:
        status = "failed"
    elif errors:
        status = "llvm-errors"
    else:
        status = "ok"
    return CompileResult(cfg, status, wall, report, errors[:8], (proc.stdout + proc.stderr)[-3000:])


def compile_many(configs, out_dir: str | os.PathLike, *, rocm: str | os.PathLike, jobs: int = 2,
                 progress: bool = True) -> list[CompileResult]:
    """Compile every config, `jobs` processes at a time, in the given order."""
    from tqdm.auto import tqdm

    configs = list(configs)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool, \
            tqdm(total=len(configs), desc="FlyDSL compile", unit="kernel", disable=not progress) as bar:
        def one(cfg):
            result = compile_in_subprocess(cfg, out_dir, rocm=rocm)
            bar.update(1)
            return result
        return list(pool.map(one, configs))


if __name__ == "__main__":
    sys.exit(main())

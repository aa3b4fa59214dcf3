"""The FlyDSL toolchain: is it importable, where is the linker, which env compiles what.

FlyDSL bundles MLIR/LLVM with the AMDGPU backend, but links code objects with
`$ROCM_PATH/llvm/bin/ld.lld`. A CPU machine without ROCm gets a stand-in: a
shell script running the LLD bundled in PyPI's `ziglang`, plus an empty
`$ROCM_PATH/amdgcn/bitcode/` (our kernels call no device library).

    python -m kimi_k3_moe.kernels.flydsl.toolchain --shim .tools/rocm   # creates it
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kimi_k3_moe import settings

ENV_ROCM = settings.FLYDSL_ROCM   # our override; FlyDSL itself reads ROCM_PATH


def flydsl_version() -> str | None:
    """The installed flydsl distribution's version (by metadata: a stray `flydsl/` folder does not count)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("flydsl")
    except PackageNotFoundError:
        return None


def rocm_root(env=None) -> Path | None:
    """A ROCm-like root whose llvm/bin/ld.lld exists: ours, then ROCM_PATH, then /opt/rocm. Ours, when
    set, is the only one tried: a wrong value is refused (settings.SettingError), never replaced."""
    env = os.environ if env is None else env
    ours = settings.linker_root(ENV_ROCM, env)
    if ours is not None:
        return Path(ours)
    for candidate in (env.get("ROCM_PATH"), "/opt/rocm"):
        if candidate and (Path(candidate) / "llvm" / "bin" / "ld.lld").exists():
            return Path(candidate)
    return None


def make_ld_lld_shim(root: str | os.PathLike, python: str = sys.executable) -> Path:
    """Create root/llvm/bin/ld.lld (zig's LLD via `python -m ziglang`) and an empty root/amdgcn/bitcode."""
    if importlib.util.find_spec("ziglang") is None:
        raise RuntimeError("the ld.lld shim needs the `ziglang` package (pip install ziglang)")
    root = Path(root).resolve()
    (root / "amdgcn" / "bitcode").mkdir(parents=True, exist_ok=True)
    shim = root / "llvm" / "bin" / "ld.lld"
    shim.parent.mkdir(parents=True, exist_ok=True)
    shim.write_text("#!/bin/sh\n# ld.lld for FlyDSL on a machine without ROCm: zig's bundled LLD.\n"
                    f'exec "{python}" -m ziglang ld.lld "$@"\n')
    shim.chmod(0o755)
    out = subprocess.run([str(shim), "--version"], capture_output=True, text=True, timeout=120)
    if out.returncode != 0 or "LLD" not in out.stdout:
        raise RuntimeError(f"ld.lld shim at {shim} does not run: {out.stdout}{out.stderr}")
    return root


def compile_env(arch: str, *, rocm: str | os.PathLike, dump_dir: str | os.PathLike | None = None,
                base=None) -> dict[str, str]:
    """Environment for a compile-only FlyDSL run targeting `arch` (no GPU needed).

    FLYDSL_GPU_ARCH decides the target and the arch-dependent helpers; a stale ARCH
    with another value would give a binary for one arch built with the other's
    assumptions, so ARCH is set to the same value.
    """
    env = dict(os.environ if base is None else base)
    env.update({"FLYDSL_GPU_ARCH": arch, "ARCH": arch, "COMPILE_ONLY": "1", "ROCM_PATH": str(rocm)})
    if dump_dir is not None:
        # dumps the final ISA; note FlyDSL then bypasses its disk cache (fresh compiles)
        env.update({"FLYDSL_DEBUG_DUMP_ASM": "1", "FLYDSL_DUMP_DIR": str(dump_dir)})
    for var in ("FLYDSL_DUMP_IR", "FLYDSL_RUNTIME_RUN_ONLY"):
        env.pop(var, None)
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shim", metavar="DIR", help="create the ld.lld shim under DIR")
    args = parser.parse_args(argv)
    print(f"flydsl: {flydsl_version() or 'not installed'}")
    env = dict(os.environ)
    if args.shim:
        root = make_ld_lld_shim(args.shim)
        env[ENV_ROCM] = str(root)
        print(f"ld.lld shim: {root / 'llvm/bin/ld.lld'} (use it with {ENV_ROCM}={root} or ROCM_PATH={root})")
    print(f"ROCm root with ld.lld: {rocm_root(env) or 'none found'}")
    print(f"ld.lld on PATH: {shutil.which('ld.lld') or 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

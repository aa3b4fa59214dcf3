"""Maintainer tool: the ISA of every FlyDSL kernel CI compiles, kept per kernel name, and a diff of two
such snapshots. A refactor that should change no kernel is checked by a snapshot before and after:

    python benchmarks/flydsl_isa_snapshot.py snap BEFORE_DIR     # from the tree before the change
    python benchmarks/flydsl_isa_snapshot.py snap AFTER_DIR      # from the tree after it
    python benchmarks/flydsl_isa_snapshot.py diff BEFORE_DIR AFTER_DIR

`snap` compiles sweep.ci_configs() for gfx942 and gfx950 (compile-only, two at a time, about 20 min
on a 2-core box; set KIMI_K3_MOE_FLYDSL_ROCM as for `make test-flydsl`) and writes DIR/<name>.s.
`diff` prints each kernel whose ISA differs or that one side lacks, and exits 1 if there is any.
The kernels of `make test-flydsl` ($KIMI_K3_MOE_FLYDSL_OUT/<name>.s) are such a snapshot too.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kimi_k3_moe.kernels.flydsl.toolchain import rocm_root  # noqa: E402


def snap(out: Path) -> int:
    from k3lab.flydsl.sweep import ci_configs
    from kimi_k3_moe.kernels.flydsl.build import compile_many

    rocm = rocm_root()
    if rocm is None:
        print("no ld.lld: set KIMI_K3_MOE_FLYDSL_ROCM (see `make test-flydsl`)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        results = compile_many(ci_configs(), work, rocm=rocm)
        failed = [r.config.name for r in results if not r.ok]
        for r in results:
            if r.ok:
                shutil.copy(Path(work) / f"{r.config.name}.s", out / f"{r.config.name}.s")
    print(f"{len(results) - len(failed)} of {len(results)} kernels into {out}"
          + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


def diff(before: Path, after: Path) -> int:
    a, b = ({p.stem: p for p in d.glob("*.s")} for d in (before, after))
    lines = [f"only in {before}: {n}" for n in sorted(a.keys() - b.keys())]
    lines += [f"only in {after}: {n}" for n in sorted(b.keys() - a.keys())]
    lines += [f"differs: {n}" for n in sorted(a.keys() & b.keys()) if a[n].read_bytes() != b[n].read_bytes()]
    print("\n".join(lines) or f"{len(a)} kernels, every ISA byte-identical")
    return 1 if lines else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("snap").add_argument("out", type=Path)
    d = sub.add_parser("diff")
    d.add_argument("before", type=Path)
    d.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    return snap(args.out) if args.cmd == "snap" else diff(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())

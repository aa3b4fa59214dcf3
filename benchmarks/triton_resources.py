"""Registers, spills, shared memory and blocks per SM of the Triton stage kernels, no GPU needed.

Compiles each config's stage launches ahead of time (kernels/triton/aot.py) for one target and
prints a table; the configs are a device table's tiers or a candidates file
(`--configs`: JSON {tokens: {name: MoEConfig json}}). Run it under the Triton the configs will run with
(a table section's version, e.g. `PYTHONPATH=.triton-3.8.0`, which `make test-compile-triton`
installs; the section of the running Triton is read, else the nearest): register allocation moves
between Triton releases.

    python benchmarks/triton_resources.py --tokens 4096,16384                 # the H200 table's TP8 MXFP4 entries
    python benchmarks/triton_resources.py --configs F --json out.json         # candidates beside them
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import resources
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("TRITON_INTERPRET", "0")

from kimi_k3_moe.activation import ActivationSpec  # noqa: E402
from kimi_k3_moe.kernels.triton import table as tt  # noqa: E402
from kimi_k3_moe.kernels.triton.table import MoEConfig  # noqa: E402

STAGES = ("stage1.aligned", "stage2.aligned", "stage1.gemv", "stage2.gemv")
SITU = ActivationSpec.situv2(4.0, 25.0)


def table_tiers(table: str, key: str, triton: str) -> dict[str, MoEConfig]:
    """The entry's tiers in the section of Triton `triton` (the nearest version that has the entry)."""
    path = Path(str(resources.files("kimi_k3_moe.configs").joinpath("tables", f"{table}.json")))
    data = json.loads(path.read_text())
    version = next(v for v in tt.versions_nearest_first(data, triton) if key in data["tritons"][v]["entries"])
    print(f"{table} {key}: the entries tuned under Triton {version}")
    return {t: MoEConfig.from_json(c) for t, c in data["tritons"][version]["entries"][key]["tiers"].items()}


def rows_for(weight_format: str, shape: tuple[int, int, int], tokens: int, name: str, cfg: MoEConfig, target: str,
             offsets: bool) -> list[dict]:
    from kimi_k3_moe.kernels.triton import aot
    e, h, i = shape
    plan = aot.plan_for_shape(aot.meta_experts(weight_format, e, h, i, offsets=offsets), tokens, 16, SITU,
                              cfg.validate(h, i).for_target(target.startswith("sm_")))
    out = []
    for launch in plan:
        if launch.label not in STAGES:
            continue
        kc = cfg.stage1 if launch.label.startswith("stage1") else cfg.stage2
        report, _ = aot.compile_launch(launch, target)
        out.append({"tokens": tokens, "config": name, "stage": launch.label, "block_m": cfg.block_ms,
                    "tile": f"{kc.block_n}x{kc.block_k}", "warps": kc.num_warps, "stages": kc.num_stages,
                    "swap": kc.swap, **{k: getattr(report, k) for k in
                                        ("registers", "spills", "shared", "blocks_per_sm", "seconds")}})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default="triton_nvidia_h200")
    ap.add_argument("--key", default="mxfp4/E896_N768_K3584", help="the table entry: FMT/E{experts}_N{2I}_K{H}")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--configs", help="JSON {tokens: {name: MoEConfig json}} compiled beside the table's entry")
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--triton", default=None, help="the table section (Triton major.minor; default: the running one)")
    ap.add_argument("--offsets", action="store_true", help="int4 with offsets")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    import triton
    weight_format, e, n, k = tt.parse_shape_key(args.key)
    tiers = table_tiers(args.table, args.key, args.triton or tt.triton_version())
    given = json.load(open(args.configs)) if args.configs else {}
    rows = []
    print(f"triton {triton.__version__}, target {args.target}, {args.key}", flush=True)
    for t in (int(x) for x in args.tokens.split(",")):
        configs = {"table": tiers[str(t)], **{nm: MoEConfig.from_json(c) for nm, c in given.get(str(t), {}).items()}}
        for name, cfg in configs.items():
            start = time.perf_counter()
            try:
                got = rows_for(weight_format, (e, k, n // 2), t, name, cfg, args.target, args.offsets)
            except ValueError as exc:  # an invalid candidate: said, not compiled
                print(f"{t:>6} {name}: skipped ({exc})", flush=True)
                continue
            rows += got
            for r in got:
                print(f"{t:>6} {name:<36} {r['stage']:<15} bm {str(r['block_m']):<9} {r['tile']:>8} w{r['warps']} "
                      f"s{r['stages']} regs {r['registers']:>3} spills {r['spills']:>3} shared "
                      f"{r['shared'] // 1024:>3} KB  blocks/SM {r['blocks_per_sm']}", flush=True)
            print(f"{'':>6} ({time.perf_counter() - start:.0f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "target": args.target,
                                               "key": args.key, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

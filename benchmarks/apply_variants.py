"""Write the winners of `pair_variants.py` runs into the packaged H200 table.

A row's best config replaces its tier's entry when it beat the table's own config in the
same run by more than --margin; the entry records both times and where they came from.

    python benchmarks/apply_variants.py RUN.json [RUN.json ...] [--margin 0.01] [--table F]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kimi_k3_moe.configs import triton_table as tt


def apply(table: dict, run: dict, source: str, margin: float) -> list[str]:
    """Update `table` in place from one pair_variants run; returns one line per tier changed."""
    shape = run["shape"]
    changed = []
    for row in run["rows"]:
        held = shape.get("local_experts") or shape["num_experts"]
        key = tt.shape_key(row["fmt"], held, 2 * shape["inter"], shape["hidden"])
        tiers = table["entries"].get(key, {}).get("tiers", {})
        tier = str(row["tokens"])
        base_us = row.get("table_us")
        if tier not in tiers or base_us is None or row["best"] == "table" or row["best_us"] > base_us * (1 - margin):
            continue
        old = tiers[tier]
        try:  # the run validated it for its own code; the table must hold only what this code accepts
            new = tt.MoEConfig.from_json(row["best_config"]).validate(shape["hidden"], shape["inter"]).to_json()
        except (TypeError, ValueError) as exc:
            changed.append(f"{key} tier {tier}: {row['best']} not applied, invalid here: {exc}")
            continue
        previous = {k: old[k] for k in ("path", "block_m", "stage1", "stage2", "decode", "stage2_block_m", "pdl")
                    if k in old}
        tiers[tier] = dict(new, tuned=True, us=round(row["best_us"], 1), previous_us=round(base_us, 1),
                           previous=previous,
                           note=f"benchmarks/pair_variants.py ({row['best']}) on the {run['info']['gpu']} "
                                f"{run['info']['date']}, triton {run['info']['triton']} ({source}); "
                                f"previous_us: the entry before, same run")
        changed.append(f"{key} tier {tier}: {base_us:.1f} -> {row['best_us']:.1f} us ({row['best']})")
    return changed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--margin", type=float, default=0.01)
    ap.add_argument("--table", default=str(tt.table_path("nvidia_h200")))
    ap.add_argument("--source", help="where the runs' files are kept (recorded in each note)")
    args = ap.parse_args()
    table = json.loads(Path(args.table).read_text())
    for path in args.runs:
        for line in apply(table, json.loads(Path(path).read_text()), args.source or path, args.margin):
            print(line)
    Path(args.table).write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

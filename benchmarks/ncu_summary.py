"""Condense `ncu --csv --page details` output to one line per kernel launch.

    python benchmarks/ncu_summary.py ncu.csv
"""
import csv
import sys
from collections import OrderedDict

KEEP = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput", "Registers Per Thread",
        "Achieved Occupancy", "Theoretical Occupancy", "Grid Size", "Block Size", "Warp Cycles Per Issued Instruction",
        "Issue Slots Busy", "Dynamic Shared Memory Per Block", "Waves Per SM")


def main(path):
    launches = OrderedDict()
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for row in csv.DictReader(lines):
        key = (row["ID"], row["Kernel Name"].split("(")[0])
        d = launches.setdefault(key, {})
        name = row["Metric Name"]
        if name in KEEP or "Stall" in name:
            d[name] = f'{row["Metric Value"]} {row["Metric Unit"]}'.strip()
    for (i, kernel), d in launches.items():
        print(f"#{i} {kernel}")
        print("   " + "; ".join(f"{k}={d[k]}" for k in KEEP if k in d))
        stalls = sorted(((k, d[k]) for k in d if "Stall" in k), key=lambda kv: -float(kv[1].split()[0] or 0)
                        if kv[1].split()[0].replace(".", "", 1).isdigit() else 0)[:4]
        if stalls:
            print("   stalls: " + "; ".join(f"{k}={v}" for k, v in stalls))


if __name__ == "__main__":
    main(sys.argv[1])

"""benchmarks/apply_variants.py writes a pair_variants run's winners into a table: only a config
this code accepts, only when faster than the entry by the margin, recording what it replaced."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from apply_variants import apply  # noqa: E402

from kimi_k3_moe.configs.triton_table import KernelConfig, MoEConfig  # noqa: E402

SHAPE = {"num_experts": 896, "hidden": 3584, "inter": 384}
KEY = "mxfp4/E896_N768_K3584"


def run_with(best: dict, best_us: float, table_us: float = 100.0) -> dict:
    return {"shape": SHAPE, "info": {"gpu": "test GPU", "date": "today", "triton": "3.6.0"},
            "rows": [{"fmt": "mxfp4", "tokens": 4, "table_us": table_us, "best": "cand", "best_us": best_us,
                      "best_config": best}]}


def table() -> dict:
    entry = MoEConfig("aligned", 16, KernelConfig(64, 256, pairs=True), KernelConfig(64, 128, pairs=True), "ptx")
    return {"entries": {KEY: {"tiers": {"4": entry.to_json()}}}}


def test_a_faster_valid_config_replaces_the_entry_and_keeps_what_it_replaced():
    direct = MoEConfig("direct", 16, KernelConfig(32, 256, pairs=True, stack_gate_up=True),
                       KernelConfig(64, 128, pairs=True, n_tiles=2), "ptx", pdl=True)
    t = table()
    lines = apply(t, run_with(direct.to_json(), 90.0), "here", 0.01)
    tier = t["entries"][KEY]["tiers"]["4"]
    assert lines and MoEConfig.from_json(tier) == direct
    assert tier["us"] == 90.0 and tier["previous_us"] == 100.0 and tier["previous"]["path"] == "aligned"
    assert apply(table(), run_with(direct.to_json(), 99.5), "here", 0.01) == []  # within the margin


def test_a_config_this_code_refuses_is_not_written():
    bad = MoEConfig("direct", 16).to_json() | {"block_m": 32}
    t = table()
    lines = apply(t, run_with(bad, 50.0), "here", 0.01)
    assert len(lines) == 1 and "not applied, invalid here" in lines[0] and "block_m 32" in lines[0]
    assert t == table()

"""After a bench on a GPU where the engine has its own Kimi-K3 path: record which was faster.

The plugin reads the record at load (dispatch.engine_keeps_layer): on gfx950 it serves a layer
with our FlyDSL kernels only where this measurement, on this GPU, found them faster at every
token count timed, each after passing the bench's own check against the float reference.
"""
from __future__ import annotations

from pathlib import Path

from kimi_k3_moe.bench.peers.base import ENGINE
from kimi_k3_moe.configs import engine_verdicts

# what the plugin serves on gfx950 unless told otherwise: the FlyDSL kernels on the checkpoint's MXFP4, bf16
SERVED = "ours_flydsl_mxfp4"


def record_verdicts(result: dict, identity: dict, env=None) -> list[Path]:
    """The verdict of the served path against each engine path that both timed every token count."""
    shape = result["shape"]
    key = engine_verdicts.shape_key(shape["hidden"], shape["inter"], shape.get("local_experts")
                                    or shape["num_experts"], shape["topk"])
    entries = result["entries"]
    if not entries.get(SERVED, {}).get("available"):
        return []
    written = []
    for engine in [n for n, e in entries.items() if e.get("role") == ENGINE and e.get("available")]:
        times = {}
        for row in result["rows"]:
            a, b = row["results"].get(SERVED, {}), row["results"].get(engine, {})
            if a.get("status") != "ok" or b.get("status") != "ok":
                break
            times[row["tokens"]] = (a["median_us"], b["median_us"])
        else:
            if times:
                written.append(engine_verdicts.record(identity, key, SERVED, engine, times, env))
    return written

"""Measured verdicts "ours vs the engine's own Kimi-K3 path" on the user's own GPU.

Where an engine serves Kimi-K3 with hardware-tuned kernels of its own (vLLM 0.33 on gfx950:
aiter's a16w4), the plugin leaves those layers to it unless a measurement on this very GPU
says ours is faster for the layer's shape. `kimi-k3-moe bench` records that measurement here
when it timed both in one run; the plugin reads it at load. One file per device in the user
tables folder (configs/user_tables.py): valid only for the same device, arch, driver and
package version, like a user table. Plain Python: importing this imports no GPU toolkit.
"""
from __future__ import annotations

import json
from pathlib import Path

from kimi_k3_moe import __version__
from kimi_k3_moe.configs.user_tables import table_dir

SCHEMA = "kimi-k3-moe/engine-verdicts"


def verdict_path(dev_key: str, env=None) -> Path:
    return table_dir(env) / f"engine_verdicts_{dev_key}.json"


def shape_key(hidden: int, inter: int, num_experts: int, top_k: int) -> str:
    """A layer as the engine hands it to a MoE method (per rank)."""
    return f"H{hidden}_I{inter}_E{num_experts}_top{top_k}"


def verdict_of(times: dict[int, tuple[float, float]]) -> str:
    """{tokens: (ours_us, engine_us)} -> "ours" when ours was faster at every count timed, else "engine"."""
    return "ours" if times and all(o < e for o, e in times.values()) else "engine"


def record(identity: dict, key: str, ours: str, engine: str, times: dict[int, tuple[float, float]],
           env=None) -> Path:
    """Write (or replace) the verdict for `key` on this device; returns the file."""
    path = verdict_path(identity["key"], env)
    data = _read(path) or {}
    if data.get("device") != identity or data.get("package_version") != __version__:
        data = {"schema": SCHEMA, "device": identity, "package_version": __version__, "entries": {}}
    data["entries"][key] = {"ours": ours, "engine": engine, "verdict": verdict_of(times),
                            "us": {str(t): {"ours": o, "engine": e} for t, (o, e) in sorted(times.items())}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def lookup(identity: dict, key: str, env=None) -> tuple[str | None, str]:
    """("ours" | "engine" | None, why): the verdict recorded on this device for this layer shape."""
    path = verdict_path(identity["key"], env)
    data = _read(path)
    if data is None:
        return None, f"no measurement on this GPU ({path} absent or unreadable)"
    if data.get("schema") != SCHEMA or data.get("device") != identity:
        return None, f"{path} was measured on another device or driver"
    if data.get("package_version") != __version__:
        return None, f"{path} was measured with kimi-k3-moe {data.get('package_version')!r}, this is {__version__}"
    entry = data.get("entries", {}).get(key)
    if not isinstance(entry, dict) or entry.get("verdict") not in ("ours", "engine"):
        return None, f"no measurement of layer shape {key} in {path}"
    said = "ours faster at every count timed" if entry["verdict"] == "ours" else "ours not faster at every count timed"
    return entry["verdict"], f"measured on this GPU ({path}, {key}): {said}"


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None

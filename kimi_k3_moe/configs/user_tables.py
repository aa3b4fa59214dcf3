"""Tables tuned on the user's own GPU by `kimi-k3-moe tune`, and whether one may serve here.

A user table lives in `$KIMI_K3_MOE_TABLES` (default `$XDG_CACHE_HOME/kimi-k3-moe/tables`,
i.e. ~/.cache/...), one file per backend and device. It serves only where it was
measured: the same device name, arch and driver/ROCm version, written by the
same package version, for the exact layer shape, with every token tier it
declares. Anything else (corrupt JSON, another device, another version, a
missing tier) is refused with a one-line message and the packaged table serves.
Plain Python: importing this imports no GPU toolkit.
"""
from __future__ import annotations

import json
import logging
import os
import time
from functools import lru_cache
from pathlib import Path

from kimi_k3_moe import __version__, settings

SCHEMA = "kimi-k3-moe/user-table"
FORMAT_VERSION = 1
ENV_DIR = settings.TABLES
INTERPRETER = "interpreter"
TABLED_BACKENDS = ("triton", "flydsl")  # the backends whose tiles come from tables

log = logging.getLogger("kimi_k3_moe")
_messages: dict[str, str] = {}  # path -> why it was refused (doctor shows these)


class UserTableError(ValueError):
    """A user table that must not serve; the message says why."""


def table_dir(env=None) -> Path:
    env = os.environ if env is None else env
    chosen = settings.folder_to_create(ENV_DIR, env)
    if chosen:
        return Path(chosen)
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kimi-k3-moe" / "tables"


def table_path(backend: str, dev_key: str, env=None) -> Path:
    return table_dir(env) / f"{backend}_{dev_key}.json"


def _driver_version() -> str:
    import torch
    if getattr(torch.version, "hip", None):
        return f"hip {torch.version.hip}"
    try:
        for word in Path("/proc/driver/nvidia/version").read_text().split():
            if word.count(".") >= 1 and word.replace(".", "").isdigit():
                return f"nvidia {word}"
    except OSError:
        pass
    return f"cuda {torch.version.cuda}"


@lru_cache(maxsize=None)
def device_identity(device: int = 0) -> dict:
    """What a table is valid for: device name, its key, arch, driver/ROCm version."""
    import torch

    from kimi_k3_moe.configs.triton_table import device_key
    if not torch.cuda.is_available():
        return {"name": INTERPRETER, "key": INTERPRETER, "arch": INTERPRETER, "driver": "none"}
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        arch = getattr(props, "gcnArchName", "").split(":")[0]
    else:
        arch = f"sm_{props.major}{props.minor}"
    return {"name": props.name, "key": device_key(props.name), "arch": arch, "driver": _driver_version()}


def flydsl_shape_key(fmt: str, hidden: int, inter: int, top_k: int) -> str:
    return f"{fmt}/N{2 * inter}_K{hidden}_top{top_k}"


# ---------------------------------------------------------------- validation
def validate(table: dict, *, backend: str, identity: dict, path: Path | str = "table") -> dict:
    """`table` if it may serve here, else UserTableError naming the first reason."""
    if not isinstance(table, dict) or table.get("schema") != SCHEMA:
        raise UserTableError(f"user table {path}: not a kimi-k3-moe user table (schema {table.get('schema')!r})"
                             if isinstance(table, dict) else f"user table {path}: not a JSON object")
    if table.get("format_version") != FORMAT_VERSION:
        raise UserTableError(f"user table {path}: format_version {table.get('format_version')!r}, "
                             f"this package reads {FORMAT_VERSION}")
    if table.get("backend") != backend:
        raise UserTableError(f"user table {path}: tuned for backend {table.get('backend')!r}, not {backend!r}")
    dev = table.get("device")
    if not isinstance(dev, dict):
        raise UserTableError(f"user table {path}: device {dev!r} is not a JSON object")
    for field in ("name", "arch", "driver"):
        if dev.get(field) != identity.get(field):
            raise UserTableError(f"user table {path}: tuned on {dev.get('name')!r} ({dev.get('arch')}, "
                                 f"{dev.get('driver')}), this is {identity.get('name')!r} ({identity.get('arch')}, "
                                 f"{identity.get('driver')}): {field} differs")
    if table.get("package_version") != __version__:
        raise UserTableError(f"user table {path}: written by kimi-k3-moe {table.get('package_version')!r}, this is "
                             f"{__version__}; retune with `kimi-k3-moe tune`")
    tiers = table.get("tiers")
    entries = table.get("entries")
    if not isinstance(tiers, list) or not tiers or not isinstance(entries, dict) or not entries:
        raise UserTableError(f"user table {path}: no tiers or no entries")
    for key, entry in entries.items():
        try:
            have = _entry_tiers(backend, entry)
        except (ValueError, TypeError) as exc:
            raise UserTableError(f"user table {path}: entry {key} holds an invalid token tier: {exc}") from None
        missing = [t for t in tiers if t not in have]
        if missing:
            raise UserTableError(f"user table {path}: entry {key} lacks token tiers {missing}")
        _check_configs(backend, key, entry, path)
    return table


def _entry_tiers(backend: str, entry: dict) -> list[int]:
    rows = entry.get("tiers") if isinstance(entry, dict) else None
    if backend == "triton" and isinstance(rows, dict):
        return [int(t) for t in rows]
    if backend == "flydsl" and isinstance(rows, list):
        return [r.get("tuned_at_tokens") for r in rows if isinstance(r, dict)]
    return []


def _check_configs(backend: str, key: str, entry: dict, path) -> None:
    try:
        if backend == "triton":
            from kimi_k3_moe.configs.triton_table import MoEConfig
            n, k = (int(p[1:]) for p in key.split("/")[1].split("_")[1:3])
            for tier, cfg in entry["tiers"].items():
                MoEConfig.from_json(cfg).validate(k, n // 2)
        else:
            from kimi_k3_moe.kernels.flydsl.tiles import load_table
            load_table({"gfx950": [_flydsl_row(r) for r in entry["tiers"]]})
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise UserTableError(f"user table {path}: entry {key} holds an invalid config: {exc}") from None


def _flydsl_row(r: dict) -> dict:
    return {k: r[k] for k in ("max_tokens", "BM", "stage1", "stage2")}


# ---------------------------------------------------------------- reading
@lru_cache(maxsize=None)
def _load(backend: str, path_text: str, identity_json: str) -> dict | None:
    path = Path(path_text)
    if not path.is_file():
        return None
    try:
        table = json.loads(path.read_text())
        table = validate(table, backend=backend, identity=json.loads(identity_json), path=path)
    except (OSError, json.JSONDecodeError) as exc:
        why = f"user table {path}: unreadable or not valid JSON ({exc})"
    except UserTableError as exc:
        why = str(exc)
    else:
        _messages.pop(path_text, None)
        return table
    _messages[path_text] = why + "; the packaged table serves"
    log.warning("kimi-k3-moe: %s", _messages[path_text])
    return None


def load(backend: str, identity: dict | None = None) -> tuple[dict | None, Path]:
    """(the valid user table for this device, or None; its path)."""
    identity = identity or device_identity()
    path = table_path(backend, identity["key"])
    return _load(backend, str(path), json.dumps(identity, sort_keys=True)), path


def triton_entry(dev_key: str, fmt: str, num_experts: int, n: int, k: int):
    """((key, entry), origin) of a user table for exactly this shape on this device, else None."""
    identity = device_identity()
    if identity["key"] != dev_key:
        return None
    from kimi_k3_moe.configs.triton_table import shape_key
    table, path = load("triton", identity)
    key = shape_key(fmt, num_experts, n, k)
    if table is None or key not in table["entries"]:
        return None
    return (key, table["entries"][key]), f"user table {path}"


def flydsl_tiers(arch: str, fmt: str, hidden: int, inter: int, top_k: int):
    """{arch: tiers} from a user table for this exact shape on this GPU, else None."""
    table, path = load("flydsl")
    if table is None or table.get("target_arch") != arch:
        return None
    entry = table["entries"].get(flydsl_shape_key(fmt, hidden, inter, top_k))
    if entry is None:
        return None
    from kimi_k3_moe.kernels.flydsl.tiles import load_table
    return load_table({arch: [_flydsl_row(r) for r in entry["tiers"]]})


def describe(backend: str) -> str:
    """One line for doctor and the plugin's log: which table serves and from where."""
    table, path = load(backend)
    if table is not None:
        return f"user table {path} (tuned {table.get('written', '?')}, {len(table['entries'])} shape(s))"
    why = _messages.get(str(path))
    return f"packaged table ({why})" if why else f"packaged table (no user table at {path})"


def serving(backend: str) -> str | None:
    """`describe` for a backend's name or description ("triton[mxfp4]"); None when it reads no tile table."""
    name = backend.split("[")[0]
    return describe(name) if name in TABLED_BACKENDS else None


def clear_cache() -> None:
    _load.cache_clear()
    device_identity.cache_clear()
    _messages.clear()


# ---------------------------------------------------------------- writing
def write(backend: str, identity: dict, tiers: list[int], entries: dict, *, extra: dict | None = None,
          env=None) -> Path:
    """Write (replace) this device's user table for `backend`; entries of other shapes are kept."""
    path = table_path(backend, identity["key"], env)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = {}
    try:
        old = validate(json.loads(path.read_text()), backend=backend, identity=identity, path=path)["entries"]
        old = {k: e for k, e in old.items() if set(tiers) <= set(_entry_tiers(backend, e))}
    except (OSError, ValueError):
        pass
    table = {"schema": SCHEMA, "format_version": FORMAT_VERSION, "backend": backend, "device": identity,
             "package_version": __version__, "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
             "tiers": list(tiers), "entries": {**old, **entries}, **(extra or {})}
    validate(table, backend=backend, identity=identity, path=path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1))
    tmp.replace(path)  # atomic: a reader never sees half a table
    _load.cache_clear()
    return path

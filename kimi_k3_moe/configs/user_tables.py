"""Tables tuned on the user's own GPU by `kimi-k3-moe tune`, and whether one may serve here.

A user table lives in `$KIMI_K3_MOE_TABLES` (default `$XDG_CACHE_HOME/kimi-k3-moe/tables`,
i.e. ~/.cache/...), one file per backend and device. It serves only where it was
measured: the same device name, arch, driver/ROCm version and Triton major.minor
(register allocation moves between Triton releases), written by the same package
version, for the exact layer shape, with every token tier it declares. Anything else (corrupt
JSON, another device, another version, a missing tier) is refused with a one-line message and the packaged table serves.
What an entry holds is the backend's business: each tabled backend declares a
`TableKind` beside its own tables (kernels/triton/table.py, kernels/flydsl/tiles.py)
and names it in its `BackendSpec`, so this module knows no backend.
Plain Python: importing this imports no GPU toolkit.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kimi_k3_moe import __version__, io_errors, settings

SCHEMA = "kimi-k3-moe/user-table"
FORMAT_VERSION = 1
ENV_DIR = settings.TABLES
INTERPRETER = "interpreter"

log = logging.getLogger("kimi_k3_moe")
_messages: dict[str, str] = {}  # path -> why it was refused (doctor shows these)


class UserTableError(ValueError):
    """A user table that must not serve; the message says why."""


# what reading a user's file may raise: a table is data, and no content of it may escape a lookup
DATA_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError, ArithmeticError)


@dataclass(frozen=True)
class TableKind:
    """How one backend's user-table entries read."""
    backend: str
    tiers_of: Callable[[dict], list]        # an entry -> the token tiers it holds
    check: Callable[[str, dict], None]      # (key, entry) -> None; raises ValueError, KeyError, TypeError
                                            # or IndexError on a config its backend cannot run
    packaged: Callable[[dict], str] | None = None   # device identity -> what the packaged table holds here


def device_key(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia_h200'; 'AMD Instinct MI300X' -> 'amd_instinct_mi300x'."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


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


def triton_version() -> str:
    """The running Triton's major.minor ('3.8'), what tuned tables are keyed by; 'none' without one."""
    try:
        import triton
    except ImportError:
        return "none"
    return ".".join(triton.__version__.split(".")[:2])


@cache
def device_identity(device: int = 0) -> dict:
    """What a table is valid for: device name, its key, arch, driver/ROCm version, Triton major.minor."""
    import torch
    if not torch.cuda.is_available():
        return {"name": INTERPRETER, "key": INTERPRETER, "arch": INTERPRETER, "driver": "none",
                "triton": triton_version()}
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        arch = getattr(props, "gcnArchName", "").split(":")[0]
    else:
        arch = f"sm_{props.major}{props.minor}"
    return {"name": props.name, "key": device_key(props.name), "arch": arch, "driver": _driver_version(),
            "triton": triton_version()}


# ---------------------------------------------------------------- validation
def validate(table: dict, *, kind: TableKind, identity: dict, path: Path | str = "table") -> dict:
    """`table` if it may serve here, else UserTableError naming the first reason."""
    backend = kind.backend
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
    if dev.get("triton") != identity.get("triton"):
        raise UserTableError(f"user table {path}: tuned under Triton {dev.get('triton')}, this is Triton "
                             f"{identity.get('triton')}; retune with `kimi-k3-moe tune`")
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
            have = kind.tiers_of(entry)
        except DATA_ERRORS as exc:
            raise UserTableError(f"user table {path}: entry {key} holds an invalid token tier: {exc}") from None
        missing = [t for t in tiers if t not in have]
        if missing:
            raise UserTableError(f"user table {path}: entry {key} lacks token tiers {missing}")
        try:
            kind.check(key, entry)
        except DATA_ERRORS as exc:
            raise UserTableError(f"user table {path}: entry {key} holds an invalid config: {exc}") from None
    return table


# ---------------------------------------------------------------- reading
@cache
def _load(kind: TableKind, path_text: str, identity_json: str) -> dict | None:
    path = Path(path_text)
    if not path.is_file():
        return None
    try:
        table = io_errors.read_json(path, UserTableError)
        table = validate(table, kind=kind, identity=json.loads(identity_json), path=path)
    except UserTableError as exc:
        why = str(exc) if str(exc).startswith("user table") else f"user table: {exc}"
    except DATA_ERRORS as exc:  # validate's own checks missed a shape: still data, never a crash
        why = f"user table {path}: malformed ({type(exc).__name__}: {exc})"
    else:
        _messages.pop(path_text, None)
        return table
    _messages[path_text] = why + "; the packaged table serves"
    log.warning("kimi-k3-moe: %s", _messages[path_text])
    return None


def load(kind: TableKind, identity: dict | None = None) -> tuple[dict | None, Path]:
    """(the valid user table for this device, or None; its path)."""
    identity = identity or device_identity()
    path = table_path(kind.backend, identity["key"])
    return _load(kind, str(path), json.dumps(identity, sort_keys=True)), path


def entry(kind: TableKind, key: str, identity: dict | None = None) -> tuple[dict, str] | None:
    """(entry `key` of this device's valid user table, where it came from), else None."""
    table, path = load(kind, identity)
    if table is None or key not in table["entries"]:
        return None
    return table["entries"][key], f"user table {path}"


def refused(path: Path, why: str) -> None:
    """A table that validated but that its backend still cannot use here: said once; the caller
    serves the packaged table."""
    text = f"user table {path}: {why}; the packaged table serves"
    if _messages.get(str(path)) != text:
        _messages[str(path)] = text
        log.warning("kimi-k3-moe: %s", text)


def describe(kind: TableKind) -> str:
    """One line for doctor and the plugin's log: which table serves and from where."""
    table, path = load(kind)
    if table is not None:
        return f"user table {path} (tuned {table.get('written', '?')}, {len(table['entries'])} shape(s))"
    why = _messages.get(str(path)) or f"no user table at {path}"
    held = f"{kind.packaged(device_identity())}; " if kind.packaged else ""
    return f"packaged table ({held}{why})"


def clear_cache() -> None:
    _load.cache_clear()
    device_identity.cache_clear()
    _messages.clear()


# ---------------------------------------------------------------- writing
def replace_file(path: Path, text: str) -> None:
    """Write `text` to a temporary beside `path`, then rename it over `path`: a reader never sees half a table."""
    io_errors.write_text(path, text)  # a failure is one line naming the path and the cause


def write(kind: TableKind, identity: dict, tiers: list[int], entries: dict, *, extra: dict | None = None,
          env=None) -> Path:
    """Write (replace) this device's user table for `kind.backend`; entries of other shapes are kept."""
    backend = kind.backend
    path = table_path(backend, identity["key"], env)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = {}
    try:
        old = validate(json.loads(path.read_text()), kind=kind, identity=identity, path=path)["entries"]
        old = {k: e for k, e in old.items() if set(tiers) <= set(kind.tiers_of(e))}
    except (OSError, ValueError):
        pass
    table = {"schema": SCHEMA, "format_version": FORMAT_VERSION, "backend": backend, "device": identity,
             "package_version": __version__, "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
             "tiers": list(tiers), "entries": {**old, **entries}, **(extra or {})}
    validate(table, kind=kind, identity=identity, path=path)
    replace_file(path, json.dumps(table, indent=1))
    _load.cache_clear()
    return path

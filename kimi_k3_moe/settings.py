"""Every KIMI_K3_MOE_* environment setting, validated where it is read.

One place lists each variable, its allowed values and its default, so a
typo is refused with the allowed values instead of meaning something else.
Kept free of other package imports: everything may import it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

BACKEND = "KIMI_K3_MOE_BACKEND"
ACT_DTYPE = "KIMI_K3_MOE_ACT_DTYPE"
SELF_CHECK = "KIMI_K3_MOE_SELF_CHECK"
CONVERTED = "KIMI_K3_MOE_CONVERTED"
VALIDATE_WEIGHTS = "KIMI_K3_MOE_VALIDATE_WEIGHTS"
TABLES = "KIMI_K3_MOE_TABLES"  # a folder `tune` creates if needed (configs/user_tables.py reads it)
FLYDSL_ROCM = "KIMI_K3_MOE_FLYDSL_ROCM"  # a ROCm-like root holding llvm/bin/ld.lld (kernels/flydsl/toolchain.py)
GSM8K_DIR = "KIMI_K3_MOE_GSM8K_DIR"  # `gsm8k --data-dir`'s default; gsm8k/data.py checks the folder
CHECK_EXPERT_IDS = "KIMI_K3_MOE_CHECK_EXPERT_IDS"  # reference.check_routing reads it per forward
REDUCE = "KIMI_K3_MOE_REDUCE"  # the FlyDSL top-k sum: its tile table's per-tier choice, or one for all

BACKENDS = ("torch", "triton", "flydsl")
ACT_DTYPES = ("bf16", "fp8", "fp4")
SELF_CHECK_MODES = ("fallback", "strict", "off")
VALIDATE_MODES = ("on", "off")
CHECK_IDS_MODES = ("off", "on")
REDUCE_MODES = ("auto", "slots", "fused", "atomic")

# name -> (allowed values, default); "" as default means "unset: no forcing"
CHOICES: dict[str, tuple[tuple[str, ...], str]] = {
    BACKEND: (BACKENDS, ""),
    ACT_DTYPE: (ACT_DTYPES, "bf16"),
    SELF_CHECK: (SELF_CHECK_MODES, "fallback"),
    VALIDATE_WEIGHTS: (VALIDATE_MODES, "on"),
    CHECK_EXPERT_IDS: (CHECK_IDS_MODES, "off"),
    REDUCE: (REDUCE_MODES, "auto"),
}


class SettingError(ValueError):
    """An environment setting holds a value this package does not accept."""


def choice(name: str, env: Mapping[str, str] | None = None) -> str:
    """The value of setting `name` (stripped; unset or empty gives its default), or SettingError."""
    allowed, default = CHOICES[name]
    value = (os.environ if env is None else env).get(name, "").strip()
    if not value:
        return default
    if value not in allowed:
        raise SettingError(f"{name}={value!r} is not accepted; choose one of {', '.join(allowed)}"
                           + ("" if default else " (or leave it unset)"))
    return value


def path(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """A folder setting (KIMI_K3_MOE_CONVERTED, KIMI_K3_MOE_GSM8K_DIR): None when unset; must be a
    folder this process can read when set."""
    value = (os.environ if env is None else env).get(name, "").strip()
    if not value:
        return None
    if not os.path.isdir(value):
        why = "is not a folder" if os.path.exists(value) else "does not exist"
        raise SettingError(f"{name}={value} {why}")
    if not os.access(value, os.R_OK | os.X_OK):
        raise SettingError(f"{name}={value}: permission denied (this user cannot read the folder)")
    return value


LINKER = os.path.join("llvm", "bin", "ld.lld")


def linker_root(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """A ROCm-like root setting (KIMI_K3_MOE_FLYDSL_ROCM): None when unset; when set, a folder holding
    an executable llvm/bin/ld.lld. Never replaced by another root when wrong: refused, naming it."""
    value = path(name, env)
    if value is None:
        return None
    linker = os.path.join(value, LINKER)
    if not os.path.isfile(linker) or not os.access(linker, os.X_OK):
        raise SettingError(f"{name}={value} holds no executable {LINKER}")
    return value


def folder_to_create(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """A folder setting a command may create (KIMI_K3_MOE_TABLES): None when unset; if something
    exists there it must be a folder."""
    value = (os.environ if env is None else env).get(name, "").strip()
    if not value:
        return None
    if os.path.exists(value) and not os.path.isdir(value):
        raise SettingError(f"{name}={value} exists and is not a folder")
    return value


# every setting that is not a choice -> the check it is read with
PATHS = {CONVERTED: path, GSM8K_DIR: path, TABLES: folder_to_create, FLYDSL_ROCM: linker_root}


def check_all(env: Mapping[str, str] | None = None) -> list[str]:
    """One message per invalid setting, every KIMI_K3_MOE_* one (for `doctor`)."""
    problems = []
    checks = [(choice, name) for name in CHOICES] + [(check, name) for name, check in PATHS.items()]
    for check, name in checks:
        try:
            check(name, env)
        except SettingError as exc:
            problems.append(str(exc))
    return problems

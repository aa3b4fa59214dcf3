"""`BackendSpec`: what a backend declares about itself, cheap to import (no kernel compiler, no torch
state): where it runs, which weight formats and activation dtypes, which activation quantization it
applies, whether it may run inside a CUDA graph, and how to make it.

Dispatch filters the ordered list of specs (`kimi_k3_moe.kernels.SPECS`) by `supports`; nothing
asks a backend module for optional hooks or compares backend names.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kimi_k3_moe.act_quant import BF16, ActQuant
from kimi_k3_moe.platform import Platform


class BackendUnavailable(RuntimeError):
    """A backend was asked for where it cannot run; the message says why."""


def _no_options(platform: Platform, weight_format: str) -> dict[str, Any]:
    return {}


def _default_act_quant(arch: str | None, act_dtype: str) -> ActQuant:
    return ActQuant.for_dtype(act_dtype)


def _bf16_only(platform: Platform, weight_format: str) -> tuple[str, ...]:
    return (BF16,)


@dataclass(frozen=True)
class BackendSpec:
    name: str
    module: str                                             # holds `make_backend(**options)`
    runs_on: Callable[[Platform, str], tuple[bool, str]]    # (platform, weight format) -> (ok, why)
    act_dtypes: Callable[[Platform, str], tuple[str, ...]] = _bf16_only
    options: Callable[[Platform, str], dict[str, Any]] = _no_options   # plan options besides weight_format
    act_quant_for: Callable[[str | None, str], ActQuant] = _default_act_quant
    graph_safe: bool = True     # forward reads no device memory from the host (CUDA-graph capture)
    self_checked: bool = True   # False: the reference's own arithmetic, nothing to check against
    emulates: bool = False      # True: computes whatever activation scheme it is given (a fallback)
    arch_bound: bool = False    # True: built for one arch; cannot even be made where `runs_on` says no
    user_table: str | None = None  # the module whose USER_TABLE (user_tables.TableKind) `tune` writes; None: no tiles

    def supports(self, platform: Platform, weight_format: str, act_dtype: str = BF16) -> tuple[bool, str]:
        """(whether this backend serves `weight_format` with `act_dtype` activations on `platform`, why)."""
        ok, why = self.runs_on(platform, weight_format)
        if not ok:
            return False, why
        supported = self.act_dtypes(platform, weight_format)
        if act_dtype not in supported:
            return False, (f"the {self.name} backend does not run {act_dtype} activations on {platform}; "
                           f"supported there: {', '.join(supported)}")
        return True, why

    def make(self, **options) -> Any:
        """The backend, built with `options` (its module is imported here, not before)."""
        try:
            factory = importlib.import_module(self.module).make_backend
        except (ImportError, AttributeError) as exc:
            raise BackendUnavailable(f"backend {self.name!r} is not installed here: {exc}") from exc
        return factory(**options)

    def table_kind(self) -> Any:
        """The user_tables.TableKind of this backend's tuned tiles (its module is imported here)."""
        if self.user_table is None:
            raise ValueError(f"the {self.name} backend reads no tile table")
        return importlib.import_module(self.user_table).USER_TABLE

    def table_line(self) -> str | None:
        """Which tile table serves this backend here (doctor, the plugin's log); None: it reads none."""
        from kimi_k3_moe.configs import user_tables
        return user_tables.describe(self.table_kind()) if self.user_table else None

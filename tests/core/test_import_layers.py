"""The package's layers, checked on the source: every `import` (module level or inside a function).

  formats, configs.hf_dict, settings, the bottom floor: import nothing of the package above them
  io_errors
  activation, act_quant, experts      expert data and what an activation is
  platform                            what GPU this is, and what its hardware runs
  weights, reference, routing         checkpoints and conversion; the float reference
  kernels                             the backends, behind kernels.base and kernels.spec
  dispatch, self_check, loading,      the core: the plan, the one load loop, a layer's experts
  routed_experts
  plugin_entrypoints, cli, ...        engine adapters and commands, on top

Inside kernels, kernels.common (the glue both GPU backends launch) imports no backend, and no backend
imports another. The development package k3lab (emulator, ISA model, sweep, artifact reader) sits
outside the package: nothing in kimi_k3_moe imports it. docs/ARCHITECTURE.md draws the same picture.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kimi_k3_moe

PACKAGE = Path(kimi_k3_moe.__file__).parent
CORE = ("kimi_k3_moe.dispatch", "kimi_k3_moe.self_check", "kimi_k3_moe.loading", "kimi_k3_moe.routed_experts")
ADAPTERS = ("kimi_k3_moe.plugin_entrypoints",)
BACKENDS = ("kimi_k3_moe.kernels.triton", "kimi_k3_moe.kernels.flydsl", "kimi_k3_moe.kernels.torch")
LAB = ("k3lab",)
COMMANDS = ("kimi_k3_moe.cli", "kimi_k3_moe.doctor", "kimi_k3_moe.demo", "kimi_k3_moe.convert",
            "kimi_k3_moe.gsm8k", "kimi_k3_moe.bench", "kimi_k3_moe.tune")


def under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {name for name in found if under(name, ("kimi_k3_moe", *LAB))}


MODULES = {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def offending(importers, forbidden=(), allowed=None) -> list[str]:
    """"X imports Y" for each module X under `importers` importing a forbidden Y, or (with `allowed`)
    anything of the package outside `allowed` and `importers` themselves."""
    bad = []
    for module, imported in MODULES.items():
        if not under(module, importers):
            continue
        for name in sorted(imported):
            if name == "kimi_k3_moe" or name.startswith("kimi_k3_moe.__"):
                continue  # the package itself (__version__)
            if under(name, forbidden) or (allowed is not None and not under(name, (*allowed, *importers))):
                bad.append(f"{module} imports {name}")
    return bad


def test_the_rules_catch_a_violation(monkeypatch):
    monkeypatch.setitem(MODULES, "kimi_k3_moe.weights.checkpoint", {"kimi_k3_moe.kernels.base"})
    assert offending(("kimi_k3_moe.weights",), forbidden=("kimi_k3_moe.kernels",)) == [
        "kimi_k3_moe.weights.checkpoint imports kimi_k3_moe.kernels.base"]
    monkeypatch.setitem(MODULES, "kimi_k3_moe.experts.int4", {"kimi_k3_moe.platform"})
    assert offending(("kimi_k3_moe.experts",), allowed=("kimi_k3_moe.formats",)) == [
        "kimi_k3_moe.experts.int4 imports kimi_k3_moe.platform"]


def test_the_rules_catch_a_lab_import_and_a_borrowed_backend(monkeypatch):
    monkeypatch.setitem(MODULES, "kimi_k3_moe.kernels.flydsl.build", {"k3lab.flydsl.artifacts"})
    monkeypatch.setitem(MODULES, "kimi_k3_moe.kernels.flydsl.pipeline", {"kimi_k3_moe.kernels.triton.stage2"})
    assert offending(("kimi_k3_moe",), forbidden=LAB) == [
        "kimi_k3_moe.kernels.flydsl.build imports k3lab.flydsl.artifacts"]
    assert offending(("kimi_k3_moe.kernels.flydsl",), forbidden=("kimi_k3_moe.kernels.triton",)) == [
        "kimi_k3_moe.kernels.flydsl.pipeline imports kimi_k3_moe.kernels.triton.stage2"]


def test_the_scan_sees_the_imports():
    assert "kimi_k3_moe.experts" in MODULES["kimi_k3_moe.weights.checkpoint"]
    assert "kimi_k3_moe.loading" in MODULES["kimi_k3_moe.routed_experts"]
    assert "kimi_k3_moe.kernels.common.alignment" in MODULES["kimi_k3_moe.kernels.flydsl.pipeline"]


@pytest.mark.parametrize("floor, allowed", [
    (("kimi_k3_moe.formats",), ("kimi_k3_moe.formats",)),
    (("kimi_k3_moe.configs.hf_dict",), ()),
    (("kimi_k3_moe.settings",), ()),
    (("kimi_k3_moe.io_errors",), ()),
    (("kimi_k3_moe.experts",), ("kimi_k3_moe.formats",)),
    (("kimi_k3_moe.activation",), ("kimi_k3_moe.formats", "kimi_k3_moe.configs.hf_dict")),
    (("kimi_k3_moe.act_quant",), ("kimi_k3_moe.formats", "kimi_k3_moe.settings")),
    (("kimi_k3_moe.amd_archs",), ("kimi_k3_moe.act_quant", "kimi_k3_moe.experts", "kimi_k3_moe.formats",
                                  "kimi_k3_moe.settings")),
    (("kimi_k3_moe.platform",), ("kimi_k3_moe.act_quant", "kimi_k3_moe.amd_archs", "kimi_k3_moe.experts",
                                 "kimi_k3_moe.formats", "kimi_k3_moe.settings")),
])
def test_the_bottom_floors_import_nothing_above_them(floor, allowed):
    assert offending(floor, allowed=allowed) == []


def test_weights_never_import_kernels_or_anything_above():
    assert offending(("kimi_k3_moe.weights",), forbidden=("kimi_k3_moe.kernels", *CORE, *ADAPTERS, *COMMANDS)) == []


def test_kernels_never_import_dispatch_the_core_or_the_adapters():
    assert offending(("kimi_k3_moe.kernels",), forbidden=("kimi_k3_moe.weights", *CORE, *ADAPTERS, *COMMANDS)) == []


def test_adapters_reach_kernels_only_through_the_core():
    assert offending(ADAPTERS, forbidden=("kimi_k3_moe.kernels",)) == []


def test_the_core_never_imports_an_adapter_or_a_command():
    assert offending(CORE, forbidden=(*ADAPTERS, *COMMANDS)) == []


def test_the_shared_glue_imports_no_backend():
    assert offending(("kimi_k3_moe.kernels.common",), forbidden=BACKENDS) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_backend_imports_another(backend):
    assert offending((backend,), forbidden=tuple(b for b in BACKENDS if b != backend)) == []


def test_the_serving_package_never_imports_the_lab():
    """k3lab (emulator, ISA model, sweep, artifact reader) serves tests and benchmarks only and is not
    in the wheel: a serving module importing it would fail on every user's install."""
    assert offending(("kimi_k3_moe",), forbidden=LAB) == []

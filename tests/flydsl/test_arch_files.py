"""A new AMD arch or a new K-loop schedule touches at most three files, listed here.

  new arch:     its AmdArch in amd_archs.py, its tiers in configs/tables/flydsl_tiles.json and, only if
                its bf16 MFMA has a new shape, that shape's instruction in kernels/flydsl/_details/device.py
  new schedule: its KLoop member (and the property it turns on) in kernels/flydsl/config.py, its
                K-loop order in kernels/flydsl/_details/moe_gemm.py, and the tiers that take it in the JSON

So no other module may spell an arch, an MFMA shape or a schedule: they read the traits and the
schedule's properties. Modules that name an arch for an engine's own path (aiter's K3 kernels on
gfx950) or a conversion default state facts about engines, not hardware, and are listed apart.
"""
from __future__ import annotations

import ast
import json
import re
from importlib import resources
from pathlib import Path

import kimi_k3_moe
from kimi_k3_moe.amd_archs import AMD_ARCHS
from kimi_k3_moe.kernels.flydsl import tiles
from kimi_k3_moe.kernels.flydsl.config import KLoop

PACKAGE = Path(kimi_k3_moe.__file__).parent
ARCH_HOME = "amd_archs.py"
MFMA_HOME = "kernels/flydsl/_details/device.py"
SCHEDULE_HOME = "kernels/flydsl/config.py"
SCHEDULE_KERNEL = "kernels/flydsl/_details/moe_gemm.py"
ENGINE_FACTS = {"dispatch.py", "bench/command.py", "bench/peers/aiter.py", "weights/converted.py"}
ARCH_FILES = {ARCH_HOME, "configs/tables/flydsl_tiles.json", MFMA_HOME}
SCHEDULE_FILES = {SCHEDULE_HOME, SCHEDULE_KERNEL, "configs/tables/flydsl_tiles.json"}


def _modules():
    return {p.relative_to(PACKAGE).as_posix(): p for p in sorted(PACKAGE.rglob("*.py"))}


def _string_constants(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def test_at_most_three_files_per_arch_and_per_schedule():
    assert len(ARCH_FILES) <= 3 and len(SCHEDULE_FILES) <= 3
    assert all((PACKAGE / f).exists() for f in ARCH_FILES | SCHEDULE_FILES)


def test_only_the_traits_name_an_amd_arch():
    naming = {rel for rel, p in _modules().items()
              if any(re.fullmatch(r"gfx\d+[a-z]?", s) for s in _string_constants(p))}
    assert naming - ENGINE_FACTS == {ARCH_HOME}


def test_only_the_traits_and_the_mfma_spelling_name_an_mfma_shape():
    naming = {rel for rel, p in _modules().items()
              if any(re.fullmatch(r"\d+x\d+x\d+", s) for s in _string_constants(p))}
    assert naming == {ARCH_HOME, MFMA_HOME}
    device = (PACKAGE / MFMA_HOME).read_text()
    assert all(f'"{t.mfma}"' in device or t.mfma == _fallback_shape(device) for t in AMD_ARCHS.values())


def _fallback_shape(device_source: str) -> str:
    """device.mma branches on one shape and issues the 16x16x16 `_1k` form otherwise."""
    return "16x16x16" if "mfma_f32_16x16x16bf16_1k" in device_source else ""


def test_the_tile_table_has_the_tiers_of_every_arch_and_no_other():
    data = json.loads(resources.files("kimi_k3_moe.configs").joinpath("tables", tiles.TABLE).read_text())
    assert set(data) - {"about"} == set(AMD_ARCHS) == set(tiles.default_table())


def test_only_the_config_spells_a_schedule_and_the_kernels_read_its_properties():
    naming = {rel for rel, p in _modules().items() if _names_a_member(p)}
    # tiles.py names GLOBAL as the fallback of quantized activations: a new member leaves it as it is
    assert naming <= {SCHEDULE_HOME, "kernels/flydsl/tiles.py"}
    compares = re.compile(r"schedule(\.value)?\s*(==|!=|\bis\b|\bin\b)|schedule\.value\.")
    assert not [rel for rel, p in _modules().items() if rel != SCHEDULE_HOME and compares.search(p.read_text())]
    kernel = (PACKAGE / SCHEDULE_KERNEL).read_text()
    assert all(f"schedule.{prop}" in kernel for prop in ("prefetch", "load_first", "staged"))


def _names_a_member(path: Path) -> bool:
    """KLoop.<MEMBER> in code, or a KLoop built from a literal value."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "KLoop" \
                and node.attr in KLoop.__members__:
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "KLoop" \
                and node.args and isinstance(node.args[0], ast.Constant):
            return True
    return False


def test_each_schedule_has_its_own_name_suffix():
    assert len({m.name_suffix for m in KLoop}) == len(KLoop)

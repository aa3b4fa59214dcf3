"""No kimi-k3-moe release is on PyPI: users install from a checkout or a wheel built from one.
A wheel built from the tracked sources installs, and each of its entry points loads from it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import kimi_k3_moe

CHECKOUT = Path(__file__).resolve().parents[2]
EXPECTED = {("console_scripts", "kimi-k3-moe", "kimi_k3_moe.cli:main"),
            ("vllm.general_plugins", "kimi_k3_moe", "kimi_k3_moe.plugin_entrypoints.vllm:register"),
            ("sglang.srt.plugins", "kimi_k3_moe", "kimi_k3_moe.plugin_entrypoints.sglang:register")}

LOAD = r"""
import importlib.metadata as m, json, sys
dist, = m.distributions(path=[sys.argv[1]])
loaded = []
for ep in dist.entry_points:
    fn = ep.load()
    loaded.append([ep.group, ep.name, ep.value, sys.modules[fn.__module__].__file__])
print(json.dumps({"version": dist.version, "entry_points": loaded}))
"""


def _setuptools_major() -> int:
    try:
        import setuptools
    except ImportError:
        return 0
    return int(setuptools.__version__.split(".")[0])


def test_a_built_wheel_installs_and_its_entry_points_load(tmp_path):
    # a copy: building in the checkout would leave build/ and an egg-info there
    src = tmp_path / "src"
    for package in ("kimi_k3_moe", "k3lab"):   # k3lab beside it, as in the checkout, to see it left out
        shutil.copytree(CHECKOUT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(CHECKOUT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # this venv's setuptools when it reads pyproject.toml's SPDX license (>= 77): nothing fetched;
    # else pip's isolated build fetches one
    isolation = [] if _setuptools_major() < 77 else ["--no-build-isolation"]
    build = subprocess.run([*pip, "wheel", "--no-deps", *isolation, "-w", str(tmp_path / "dist"), str(src)],
                           timeout=300, capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    wheel, = (tmp_path / "dist").glob("kimi_k3_moe-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert "kimi_k3_moe/configs/tables/triton_nvidia_h200.json" in names  # package data
    assert not [n for n in names if n.startswith("k3lab/")]               # the lab is development only
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=300, capture_output=True)
    # outside the checkout, with the installed copy first on the path
    run = subprocess.run([sys.executable, "-c", LOAD, str(target)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert found["version"] == kimi_k3_moe.__version__
    assert {tuple(e[:3]) for e in found["entry_points"]} == EXPECTED
    for *_, module_file in found["entry_points"]:
        assert Path(module_file).is_relative_to(target), module_file

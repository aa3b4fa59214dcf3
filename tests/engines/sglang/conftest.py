"""SGLang suite: runs in the venv `make test-sglang` builds (real sglang==0.5.23, CPU-only box).

SGLANG_USE_CPU_ENGINE must stay unset: with it, FusedMoE's import chain loads
sgl_kernel, which needs libcuda.so.1. In SGLang's default mode on a machine
without a GPU, FusedMoE and Kimi-K3's MoE block build and run on generic torch
paths.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]  # the core venv has no sglang; `make test-sglang` does
else:
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    os.environ.pop("SGLANG_PLUGINS", None)

def pytest_configure(config):
    # SGLang's import chain (flashinfer, cutlass DSL) raises dozens of these.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning")


@pytest.fixture(scope="session")
def sglang_plugins_loaded():
    """SGLang's own loader, once for this process, as every server process does at start."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

    assert hasattr(Mxfp4Config.get_quant_method, "__wrapped__"), "plugin hook not applied"


def _checkpoint(tmp_path_factory, name: str, seed: int, **options):
    from kimi_k3_moe.weights.synthetic import make_checkpoint
    from sglang_k3 import SHAPE, add_attention_fields

    path = make_checkpoint(tmp_path_factory.mktemp(name), seed=seed, **SHAPE, **options)
    return path, add_attention_fields(path)


@pytest.fixture(scope="session")
def k3_checkpoint(tmp_path_factory, session_seed):
    """(folder, config dict) of a synthetic K3 checkpoint with 2-D scales."""
    return _checkpoint(tmp_path_factory, "k3", session_seed)


@pytest.fixture(scope="session")
def k3_checkpoint_4d_scales(tmp_path_factory, session_seed):
    """The same shape with the 4-D scales some exports write ([N, 1, K/32, 1])."""
    return _checkpoint(tmp_path_factory, "k3_4d", session_seed + 1, scale_4d=True)

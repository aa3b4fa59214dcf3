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
    from suite_skip import skipped_module

    def pytest_pycollect_makemodule(module_path, parent):
        return skipped_module(module_path, parent, "sglang is not installed in this venv; `make test-sglang` runs "
                              "this suite in the venv it builds")
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
    from sglang_k3 import SHAPE, add_attention_fields

    from kimi_k3_moe.weights.synthetic import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp(name), seed=seed, **SHAPE, **options)
    add_attention_fields(path)
    return path


@pytest.fixture(scope="session")
def k3_checkpoint(tmp_path_factory, session_seed):
    """The folder of a synthetic K3 checkpoint with 2-D scales (the vLLM suite's fixture of the same name)."""
    return _checkpoint(tmp_path_factory, "k3", session_seed)


@pytest.fixture(scope="session")
def k3_checkpoint_4d_scales(tmp_path_factory, session_seed):
    """The same shape with the 4-D scales some exports write ([N, 1, K/32, 1])."""
    return _checkpoint(tmp_path_factory, "k3_4d", session_seed + 1, scale_4d=True)


@pytest.fixture(scope="session")
def k3_config(k3_checkpoint):
    """k3_checkpoint's config.json as a dict (with the attention fields SGLang's K3 model reads)."""
    from sglang_k3 import config_of

    return config_of(k3_checkpoint)

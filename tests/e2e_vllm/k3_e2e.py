"""Names the end-to-end suite's conftest and tests share (a module of its own: `conftest` is
ambiguous on sys.path, every suite has one)."""
from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parents[1]
VLLM_PYTHON = os.environ.get("KIMI_K3_MOE_VLLM_PYTHON")
# vLLM plugin names (entry-point names): ours, and the suite's two test-only ones
PLUGIN, SHIM, REFERENCE = "kimi_k3_moe", "k3_cpu_shim", "k3_reference_moe"
# the MLA backend every vLLM process of the suite asks for: the one k3_cpu_shim is written for (on a CPU
# with AMX tiles vLLM would otherwise take AMX_MLA)
ATTENTION_BACKEND = "CPU_MLA"

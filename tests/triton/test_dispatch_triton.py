"""How dispatch and get_backend treat the Triton backend on a CPU machine."""
import subprocess
import sys

import pytest

from kimi_k3_moe.dispatch import ENV_BACKEND, plan_backends
from kimi_k3_moe.kernels import BackendUnavailable, get_backend
from kimi_k3_moe.loading import resolve
from kimi_k3_moe.platform import Platform


def test_forced_triton_without_gpu_fails_clearly(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    plan = plan_backends(Platform("cpu"), {ENV_BACKEND: "triton"})
    with pytest.raises(BackendUnavailable, match="no GPU visible.*TRITON_INTERPRET=1"):
        resolve(plan)
    ok, why = get_backend("triton").available()
    assert not ok and "sm_80" in why


def test_interpreter_makes_it_available(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend, choice, _ = resolve(plan_backends(Platform("cpu"), {ENV_BACKEND: "triton"}))
    assert backend.name == "triton" and backend.describe() == "triton[mxfp4]"


def test_cuda_and_rocm_plans_use_triton():
    assert plan_backends(Platform("cuda", "sm_90", "H200"), {})[0].name == "triton"
    rocm = plan_backends(Platform("rocm", "gfx942", "MI300X"), {})
    assert [c.name for c in rocm][:2] == ["flydsl", "triton"] and rocm[1].options["weight_format"] == "int4"
    forced = plan_backends(Platform("rocm", "gfx950", "MI355X"), {ENV_BACKEND: "triton"})
    assert [(c.name, dict(c.options)) for c in forced] == [("triton", {"weight_format": "mxfp4", "act_dtype": "bf16"})]


def test_package_import_does_not_import_triton():
    code = ("import sys, kimi_k3_moe.kernels.triton, kimi_k3_moe.kernels.triton.table, kimi_k3_moe.dispatch; "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_hopper_refuses_fp8_activations_in_one_line():
    """The Triton fp8 kernels were removed (kernels/triton/__init__.py): on sm_90 fp8 is refused at
    planning with the arch and its choices, never served as bf16."""
    from kimi_k3_moe.act_quant import UnsupportedActDtype
    with pytest.raises(UnsupportedActDtype) as err:
        plan_backends(Platform("cuda", "sm_90", "H200"), {"KIMI_K3_MOE_ACT_DTYPE": "fp8"})
    assert "\n" not in str(err.value) and "sm_90" in str(err.value) and "bf16" in str(err.value)
    with pytest.raises(ValueError, match="fp8.*triton backend on sm_90; supported there: bf16$"):
        get_backend("triton", act_dtype="fp8", arch="sm_90")

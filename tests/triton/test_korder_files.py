"""A new K order touches three files: its KOrder member (with its code and ORDER_ name) in
_details/constants.py, its branches in _details/matmul_kernels.py, and its candidates in
tuning_space.py. So no other module may spell an order's code: they derive it from the member."""
from __future__ import annotations

import re
from pathlib import Path

import kimi_k3_moe
from kimi_k3_moe.kernels.triton import korder
from kimi_k3_moe.kernels.triton._details import constants as C
from kimi_k3_moe.kernels.triton.table import KernelConfig, KOrder

PACKAGE = Path(kimi_k3_moe.__file__).parent
HOME = PACKAGE / "kernels" / "triton" / "_details" / "constants.py"
KERNELS = PACKAGE / "kernels" / "triton" / "_details" / "matmul_kernels.py"


def test_each_member_has_its_code_and_its_kernel_name():
    assert sorted(o.code for o in KOrder) == list(range(len(KOrder)))
    assert {o.name: o.code for o in KOrder} == {name[len("ORDER_"):]: v for name, v in vars(C).items()
                                                 if name.startswith("ORDER_")}
    assert KOrder.__module__ == C.__name__ and KOrder.PAIRS.stored_order in KOrder


def test_the_stage_constexprs_come_from_the_members():
    for order in KOrder:
        assert korder.stage2_args(KernelConfig(order=order)) == {"ORDER": order.code}
        s1 = korder.stage1_args(KernelConfig(order=order), KernelConfig(order=order, n_tiles=2))
        stored = order.stored_order
        assert s1 == {"ORDER": order.code, "OUT_ORDER": 128 if stored == KOrder.WORDS else stored.code}


def test_only_the_home_and_the_kernels_name_the_codes():
    names = re.compile(rf"\bORDER_(?:{'|'.join(o.name for o in KOrder)})\b")
    naming = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if names.search(p.read_text())}
    assert naming == {p.relative_to(PACKAGE).as_posix() for p in (HOME, KERNELS)}
    assert "import constants" not in (PACKAGE / "kernels" / "triton" / "korder.py").read_text()

"""One kernel launch, described as data.

The backend runs these; the ahead-of-time compile test compiles exactly the
same kernel, arguments and constexprs for other targets (see aot.py), so what
CI compiles is what the backend launches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class Launch:
    kernel: Any                 # a triton JITFunction
    grid: tuple[int, ...]
    args: dict[str, Any]        # every kernel parameter by name, constexprs included
    num_warps: int = 4
    num_stages: int = 3
    label: str = field(default="")

    def __call__(self) -> None:
        self.kernel[self.grid](**self.args, num_warps=self.num_warps, num_stages=self.num_stages)

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__

    def constexprs(self) -> dict[str, Any]:
        return {p.name: self.args[p.name] for p in self.kernel.params if p.is_constexpr}

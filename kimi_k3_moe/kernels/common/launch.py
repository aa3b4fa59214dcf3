"""One kernel launch, described as data.

The backend runs these; the ahead-of-time compile test compiles exactly the
same kernel, arguments and constexprs for other targets (see aot.py), so what
CI compiles is what the backend launches.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def chain_dependents(launches: list[Launch]) -> list[Launch]:
    """One forward's launches, each after the first started as a programmatic dependent of the
    one before it (NVIDIA sm_90+; the kernels wait before reading: _details/pdl.py)."""
    return [launch.as_dependent(first=i == 0) for i, launch in enumerate(launches)]


@dataclass
class Launch:
    kernel: Any                 # a triton JITFunction
    grid: tuple[int, ...]
    args: dict[str, Any]        # every kernel parameter by name, constexprs included
    num_warps: int = 4
    num_stages: int = 3
    label: str = field(default="")
    pdl: bool = False           # launched as a programmatic dependent of the launch before it (CUDA sm_90+)

    def options(self) -> dict[str, Any]:
        """The launch options besides the arguments (what the JIT and an AOT compile take)."""
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.pdl:
            opts["launch_pdl"] = True
        return opts

    def __call__(self) -> None:
        self.kernel[self.grid](**self.args, **self.options())

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__

    def as_dependent(self, first: bool) -> Launch:
        """This launch with programmatic dependent launch on (its kernel's PDL constexpr; the launch
        attribute unless it is the first of its chain): see _details/pdl.py."""
        return replace(self, args={**self.args, "PDL": True}, pdl=not first)

    def constexprs(self) -> dict[str, Any]:
        return {p.name: self.args[p.name] for p in self.kernel.params if p.is_constexpr}

"""One interface for everything the bench times: our backends and the engines' own paths.

A `Peer` says whether it can run here (`probe`, with the version it found or
why not) and `build`s a `Runner` on the bench's MXFP4 experts. A runner splits
its work into `route` (index preparation the bench keeps out of the timed
region, e.g. triton_kernels' routing) and `run` (what is timed). It also says
which function it computes (`activation`) and on which weights
(`reference_weights`), so the bench checks it against the float reference of
that very function before timing it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

ENGINE, OURS, OTHER = "engine", "ours", "peer"


class PeerUnavailable(RuntimeError):
    """The peer cannot run here; the message says why."""


@dataclass
class Runner:
    run: Callable[[torch.Tensor, Any], torch.Tensor]        # (hidden, routed) -> [T, H]
    activation: Any                                            # has .apply(h [.., 2I]) -> [.., I]
    route: Callable[[torch.Tensor, torch.Tensor], Any] = lambda weights, ids: (weights, ids)
    reference_weights: tuple[Callable[[int], torch.Tensor], Callable[[int], torch.Tensor]] | None = None
    notes: list[str] = field(default_factory=list)
    act_quant: Any = None  # the activation quantization the reference must apply too (None: bf16)
    route_in_timing: bool = True  # False: `route` is excluded from the timed region (said in the output)


class Peer(ABC):
    name: str = "?"
    role: str = OTHER
    label: str = ""

    @abstractmethod
    def probe(self) -> tuple[bool, str]:
        """(can run here, the version found or why not); never raises."""

    @abstractmethod
    def build(self, experts, activation, shape, expert_map: torch.Tensor | None) -> Runner:
        """Prepare this peer's layout from the MXFP4 `experts`; raises PeerUnavailable."""

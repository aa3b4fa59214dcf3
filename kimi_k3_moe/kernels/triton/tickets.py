"""The split stage 1's tickets (_details/split_kernels.py): one int32 counter per (pair, N tile).

Zeroed once here and left zero by each (pair, tile)'s last program, so no launch clears them.
One buffer per device, kept for the process (a captured graph holds its address) and shared by
the forwards on that device, which run one after another, as the alignment's counters are
(kernels/common/alignment.counters). Its size (4 MB) bounds the pairs x N tiles a split stage 1
takes: at EP16 (I 3072 in 32-column tiles, top-16) 682 tokens, far past the 1-16 it is for.
"""
from __future__ import annotations

import torch

CAPACITY = 1 << 20
_TICKETS: dict[str, torch.Tensor] = {}


def tickets(device: torch.device | str, needed: int = 0) -> torch.Tensor:
    """The device's counters (int32 [CAPACITY]); made when a backend prepares a layer, since made
    inside a graph capture their zeroing would run only when that graph replays (refused)."""
    if needed > CAPACITY:
        raise ValueError(f"the split stage 1 needs {needed} tickets (pairs x N tiles), more than its {CAPACITY}: "
                         "use a wider stage1.block_n or another path for this many tokens")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if key not in _TICKETS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the split stage 1's tickets for {device} do not exist yet: prepare the experts "
                               "(or run one forward) before capturing a graph")
        _TICKETS[key] = torch.zeros(CAPACITY, dtype=torch.int32, device=device)
    return _TICKETS[key]

"""Plain PyTorch with bf16 weights (dequantised from the same MXFP4): torch._grouped_mm."""
from __future__ import annotations

import torch

from kimi_k3_moe.bench.peers.base import OTHER, Peer, PeerUnavailable, Runner


class TorchGroupedPeer(Peer):
    name, role, label = "torch_grouped_mm", OTHER, "PyTorch _grouped_mm, bf16 weights"

    def probe(self) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            return False, "needs a GPU (torch._grouped_mm has no CPU kernel for this use)"
        if not hasattr(torch, "_grouped_mm"):
            return False, f"torch {torch.__version__} has no torch._grouped_mm"
        return True, f"torch {torch.__version__}"

    def build(self, experts, activation, shape, expert_map) -> Runner:
        if expert_map is not None:
            raise PeerUnavailable("expert map (EP) not adapted for this peer")
        e, h, i = experts.num_experts, experts.hidden_size, experts.intermediate_size
        w13 = torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device=experts.device)
        w2 = torch.empty(e, h, i, dtype=torch.bfloat16, device=experts.device)
        for x in range(e):
            a, b = experts.dequantize(x)
            w13[x], w2[x] = a, b

        def run(hidden, routed):
            weights, ids = routed
            t, k = ids.shape
            flat = ids.reshape(-1).long()
            order = torch.argsort(flat, stable=True)
            counts = torch.zeros(e, dtype=torch.int32, device=hidden.device)
            counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            tok = order // k
            mid = activation.apply(torch._grouped_mm(hidden[tok], w13.transpose(1, 2), offs=offs))
            y = torch._grouped_mm(mid.to(torch.bfloat16), w2.transpose(1, 2), offs=offs)
            y = y.float() * weights.reshape(-1)[order].unsqueeze(1)
            out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)
            out.index_add_(0, tok, y)
            return out.to(hidden.dtype)
        return Runner(run=run, activation=activation)

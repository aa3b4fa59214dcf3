"""The bench's rows: our backends and the peers, by name (each imports its toolkit only when built)."""
from __future__ import annotations

from kimi_k3_moe.bench.peers.base import ENGINE, OTHER, OURS, Peer, PeerUnavailable, Runner

PEER_NAMES = ("humming", "aiter", "triton_kernels", "torch")


def make_peer(name: str, peer_path: str | None = None) -> Peer:
    if name == "humming":
        from kimi_k3_moe.bench.peers.humming import HummingPeer
        return HummingPeer()
    if name == "aiter":
        from kimi_k3_moe.bench.peers.aiter import AiterPeer
        return AiterPeer()
    if name == "triton_kernels":
        from kimi_k3_moe.bench.peers.triton_kernels import TritonKernelsPeer
        return TritonKernelsPeer(peer_path)
    if name == "torch":
        from kimi_k3_moe.bench.peers.torch_grouped import TorchGroupedPeer
        return TorchGroupedPeer()
    raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEER_NAMES)}")


def make_ours(spec: str) -> Peer:
    """'triton' | 'triton:int4' | 'triton:mxfp4:fp8' (backend[:weight format[:activation dtype]]) ..."""
    from kimi_k3_moe.bench.peers.ours import OursPeer
    backend, fmt, act = (spec.split(":") + ["", ""])[:3]
    return OursPeer(backend, fmt or "mxfp4", **({"act_dtype": act} if act else {}))


__all__ = ["ENGINE", "OTHER", "OURS", "PEER_NAMES", "Peer", "PeerUnavailable", "Runner", "make_ours", "make_peer"]

"""The bench's rows: our backends and the peers, by name (each imports its toolkit only when built)."""
from __future__ import annotations

from kimi_k3_moe.bench.peers.base import ENGINE, OTHER, OURS, Peer, PeerUnavailable, Runner

PEER_NAMES = ("humming", "aiter", "triton_kernels", "flashinfer", "torch")


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
    if name == "flashinfer":
        from kimi_k3_moe.bench.peers.flashinfer import FlashInferPeer
        return FlashInferPeer(peer_path)
    if name == "torch":
        from kimi_k3_moe.bench.peers.torch_grouped import TorchGroupedPeer
        return TorchGroupedPeer()
    raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEER_NAMES)}")


def make_ours(spec: str) -> Peer:
    """'triton' | 'triton:int4' | 'flydsl:mxfp4:fp8' (backend[:weight format[:activation dtype]]) ..."""
    from kimi_k3_moe.act_quant import ACT_DTYPES
    from kimi_k3_moe.bench.peers.ours import OursPeer
    from kimi_k3_moe.experts import KINDS
    from kimi_k3_moe.kernels import SPECS
    parts = spec.split(":")
    backend, weight_format, act = (parts + ["", ""])[:3]
    # a typo is a usage error, as for --peers; not a row saying "not available"
    if len(parts) > 3 or backend not in {s.name for s in SPECS} or weight_format not in ("", *KINDS) \
            or act not in ("", *ACT_DTYPES):
        raise ValueError(f"--ours {spec!r}: expected backend[:weight format[:activation dtype]] with backend one "
                         f"of {', '.join(s.name for s in SPECS)}, format {'/'.join(KINDS)}, "
                         f"activation dtype {'/'.join(ACT_DTYPES)}")
    return OursPeer(backend, weight_format or "mxfp4", **({"act_dtype": act} if act else {}))


__all__ = ["ENGINE", "OTHER", "OURS", "PEER_NAMES", "Peer", "PeerUnavailable", "Runner", "make_ours", "make_peer"]

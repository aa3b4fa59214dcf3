"""FlashInfer's CUTLASS fused MoE on SM90 (PyPI `flashinfer-python`, Apache-2.0): MXFP4 weights x bf16
activations through `flashinfer.fused_moe.cutlass_fused_moe(use_w4_group_scaling=True)`, the path vLLM 0.33
selects on Hopper as its `flashinfer_cutlass` MXFP4 backend (a CUTLASS mixed-input grouped GEMM from
TensorRT-LLM, TMA and warp specialisation).

Our own glue, written from the wheel's documented API (nothing of FlashInfer is committed; the wheel is
fetched at benchmark time into `--peer-path` or installed beside the bench, never a dependency):
- fc1 is [up; gate] (TensorRT-LLM's w3 then w1; ours is [gate; up]), so the two halves of w13's codes and
  scales swap; codes and e8m0 scales then go through `interleave_moe_weights_for_sm90_mixed_gemm(.., "fp4")`
  and `interleave_moe_scales_for_sm90_mixed_gemm`, and `quant_scales = [w13 scales, w2 scales]`.
- The scale interleave works on 128-wide K blocks, so an intermediate size that is not a multiple of 128
  (TP16's 192) is padded with zero rows (w13) and zero K columns (w2) to the next multiple: the function is
  unchanged (SiTU(0, 0) = 0) but the padded bytes are streamed too (said in the row's notes).
- SiTUv2 is `ActivationType.Situ` with per-expert `situ_beta` / `situ_linear_beta`: the same formula,
  evaluated in fp32 on GEMM 1's bf16 output by a separate kernel (ours applies it to the fp32 sums);
  SiLU is `ActivationType.Swiglu`. SiTU without a linear beta has no FlashInfer form: not run.
- Deterministic finalize: `use_fused_finalize=False` (the default reduces with atomics).
- Expert parallelism: FlashInfer takes global expert ids with `ep_size` / `ep_rank` and holds the
  contiguous block [ep_rank * E_local, (ep_rank + 1) * E_local); the bench's rank holds the first experts,
  so an expert map is accepted when it is exactly that block (rank 0).
- The first call JIT-compiles the SM90 module with nvcc (many CUTLASS instantiations): its build time is
  measured in `build` and reported in the notes, never inside a timed figure. FlashInfer's autotuner
  runs once per token count in `route` (outside the timed region), as vLLM runs it at warm-up.
"""
from __future__ import annotations

import sys
import time

import torch

from kimi_k3_moe.activation import SILU, SITUV2
from kimi_k3_moe.bench.peers.base import OTHER, Peer, PeerUnavailable, Runner

TESTED_VERSION = "0.7.2.post1"
K_BLOCK = 128  # the SM90 mixed-input GEMM's scale blocks are 64 rows x 128 K


def pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def up_gate(t: torch.Tensor, inter: int) -> torch.Tensor:
    """w13 rows [gate; up] (ours) -> [up; gate] (fc1's order), on codes or scales alike."""
    return torch.cat([t[:, inter:2 * inter], t[:, :inter]], dim=1)


def padded_w13(t: torch.Tensor, inter: int, padded: int) -> torch.Tensor:
    """[E, 2I, ...] [up; gate] -> [E, 2P, ...]: each half gets zero rows up to P (zero codes and zero scale
    bytes: weights 0 * 2^-127, exactly 0)."""
    if padded == inter:
        return t.contiguous()
    pad = t.new_zeros(t.shape[0], padded - inter, *t.shape[2:])
    return torch.cat([t[:, :inter], pad, t[:, inter:], pad], dim=1).contiguous()


def padded_k(t: torch.Tensor, k_units: int) -> torch.Tensor:
    """[E, N, k] -> [E, N, k_units] with zero columns (w2's codes or scales along K)."""
    if t.shape[2] == k_units:
        return t.contiguous()
    return torch.cat([t, t.new_zeros(t.shape[0], t.shape[1], k_units - t.shape[2])], dim=2).contiguous()


def ep_split(expert_map: torch.Tensor | None, local: int) -> tuple[int, int]:
    """(ep_size, ep_rank) for FlashInfer, which holds the contiguous expert block of its rank."""
    if expert_map is None:
        return 1, 0
    routed = expert_map.numel()
    want = torch.full((routed,), -1, dtype=torch.int32, device=expert_map.device)
    want[:local] = torch.arange(local, dtype=torch.int32, device=expert_map.device)
    if routed % local or not torch.equal(expert_map.to(torch.int32), want):
        raise PeerUnavailable("FlashInfer holds a contiguous block of experts per rank: this expert map "
                              f"(rank of {local} of {routed} experts) is not rank 0's block")
    return routed // local, 0


class FlashInferPeer(Peer):
    name, role, label = "flashinfer", OTHER, "FlashInfer cutlass_fused_moe (SM90 MXFP4 x bf16)"

    def __init__(self, path: str | None = None):
        self.path = path

    def _import(self):
        if self.path and self.path not in sys.path:
            sys.path.insert(0, self.path)
        import flashinfer
        from flashinfer.fused_moe import core  # noqa: F401  (the API this adapter calls)
        return flashinfer

    def probe(self) -> tuple[bool, str]:
        if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
            return False, "needs an NVIDIA GPU"
        if torch.cuda.get_device_capability() != (9, 0):
            return False, "the adapter drives FlashInfer's SM90 mixed-input path: needs an sm_90 GPU"
        try:
            fi = self._import()
        except Exception as exc:  # absent, or a dependency missing
            return False, (f"flashinfer not importable ({type(exc).__name__}: {exc}); install flashinfer-python "
                           f"{TESTED_VERSION} or pass --peer-path")
        version = getattr(fi, "__version__", "?")
        note = "" if version == TESTED_VERSION else f"; adapter written for {TESTED_VERSION}"
        return True, f"flashinfer {version}{note}"

    def build(self, experts, activation, shape, expert_map) -> Runner:
        try:
            self._import()
            from flashinfer.autotuner import autotune
            from flashinfer.fused_moe import (
                cutlass_fused_moe,
                interleave_moe_scales_for_sm90_mixed_gemm,
                interleave_moe_weights_for_sm90_mixed_gemm,
            )
            from flashinfer.fused_moe.core import ActivationType, get_cutlass_fused_moe_module
        except Exception as exc:
            raise PeerUnavailable(f"flashinfer API differs from {TESTED_VERSION}: {type(exc).__name__}: {exc}") from exc
        act_kwargs = _activation_kwargs(activation, ActivationType, experts.num_experts, experts.device)
        ep_size, ep_rank = ep_split(expert_map, experts.num_experts)
        i = experts.intermediate_size
        p = pad_to(i, K_BLOCK)
        start = time.perf_counter()
        try:
            get_cutlass_fused_moe_module("90")  # the JIT build (nvcc), cached on disk afterwards
        except Exception as exc:
            raise PeerUnavailable(f"FlashInfer's SM90 module did not build: {type(exc).__name__}: {exc}") from exc
        build_s = time.perf_counter() - start
        w13 = interleave_moe_weights_for_sm90_mixed_gemm(padded_w13(up_gate(experts.w13_packed, i), i, p), "fp4")
        s13 = interleave_moe_scales_for_sm90_mixed_gemm(padded_w13(up_gate(experts.w13_scale, i), i, p))
        w2 = interleave_moe_weights_for_sm90_mixed_gemm(padded_k(experts.w2_packed, p // 2), "fp4")
        s2 = interleave_moe_scales_for_sm90_mixed_gemm(padded_k(experts.w2_scale, p // 32))
        tuned: set[int] = set()

        def call(hidden, weights, ids, out):
            return cutlass_fused_moe(hidden, ids, weights, w13, w2, torch.bfloat16, [s13, s2], output=out,
                                     ep_size=ep_size, ep_rank=ep_rank, use_w4_group_scaling=True,
                                     use_fused_finalize=False, **act_kwargs)

        def route(weights, ids):
            ids32, w32 = ids.to(torch.int32).contiguous(), weights.to(torch.float32).contiguous()
            t = ids.shape[0]
            if t not in tuned:  # FlashInfer's tactic choice for this count, as vLLM's warm-up does
                x = torch.randn(t, experts.hidden_size, device=ids.device, dtype=torch.bfloat16)
                with autotune(True):
                    call(x, w32, ids32, torch.empty_like(x))
                tuned.add(t)
            return w32, ids32

        def run(hidden, routed):
            w32, ids32 = routed
            return call(hidden, w32, ids32, torch.empty_like(hidden))
        notes = [f"JIT build of FlashInfer's SM90 module {build_s:.1f} s (0 if cached), not timed",
                 "finalize use_fused_finalize=False (deterministic); autotuned per token count outside the figure"]
        if p != i:
            notes.append(f"intermediate padded {i} -> {p} for the SM90 scale blocks: "
                         f"{p / i:.2f}x the weight bytes streamed")
        return Runner(run=run, activation=activation, route=route, route_in_timing=False, notes=notes)


def _activation_kwargs(activation, activation_type, local: int, device) -> dict:
    """cutlass_fused_moe's activation keywords for `activation` (K3's SiTUv2, or SiLU)."""
    if activation.name == SILU:
        return {"activation_type": activation_type.Swiglu}
    if activation.name != SITUV2 or activation.linear_beta is None:
        raise PeerUnavailable(f"FlashInfer's Situ always applies a linear beta: no form for {activation}")
    return {"activation_type": activation_type.Situ,
            "situ_beta": torch.full((local,), float(activation.beta), dtype=torch.float32, device=device),
            "situ_linear_beta": torch.full((local,), float(activation.linear_beta), dtype=torch.float32,
                                           device=device)}

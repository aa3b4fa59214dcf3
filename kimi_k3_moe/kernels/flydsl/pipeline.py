"""The FlyDSL MoE forward pass, written once for two executors.

`moe_forward` aligns the routing, allocates the buffers, picks the tiles and
calls `launch(config, args)` twice per token chunk (three times with quantized
activations: the hidden rows are quantized first) with exactly the arguments
of the FlyDSL launchers. On an AMD GPU `launch` runs the compiled kernels
(backend.py); on the CPU `emulator.launch` plays them lane by lane. Everything
around the kernels (this file) is therefore the same code in both cases.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kimi_k3_moe.act_quant import BF16
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.kernels.flydsl import tiles
from kimi_k3_moe.kernels.flydsl.align import align_tokens
from kimi_k3_moe.kernels.flydsl import layout
from kimi_k3_moe.kernels.flydsl.config import KernelConfig, QuantConfig, runtime_betas
from kimi_k3_moe.kernels.flydsl.experts import FlyDSLExperts
from kimi_k3_moe.reference import check_routing, local_slots

Launch = Callable[[KernelConfig | QuantConfig, tuple], None]
INT32_LIMIT = 2**31 - 1


def max_chunk_tokens(hidden: int, inter: int, top_k: int, num_experts: int) -> int:
    """Tokens per launch such that every 32-bit byte offset of every buffer stays below 2^31."""
    by_slots = INT32_LIMIT // (top_k * hidden * 2)        # SLOTS [T*k, H] bf16 (also X: T*H*2)
    by_acc = INT32_LIMIT // (hidden * 4)                  # ACC [T, H] fp32
    by_inter = (INT32_LIMIT // (inter * 2) - num_experts * (tiles.MAX_BM - 1)) // top_k   # INTER [P, I] bf16
    limit = min(by_slots, by_acc, by_inter)
    if limit < 1:
        raise ValueError(f"layer too large for 32-bit buffer offsets (H={hidden}, I={inter}, k={top_k}, "
                         f"E={num_experts})")
    return limit


def _quantized(elements: int, act_dtype: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (codes, e8m0 scales) buffers for `elements` quantized activations."""
    return (torch.empty(elements * layout.ACT_CODE_BITS[act_dtype] // 8, dtype=torch.uint8, device=device),
            torch.empty(elements // layout.GROUP, dtype=torch.uint8, device=device))


def _check_ids(local: torch.Tensor, num_experts: int) -> None:
    # A host-side check costs a sync, so it is skipped while a graph is being captured.
    if local.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    bad = (local >= num_experts) | (local < -1)
    if bool(bad.any()):
        raise ValueError(f"topk_ids (after expert_map) hold expert ids outside [0, {num_experts}) "
                         f"or < -1: {local[bad][:8].tolist()}")


def _check_pinned(configs, experts, activation, H, I, k, act_dtype):
    cfg1, cfg2 = configs
    want = {"weight_format": experts.weight_format, "has_offsets": experts.has_offsets, "top_k": k,
            "act_dtype": act_dtype}
    for cfg, stage, N, K in ((cfg1, 1, I, H), (cfg2, 2, H, I)):
        got = {f: getattr(cfg, f) for f in want}
        if cfg.stage != stage or (cfg.N, cfg.K) != (N, K) or got != want:
            raise ValueError(f"pinned config {cfg.name} does not fit stage {stage} of this layer "
                             f"(N={N}, K={K}, {want})")
    if cfg1.BM != cfg2.BM:
        raise ValueError(f"pinned configs align differently (BM {cfg1.BM} vs {cfg2.BM})")
    if cfg1.BM > tiles.MAX_BM:
        raise ValueError(f"pinned BM {cfg1.BM} exceeds {tiles.MAX_BM} (buffer offsets are sized for it)")
    runtime = cfg1.activation == "situv2" and cfg1.betas == "runtime"
    if (activation.name != "situv2") if runtime else (cfg1.activation_spec() != activation):
        raise ValueError(f"pinned stage-1 config {cfg1.name} does not compute {activation}")
    return cfg1, cfg2


def moe_forward(experts: FlyDSLExperts, hidden: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: ActivationSpec, expert_map: torch.Tensor | None, *,
                arch: str, launch: Launch, betas: str = "const", reduce: str = "slots",
                chunk_tokens: int | None = None, table: dict | None = None,
                configs: tuple[KernelConfig, KernelConfig] | None = None,
                act_dtype: str = BF16) -> torch.Tensor:
    """[T, H] -> [T, H] in hidden's dtype: this rank's sum over its experts.

    `configs` pins the (stage 1, stage 2) kernels instead of the tile table's choice
    (tests use it to reach every variant); they must match the layer and each other.
    `act_dtype` "fp8"/"fp4" (gfx950): hidden rows and the intermediate are quantized
    (e4m3 or e2m1, e8m0 per 32) and both GEMMs run on the scaled MFMA.
    """
    if not isinstance(activation, ActivationSpec):
        raise ValueError(f"activation must be an ActivationSpec (silu or situv2), got {activation!r}")
    check_routing(hidden, topk_weights, topk_ids)
    T, H = hidden.shape
    k = topk_ids.shape[1]
    E, I = experts.num_experts, experts.intermediate_size
    if H != experts.hidden_size:
        raise ValueError(f"hidden has {H} columns but the experts take hidden size {experts.hidden_size}")
    out = torch.empty_like(hidden)
    if T == 0:
        return out
    local = local_slots(topk_ids, expert_map)
    _check_ids(local, E)
    x = hidden.to(torch.bfloat16).contiguous()
    tw = topk_weights.to(torch.float32).contiguous()
    w13, s13, o13 = experts.kernel_args("w13")
    w2, s2, o2 = experts.kernel_args("w2")
    step = min(chunk_tokens or T, max_chunk_tokens(H, I, k, E))
    quantized = act_dtype != BF16
    for start in range(0, T, step):
        stop = min(T, start + step)
        n = stop - start
        if configs is None:
            cfg1, cfg2 = tiles.stage_configs(arch, experts.weight_format, hidden=H, inter=I, top_k=k,
                                             num_tokens=n, activation=activation, betas=betas,
                                             has_offsets=experts.has_offsets, reduce=reduce,
                                             act_dtype=act_dtype, table=table)
        else:
            cfg1, cfg2 = _check_pinned(configs, experts, activation, H, I, k, act_dtype)
            reduce = cfg2.reduce
        routing = align_tokens(local[start:stop], E, cfg1.BM)
        P = routing.num_rows
        beta, lin_beta = runtime_betas(activation) if cfg1.betas == "runtime" else (0.0, 0.0)
        weights = tw[start:stop].reshape(-1)
        # quantized kernels take two more tensors after the output: input scales, output scales
        if quantized:
            a1, a1_scales = _quantized(n * H, act_dtype, hidden.device)
            launch(QuantConfig(arch, act_dtype), (x[start:stop].reshape(-1), a1, a1_scales, n * H // layout.GROUP))
            inter, inter_scales = _quantized(P * I, act_dtype, hidden.device)
            scales1, scales2 = (a1_scales, inter_scales), (inter_scales, inter_scales[:1])
        else:
            a1 = x[start:stop].reshape(-1)
            inter = torch.empty(P * I, dtype=torch.bfloat16, device=hidden.device)
            scales1 = scales2 = ()
        launch(cfg1, (a1, w13, s13, o13, routing.sorted_slots, routing.block_expert,
                      weights, inter, *scales1, n, P, beta, lin_beta))
        if reduce == "slots":
            y = torch.zeros(n * k * H, dtype=torch.bfloat16, device=hidden.device)
        else:
            y = torch.zeros(n * H, dtype=torch.float32, device=hidden.device)
        launch(cfg2, (inter, w2, s2, o2, routing.sorted_slots, routing.block_expert, weights, y,
                      *scales2, n, P, 0.0, 0.0))
        # the deterministic top-k reduction: fp32 sum over each token's slots, in slot order
        part = y.view(n, k, H).float().sum(dim=1) if reduce == "slots" else y.view(n, H)
        out[start:stop] = part.to(hidden.dtype)
    return out

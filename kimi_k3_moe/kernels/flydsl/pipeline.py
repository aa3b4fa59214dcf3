"""The FlyDSL MoE forward pass, written once for two executors.

`moe_forward` picks the tiles, allocates the buffers and issues one forward's
launches: three for a direct tier (stage 1, stage 2, the top-k sum), four for an
aligned one up to alignment.SMALL_PAIRS pairs (the alignment in one program first)
and five above (the alignment's two: every pair's row waits for every expert's
count); one fewer with reduce "fused" (stage 2 sums each token as the workgroup
completing it finishes); one more with quantized activations (the hidden rows are
quantized first) and with reduce "atomic" (a zero fill before stage 2, a conversion
instead of the sum after it). No host
synchronisation and no PyTorch arithmetic between them, so a forward is
graph-capturable and its launches are exactly the kernels'. The FlyDSL stages go
through `launch(config, args)` with exactly the arguments of the FlyDSL
launchers: on an AMD GPU the compiled kernels (backend.py), on the CPU
k3lab.flydsl.emulator's `launch`, lane by lane. The alignment and the top-k sum
are the Triton kernels of kernels/common/, shared with the Triton backend (the
engines' ROCm Triton compiles them; on the CPU they run under Triton's
interpreter), so everything around the kernels is the same code in both cases.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kimi_k3_moe.act_quant import BF16
from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.kernels.common.alignment import align_launches, direct_pairs
from kimi_k3_moe.kernels.common.elementwise import cast_copy, zero_fill
from kimi_k3_moe.kernels.common.topk_sum import topk_reduce
from kimi_k3_moe.kernels.flydsl import layout, tiles
from kimi_k3_moe.kernels.flydsl.config import FlyKernelConfig, GemmShape, QuantConfig, runtime_betas
from kimi_k3_moe.kernels.flydsl.experts import FlyDSLExperts
from kimi_k3_moe.reference import check_routing

Launch = Callable[[FlyKernelConfig | QuantConfig, tuple], None]
INT32_LIMIT = 2**31 - 1


def max_chunk_tokens(hidden: int, inter: int, top_k: int, num_experts: int) -> int:
    """Tokens per launch such that every 32-bit byte offset of every buffer stays below 2^31."""
    by_slots = INT32_LIMIT // (top_k * hidden * 2)        # SLOTS [T*k, H] bf16 (also X: T*H*2)
    by_acc = INT32_LIMIT // (hidden * 4)                  # ACC [T, H] fp32
    # INTER [P, I] bf16, P <= T*k + (E + 1) * BM rows (the alignment's bound; direct tiers are a few tokens)
    by_inter = (INT32_LIMIT // (inter * 2) - (num_experts + 1) * tiles.MAX_BM) // top_k
    limit = min(by_slots, by_acc, by_inter)
    if limit < 1:
        raise ValueError(f"layer too large for 32-bit buffer offsets (H={hidden}, I={inter}, k={top_k}, "
                         f"E={num_experts})")
    return limit


def _quantized(elements: int, act_dtype: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (codes, e8m0 scales) buffers for `elements` quantized activations."""
    return (torch.empty(elements * layout.ACT_CODE_BITS[act_dtype] // 8, dtype=torch.uint8, device=device),
            torch.empty(elements // layout.GROUP, dtype=torch.uint8, device=device))


def _check_pinned(configs, experts, activation, H, I, k, act_dtype, direct_experts, bf16_out):
    cfg1, cfg2 = configs
    want = {"weight_format": experts.weight_format, "has_offsets": experts.has_offsets, "act_dtype": act_dtype}
    for cfg, stage, N, K in ((cfg1, 1, I, H), (cfg2, 2, H, I)):
        got = {f: getattr(cfg, f) for f in want}
        if cfg.stage != stage or cfg.shape != GemmShape(N, K, k) or got != want:
            raise ValueError(f"pinned config {cfg.name} does not fit stage {stage} of this layer "
                             f"(N={N}, K={K}, top_k={k}, {want})")
    if cfg1.BM != cfg2.BM or cfg1.rows.direct != cfg2.rows.direct:
        raise ValueError(f"pinned configs lay rows out differently (BM {cfg1.BM} vs {cfg2.BM}, "
                         f"direct {cfg1.rows.direct} vs {cfg2.rows.direct})")
    if cfg1.rows.direct and direct_experts != cfg1.rows.direct_experts:
        raise ValueError(f"pinned direct configs bound ids by {cfg1.rows.direct_experts} experts, but this routing "
                         + ("needs the alignment (an expert map or int64 ids)" if direct_experts is None
                            else f"has {direct_experts}"))
    if cfg2.sums_tokens and not bf16_out:
        raise ValueError(f"pinned config {cfg2.name} writes a bf16 output; this forward's is not bf16")
    if cfg1.BM > tiles.MAX_BM:
        raise ValueError(f"pinned BM {cfg1.BM} exceeds {tiles.MAX_BM} (buffer offsets are sized for it)")
    runtime = cfg1.activation.name == "situv2" and cfg1.activation.betas == "runtime"
    if (activation.name != "situv2") if runtime else (cfg1.activation_spec() != activation):
        raise ValueError(f"pinned stage-1 config {cfg1.name} does not compute {activation}")
    return cfg1, cfg2


def moe_forward(experts: FlyDSLExperts, hidden: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: ActivationSpec, expert_map: torch.Tensor | None, *,
                arch: str, launch: Launch, betas: str = "const", reduce: str = "auto",
                chunk_tokens: int | None = None, table: dict | None = None,
                configs: tuple[FlyKernelConfig, FlyKernelConfig] | None = None,
                act_dtype: str = BF16) -> torch.Tensor:
    """[T, H] -> [T, H] in hidden's dtype: this rank's sum over its experts.

    Ids outside [0, E) after the expert map (or outside the map) contribute nothing and make no
    kernel read anything; nothing here looks at their values on the host.
    `configs` pins the (stage 1, stage 2) kernels instead of the tile table's choice
    (tests use it to reach every variant); they must match the layer and each other.
    `act_dtype` "fp8"/"fp4" (gfx950): hidden rows and the intermediate are quantized
    (e4m3 or e2m1, e8m0 per 32) and both GEMMs run on the scaled MFMA.
    """
    if not isinstance(activation, ActivationSpec):
        raise ValueError(f"activation must be an ActivationSpec (silu or situv2), got {activation!r}")
    E, I = experts.num_experts, experts.intermediate_size
    # shapes and dtypes always; the ids' range only with KIMI_K3_MOE_CHECK_EXPERT_IDS=on (it syncs)
    check_routing(hidden, topk_weights, topk_ids, hidden_size=experts.hidden_size, num_experts=E,
                  expert_map=expert_map)
    T, H = hidden.shape
    k = topk_ids.shape[1]
    out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)   # row-major, whatever hidden is
    if T == 0:
        return out
    # each is a no-op for what the engines pass (bf16 rows, fp32 weights, int32 ids)
    x = hidden.to(torch.bfloat16).contiguous()
    tw = topk_weights.to(torch.float32).contiguous()
    ids = topk_ids.contiguous()
    # the direct layout reads ids as the kernels' int32 block experts and has no map to apply
    direct_experts = E if expert_map is None and ids.dtype == torch.int32 else None
    w13, s13, o13 = experts.kernel_args("w13")
    w2, s2, o2 = experts.kernel_args("w2")
    step = min(chunk_tokens or T, max_chunk_tokens(H, I, k, E))
    bf16_out = out.dtype == torch.bfloat16
    for start in range(0, T, step):
        stop = min(T, start + step)
        n = stop - start
        if configs is None:
            cfg1, cfg2 = tiles.stage_configs(arch, experts.weight_format, hidden=H, inter=I, top_k=k,
                                             num_tokens=n, activation=activation, betas=betas,
                                             has_offsets=experts.has_offsets, reduce=reduce,
                                             act_dtype=act_dtype, direct_experts=direct_experts, table=table,
                                             bf16_out=bf16_out)
        else:
            cfg1, cfg2 = _check_pinned(configs, experts, activation, H, I, k, act_dtype, direct_experts, bf16_out)
        chunk_ids = ids[start:stop]
        book = None
        if cfg1.rows.direct:
            pairs = direct_pairs(chunk_ids, None, cfg1.BM, E)
            sid, block_expert, P = pairs.block_expert, pairs.block_expert, pairs.num_pairs * cfg1.BM
        else:
            clear = None
            if cfg2.sums_tokens:   # BOOK: the alignment writes the slots' local experts, zeroes the counters
                book = torch.empty(layout.book_ints(n, k, H // cfg2.BN), dtype=torch.int32, device=hidden.device)
                # a token with no slot on this rank has no row for stage 2 to complete: zero until written
                clear = out[start:stop].view(-1).view(torch.int32)
            (pairs,), align = align_launches(chunk_ids, expert_map, E, (cfg1.BM,), book, clear)
            for launch_ in align:
                launch_()
            sid, block_expert, P = pairs.sorted_pairs, pairs.block_expert, pairs.max_rows
        beta, lin_beta = runtime_betas(activation) if cfg1.activation.betas == "runtime" else (0.0, 0.0)
        weights = tw[start:stop].reshape(-1)
        # quantized kernels take two more tensors after the output: input scales, output scales
        if cfg1.quantized:
            a1, a1_scales = _quantized(n * H, act_dtype, hidden.device)
            launch(QuantConfig(arch, act_dtype), (x[start:stop].reshape(-1), a1, a1_scales, n * H // layout.GROUP))
            inter, inter_scales = _quantized(P * I, act_dtype, hidden.device)
            scales1, scales2 = (a1_scales, inter_scales), (inter_scales, inter_scales[:1])
        else:
            a1 = x[start:stop].reshape(-1)
            inter = torch.empty(P * I, dtype=torch.bfloat16, device=hidden.device)
            scales1 = scales2 = ()
        launch(cfg1, (a1, w13, s13, o13, sid, block_expert, weights, inter, *scales1, n, P, beta, lin_beta))
        if cfg2.slot_rows:
            # every slot row a kernel does not write belongs to a pair the top-k sum skips
            y = torch.empty(n * k * H, dtype=torch.bfloat16, device=hidden.device)
        else:
            y = torch.empty(n * H, dtype=torch.float32, device=hidden.device)
            zero_fill(y)()
        if cfg2.sums_tokens:   # the stage writes the output: nothing follows it
            launch(cfg2, (inter, w2, s2, o2, sid, block_expert, weights, y, out[start:stop].view(-1), book,
                          n, P, 0.0, 0.0))
            continue
        launch(cfg2, (inter, w2, s2, o2, sid, block_expert, weights, y, *scales2, n, P, 0.0, 0.0))
        if cfg2.reduction.kind == "slots":
            # the deterministic top-k reduction: fp32 sum over each token's slots, in slot order
            topk_reduce(y.view(n * k, H), pairs, out[start:stop], k)()
        else:
            # fp32 atomic adds (order-dependent rounding): converted to the output's dtype
            cast_copy(y, out[start:stop].view(-1))()
    return out

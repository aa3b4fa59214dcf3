"""vLLM 0.33's own Kimi-K3 MoE path on Hopper: Humming (PyPI `humming-kernels`), driven as vLLM drives it.

From the vLLM 0.33.0 wheel (HummingIndexedExperts; our own glue, no vLLM code):
at load, `BaseWeightSchema.from_config({"quant_method": "mxfp4"})` and
`HummingInputSchema()` (bf16 activations); per sub-layer the checkpoint
tensors go through the schema's `convert_humming` (w13 as two stacks [I, I])
and `prepare_and_transform_humming_tensors(pad_n_to_multiple=256,
pad_k_to_multiple=128, has_bias=False)`; tuning lists from
`get_heuristics_config(gemm_type=INDEXED)`; locks = zeros(SMs * 8). Per forward:
align (token, slot) pairs to the w13 (and, where it differs, w2) tuning
interval's block_shape[0]; `humming_forward` for w13 (top_k = K);
`may_process_input` with the activation as a C++ snippet
(`activation_type="binary_split"`); `humming_forward` for w2 (top_k = 1); the
router-weighted top-k sum. vLLM aligns with one CUDA op; ours is several
PyTorch launches, so the alignment is kept out of the timed region and timed
on its own. Humming JIT-compiles its kernels with NVRTC/nvcc on first use.
"""
from __future__ import annotations

import json

import torch

from kimi_k3_moe.activation import SILU, SITUV2
from kimi_k3_moe.bench.peers.align import align_block_size
from kimi_k3_moe.bench.peers.base import ENGINE, Peer, PeerUnavailable, Runner
from kimi_k3_moe.bench.peers.weighted_sum import weighted_topk_sum

TESTED_VERSION = "0.1.19"
DEFAULT_BLOCK = 64  # what vLLM falls back to when no tuning interval holds the pair count


def _f(x: float) -> str:
    return f"({float(x)!r}f)"


def humming_activation(activation) -> dict:
    """The `may_process_input` keywords computing `activation` on [gate | up] halves (a, b) in fp32."""
    if activation.name == SILU:
        return {"activation_type": "binary_split", "activation_impl": "(a / (1.f + expf(-a))) * b"}
    if activation.name != SITUV2:
        raise PeerUnavailable(f"no Humming snippet for activation {activation.name!r}")
    lb = activation.linear_beta
    up = f"{_f(lb)} * tanhf(b / {_f(lb)})" if lb is not None and lb > 0 else "b"
    impl = ("[](float a, float b) { "
            f"const float g = {_f(activation.beta)} * tanhf(a / {_f(activation.beta)}); "
            f"const float u = {up}; "
            "return g / (1.f + expf(-a)) * u; }(a, b)")
    return {"activation_type": "binary_split", "activation_impl": impl}


def _block_for(tuning: list, pairs: int) -> int:
    for lo, hi, cfg in tuning:
        if lo < pairs <= hi:
            return int(cfg["block_shape"][0])
    return DEFAULT_BLOCK


class HummingPeer(Peer):
    name, role, label = "humming", ENGINE, "Humming (vLLM 0.33's SM90 path)"

    def probe(self) -> tuple[bool, str]:
        if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
            return False, "engine path: not available (Humming is vLLM's NVIDIA path; no NVIDIA GPU here)"
        try:
            import humming
            from humming.forward import humming_forward, may_process_input  # noqa: F401
            from humming.schema import BaseWeightSchema, HummingInputSchema  # noqa: F401
            from humming.transform import prepare_and_transform_humming_tensors  # noqa: F401
            from humming.tune import get_heuristics_config  # noqa: F401
        except Exception as exc:  # absent, or an API that moved
            return False, f"engine path: not available (humming-kernels: {type(exc).__name__}: {exc})"
        version = getattr(humming, "__version__", "?")
        note = "" if version == TESTED_VERSION else f"; adapter written for {TESTED_VERSION}"
        return True, f"humming-kernels {version}{note}"

    def build(self, experts, activation, shape, expert_map) -> Runner:
        act_kwargs = humming_activation(activation)
        try:
            from humming.config import GemmType
            from humming.forward import humming_forward, may_process_input
            from humming.schema import BaseWeightSchema, HummingInputSchema
            from humming.transform import prepare_and_transform_humming_tensors
            from humming.tune import get_heuristics_config
        except Exception as exc:
            raise PeerUnavailable(f"engine path: not available (humming API: {exc})") from exc
        e, h, i, dev = experts.num_experts, experts.hidden_size, experts.intermediate_size, experts.device
        bf16 = torch.bfloat16
        try:
            weight_schema = BaseWeightSchema.from_config({"quant_method": "mxfp4"})
            input_schema = HummingInputSchema()
            layers = {}
            for sub, packed, scale, n, k, stacks in (
                    ("w13", experts.w13_packed, experts.w13_scale, 2 * i, h, [i, i]),
                    ("w2", experts.w2_packed, experts.w2_scale, h, i, [h])):
                ws, tensors = weight_schema.convert_humming(
                    tensors={"weight": packed.contiguous(), "weight_scale": scale.contiguous()},
                    shape_n_stacks=stacks, shape_k_stacks=[k], param_dtype=bf16, num_experts=e, device=dev)
                ins, _ = input_schema.convert_humming(tensors={}, shape_n_stacks=stacks, shape_k_stacks=[k],
                                                      param_dtype=bf16, num_experts=e, device=dev)
                cfg, tensors = prepare_and_transform_humming_tensors(
                    tensors=tensors, shape_n=n, shape_k=k, pad_n_to_multiple=256, pad_k_to_multiple=128,
                    input_schema=ins, weight_schema=ws, has_bias=False, num_experts=e, torch_dtype=bf16,
                    device=dev)
                tuning = get_heuristics_config(layer_config=cfg, use_f16_accum=False, use_batch_invariant=False,
                                               gemm_type=GemmType.INDEXED)
                layers[sub] = (cfg, tensors, tuning, json.dumps(tuning), getattr(ws, "hadamard_block_size", None))
        except Exception as exc:
            raise PeerUnavailable(f"engine path: not available (humming weight preparation failed: "
                                  f"{type(exc).__name__}: {exc})") from exc
        compute = json.dumps({"use_batch_invariant": False, "use_f16_accum": False,
                              "gemm_type": GemmType.INDEXED.value})
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        locks = torch.zeros(sms * 8, dtype=torch.int32, device=dev)
        cfg13, t13, tune13, tune13_s, _ = layers["w13"]
        cfg2, t2, tune2, tune2_s, hadamard2 = layers["w2"]

        def route(weights, ids):
            # EP: ids through the expert map, other ranks' pairs skipped by the alignment and the sum
            local = ids if expert_map is None else expert_map[ids.long()].to(torch.int32)
            pairs = ids.numel()
            b1, b2 = _block_for(tune13, pairs), _block_for(tune2, pairs)
            a1 = align_block_size(local, b1, e)
            return weights, local, a1, a1 if b2 == b1 else align_block_size(local, b2, e)

        def gemm(cfg, tensors, inputs, outputs, align, top_k, tuning_s, pairs):
            sorted_ids, expert_ids, padded = align
            return humming_forward(cfg, inputs=inputs, weight=tensors["weight"],
                                   weight_scale=tensors.get("weight_scale"), zero_point=tensors.get("zero_point"),
                                   bias=tensors.get("bias"), weight_scale_2=tensors.get("weight_scale_2"),
                                   outputs=outputs, locks=locks, sorted_ids=sorted_ids, expert_ids=expert_ids,
                                   num_tokens_padded=padded, top_k=top_k, valid_shape_m=pairs,
                                   compute_config=compute, tuning_config=tuning_s)

        def run(hidden, routed):
            weights, local, a1, a2 = routed
            t, k = local.shape
            pairs = t * k
            x, _, _ = may_process_input(cfg13, inputs=hidden)  # bf16 in, no quantization: passes through
            gate_up = torch.empty(pairs, 2 * i, dtype=bf16, device=hidden.device)
            gemm(cfg13, t13, x, gate_up, a1, k, tune13_s, pairs)
            down_in = torch.empty(pairs, i, dtype=bf16, device=hidden.device)
            y, _, _ = may_process_input(cfg2, inputs=gate_up, outputs=down_in, hadamard_block_size=hadamard2,
                                        layout="normal", **act_kwargs)
            down = torch.empty(pairs, h, dtype=bf16, device=hidden.device)
            gemm(cfg2, t2, y, down, a2, 1, tune2_s, pairs)
            return weighted_topk_sum(down.view(t, k, h), weights, torch.empty_like(hidden),
                                     None if expert_map is None else local)
        return Runner(run=run, activation=activation, route=route, route_in_timing=False,
                      notes=["Humming alignment (our PyTorch stand-in for vLLM's one-kernel moe_align_block_size) "
                             "timed separately, not in the figure"])

"""Tiny Kimi-K3-shaped checkpoints for demos and tests.

The config uses K3's field names (nested `text_config`, compressed-tensors
`quantization_config`); experts are random Gaussian weights quantised to
MXFP4 under K3's tensor names. Only the MoE blocks' tensors are written.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kimi_k3_moe.formats import mxfp4
from kimi_k3_moe.weights.checkpoint import INDEX_FILE, LAYER_PREFIXES, expert_tensor_name, moe_tensor_name


def synthetic_config(
    *,
    num_layers: int,
    hidden_size: int,
    routed_expert_hidden_size: int,
    moe_intermediate_size: int,
    num_experts: int,
    num_experts_per_token: int,
    num_shared_experts: int,
    first_k_dense_replace: int,
    hidden_act: str,
    activation_situ_beta: float | None,
    activation_situ_linear_beta: float | None,
) -> dict[str, Any]:
    text = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "hidden_size": hidden_size,
        "intermediate_size": 2 * moe_intermediate_size,
        "num_hidden_layers": num_layers,
        "first_k_dense_replace": first_k_dense_replace,
        "moe_layer_freq": 1,
        "routed_expert_hidden_size": routed_expert_hidden_size,
        "latent_moe_use_norm": True,
        "num_experts": num_experts,
        "num_experts_per_token": num_experts_per_token,
        "num_shared_experts": num_shared_experts,
        "moe_intermediate_size": moe_intermediate_size,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "hidden_act": hidden_act,
        "rms_norm_eps": 1e-5,
        "vocab_size": 1024,
        "torch_dtype": "bfloat16",
    }
    if activation_situ_beta is not None:
        text["activation_situ_beta"] = activation_situ_beta
    if activation_situ_linear_beta is not None:
        text["activation_situ_linear_beta"] = activation_situ_linear_beta
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                            "group_size": mxfp4.BLOCK_SIZE, "symmetric": True, "dynamic": False},
                "input_activations": None,
                "output_activations": None,
                "format": "mxfp4-pack-quantized",
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp.*",
                   "re:.*block_sparse_moe.gate$", "re:.*routed_expert_(down|up)_proj$"],
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "quantization_config": quant,
    }


def _mxfp4_linear(rows: int, cols: int, gain: float, gen: torch.Generator,
                  scale_4d: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(rows, cols, generator=gen) * (gain / cols ** 0.5)
    packed, scales = mxfp4.quantize(w)
    if scale_4d:
        scales = scales[:, None, :, None].contiguous()
    return packed, scales


def make_checkpoint(
    path: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 256,
    routed_expert_hidden_size: int = 128,
    moe_intermediate_size: int = 64,
    num_experts: int = 16,
    num_experts_per_token: int = 4,
    num_shared_experts: int = 1,
    first_k_dense_replace: int = 1,
    seed: int = 0,
    hidden_act: str = "situ",
    activation_situ_beta: float | None = 4.0,
    activation_situ_linear_beta: float | None = 25.0,
    shards: int = 1,
    scale_4d: bool = False,
    prefix: str = LAYER_PREFIXES[0],
    stage1_gain: float = 3.0,
) -> Path:
    """Write config.json and safetensors for a tiny K3-shaped model; returns the folder.

    `stage1_gain` scales w1/w3 so stage-1 outputs reach the range where
    SiTUv2's tanh bends away from SiLU, as trained weights do.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = synthetic_config(
        num_layers=num_layers, hidden_size=hidden_size,
        routed_expert_hidden_size=routed_expert_hidden_size,
        moe_intermediate_size=moe_intermediate_size, num_experts=num_experts,
        num_experts_per_token=num_experts_per_token, num_shared_experts=num_shared_experts,
        first_k_dense_replace=first_k_dense_replace, hidden_act=hidden_act,
        activation_situ_beta=activation_situ_beta,
        activation_situ_linear_beta=activation_situ_linear_beta)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    gen = torch.Generator().manual_seed(seed)
    h, hr, i = hidden_size, routed_expert_hidden_size, moe_intermediate_size
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(first_k_dense_replace, num_layers):
        for e in range(num_experts):
            for proj, rows, cols, gain in (("w1", i, hr, stage1_gain), ("w3", i, hr, stage1_gain),
                                           ("w2", hr, i, 1.0)):
                packed, scales = _mxfp4_linear(rows, cols, gain, gen, scale_4d)
                tensors[expert_tensor_name(layer, e, proj, "weight_packed", prefix)] = packed
                tensors[expert_tensor_name(layer, e, proj, "weight_scale", prefix)] = scales

        def put(suffix: str, t: torch.Tensor) -> None:
            tensors[moe_tensor_name(layer, suffix, prefix)] = t.contiguous()

        put("gate.weight", (torch.randn(num_experts, h, generator=gen) / h ** 0.5).to(torch.bfloat16))
        put("gate.e_score_correction_bias", torch.randn(num_experts, generator=gen) * 0.05)
        put("routed_expert_down_proj.weight", (torch.randn(hr, h, generator=gen) / h ** 0.5).to(torch.bfloat16))
        put("routed_expert_norm.weight", (1 + 0.1 * torch.randn(hr, generator=gen)).to(torch.bfloat16))
        put("routed_expert_up_proj.weight", (torch.randn(h, hr, generator=gen) / hr ** 0.5).to(torch.bfloat16))
        if num_shared_experts:
            si = i * num_shared_experts
            for proj, (rows, cols) in (("gate_proj", (si, h)), ("up_proj", (si, h)), ("down_proj", (h, si))):
                put(f"shared_experts.{proj}.weight",
                    (torch.randn(rows, cols, generator=gen) / cols ** 0.5).to(torch.bfloat16))
    _save_shards(path, tensors, shards)
    return path


def _save_shards(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    if shards <= 1:
        save_file(tensors, path / "model.safetensors")
        return
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_file({n: tensors[n] for n in part}, path / shard)
        weight_map.update({n: shard for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

"""Tiny Kimi-K3-shaped checkpoints for demos and tests.

The config uses K3's field names (nested `text_config`, compressed-tensors
`quantization_config`); experts are random Gaussian weights quantised to
MXFP4 under K3's tensor names. `make_checkpoint` writes only the MoE blocks'
tensors; `make_model_checkpoint` writes a whole model an engine can serve
(attention, dense layer, embeddings, tokenizer, processor config).
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
    tensors = _moe_tensors(gen, num_layers=num_layers, hidden_size=hidden_size,
                           routed_expert_hidden_size=routed_expert_hidden_size,
                           moe_intermediate_size=moe_intermediate_size, num_experts=num_experts,
                           num_shared_experts=num_shared_experts, first_k_dense_replace=first_k_dense_replace,
                           scale_4d=scale_4d, prefix=prefix, stage1_gain=stage1_gain)
    _save_shards(path, tensors, shards)
    return path


def _moe_tensors(gen: torch.Generator, *, num_layers: int, hidden_size: int, routed_expert_hidden_size: int,
                 moe_intermediate_size: int, num_experts: int, num_shared_experts: int,
                 first_k_dense_replace: int, scale_4d: bool, prefix: str,
                 stage1_gain: float) -> dict[str, torch.Tensor]:
    h, hr, i = hidden_size, routed_expert_hidden_size, moe_intermediate_size
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(first_k_dense_replace, num_layers):
        for e in range(num_experts):
            for proj, rows, cols, gain in (("w1", i, hr, stage1_gain), ("w3", i, hr, stage1_gain),
                                           ("w2", hr, i, 1.0)):
                packed, scales = _mxfp4_linear(rows, cols, gain, gen, scale_4d)
                tensors[expert_tensor_name(layer, e, proj, "weight_packed", prefix)] = packed
                tensors[expert_tensor_name(layer, e, proj, "weight_scale", prefix)] = scales

        def put(suffix: str, t: torch.Tensor, layer: int = layer) -> None:
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
    return tensors


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


# The shape a whole tiny K3 gets: K3's layer pattern in four layers (a dense first layer, then
# MoE; three KDA layers, then one MLA layer), K3's attention dimensions where an engine's
# kernels only take those (MLA latent 512 + rope 64), everything else small.
MODEL_SHAPE = dict(num_layers=4, hidden_size=256, routed_expert_hidden_size=128, moe_intermediate_size=64,
                   num_experts=8, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1)
# KDA state per sequence must fit one 16-token MLA page (CPU_MLA's only block size): head_dim 32
KDA_HEADS, KDA_HEAD_DIM, KDA_CONV = 2, 32, 4
MLA_HEADS, Q_LORA_RANK, KV_LORA_RANK, QK_NOPE, QK_ROPE, V_HEAD = 2, 64, 512, 64, 64, 64
# the tokenizer's special tokens, after its 256 byte symbols
SPECIAL_TOKENS = ("<s>", "</s>", "<|im_end|>", "<|media_pad|>", "<|kimi_image_placeholder|>")
BOS, EOS, MEDIA_PAD = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1], SPECIAL_TOKENS[3]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def make_model_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    activation_situ_beta: float | None = 4.0,
    activation_situ_linear_beta: float | None = 25.0,
    max_position_embeddings: int = 4096,
    **moe_shape: Any,
) -> Path:
    """A whole tiny Kimi-K3 a serving engine can load: returns the folder.

    Beyond `make_checkpoint`'s MoE blocks: embeddings, final norm, lm_head,
    per-layer norms, the dense first layer's MLP, the KDA layers'
    projections, short convolutions, `dt_bias`, `A_log` and output norm, the
    MLA layer's low-rank projections, norms and output gate, all under K3's
    names with K3's config fields (`linear_attn_config`, the MLA fields, a
    small `vision_config`, `media_placeholder_token_id`); a byte-level
    tokenizer (every text encodes, nothing is downloaded) and
    `preprocessor_config.json`. Weights are random, so its text is noise;
    it exists to run an engine's loader, scheduler and server end to end.
    """
    shape = {**MODEL_SHAPE, **moe_shape}
    path = make_checkpoint(path, seed=seed, activation_situ_beta=activation_situ_beta,
                           activation_situ_linear_beta=activation_situ_linear_beta, **shape)
    vocab = write_byte_tokenizer(path)
    n, h = shape["num_layers"], shape["hidden_size"]
    first_dense = shape["first_k_dense_replace"]
    kda_layers = list(range(1, n))   # 1-based, as K3's config counts them: all but the last are KDA
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    text.update({
        "vocab_size": len(vocab), "bos_token_id": vocab[BOS], "eos_token_id": vocab[EOS], "pad_token_id": vocab[EOS],
        "tie_word_embeddings": False, "max_position_embeddings": max_position_embeddings,
        "num_attention_heads": MLA_HEADS, "num_key_value_heads": MLA_HEADS, "q_lora_rank": Q_LORA_RANK,
        "kv_lora_rank": KV_LORA_RANK, "qk_nope_head_dim": QK_NOPE, "qk_rope_head_dim": QK_ROPE,
        "v_head_dim": V_HEAD, "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {"kda_layers": kda_layers, "full_attn_layers": [n], "num_heads": KDA_HEADS,
                               "head_dim": KDA_HEAD_DIM, "short_conv_kernel_size": KDA_CONV,
                               "use_full_rank_gate": True},
    })
    config.update({
        "media_placeholder_token_id": vocab[MEDIA_PAD], "bos_token_id": vocab[BOS], "eos_token_id": vocab[EOS],
        "pad_token_id": vocab[EOS], "tie_word_embeddings": False,
        "vision_config": {"patch_size": 14, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1,
                          "vt_hidden_size": 64, "vt_intermediate_size": 128, "merge_kernel_size": [2, 2],
                          "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
                          "text_hidden_size": h},
    })
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {
        "patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 256, "patch_limit_on_one_side": 64,
        "fixed_output_tokens": None, "temporal_merge_kernel_size": 4, "in_patch_limit_each_frame": None,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}}, indent=2) + "\n")

    from safetensors.torch import load_file
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed + 1)
    tensors.update(_dense_model_tensors(gen, vocab=len(vocab), hidden=h, layers=n, first_dense=first_dense,
                                        dense_inter=config["text_config"]["intermediate_size"],
                                        kda_layers=[k - 1 for k in kda_layers]))
    save_file(tensors, path / "model.safetensors")
    return path


def _dense_model_tensors(gen: torch.Generator, *, vocab: int, hidden: int, layers: int, first_dense: int,
                         dense_inter: int, kda_layers: list[int]) -> dict[str, torch.Tensor]:
    """Every tensor of the model but the MoE blocks, under K3's checkpoint names."""
    bf16 = torch.bfloat16
    out: dict[str, torch.Tensor] = {}

    def linear(name: str, rows: int, cols: int, dtype=bf16) -> None:
        out[name] = (torch.randn(rows, cols, generator=gen) / cols ** 0.5).to(dtype)

    def norm(name: str, size: int) -> None:
        out[name] = (1 + 0.1 * torch.randn(size, generator=gen)).to(bf16)

    model = "language_model.model"
    out[f"{model}.embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen).to(bf16)
    norm(f"{model}.norm.weight", hidden)
    linear("language_model.lm_head.weight", vocab, hidden)
    proj = KDA_HEADS * KDA_HEAD_DIM
    for layer in range(layers):
        p = f"{model}.layers.{layer}"
        norm(f"{p}.input_layernorm.weight", hidden)
        norm(f"{p}.post_attention_layernorm.weight", hidden)
        if layer < first_dense:
            linear(f"{p}.mlp.gate_proj.weight", dense_inter, hidden)
            linear(f"{p}.mlp.up_proj.weight", dense_inter, hidden)
            linear(f"{p}.mlp.down_proj.weight", hidden, dense_inter)
        a = f"{p}.self_attn"
        if layer in kda_layers:
            for name in ("q_proj", "k_proj", "v_proj", "g_proj"):
                linear(f"{a}.{name}.weight", proj, hidden)
            linear(f"{a}.f_a_proj.weight", KDA_HEAD_DIM, hidden)
            linear(f"{a}.f_b_proj.weight", proj, KDA_HEAD_DIM)
            linear(f"{a}.b_proj.weight", KDA_HEADS, hidden)
            for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
                out[f"{a}.{name}.weight"] = torch.randn(proj, 1, KDA_CONV, generator=gen) / KDA_CONV ** 0.5
            out[f"{a}.dt_bias"] = torch.randn(proj, generator=gen) * 0.5
            out[f"{a}.A_log"] = torch.log(torch.empty(KDA_HEADS).uniform_(1, 16, generator=gen))
            norm(f"{a}.o_norm.weight", KDA_HEAD_DIM)
            linear(f"{a}.o_proj.weight", hidden, proj)
        else:
            linear(f"{a}.q_a_proj.weight", Q_LORA_RANK, hidden)
            norm(f"{a}.q_a_layernorm.weight", Q_LORA_RANK)
            linear(f"{a}.q_b_proj.weight", MLA_HEADS * (QK_NOPE + QK_ROPE), Q_LORA_RANK)
            linear(f"{a}.kv_a_proj_with_mqa.weight", KV_LORA_RANK + QK_ROPE, hidden)
            norm(f"{a}.kv_a_layernorm.weight", KV_LORA_RANK)
            linear(f"{a}.kv_b_proj.weight", MLA_HEADS * (QK_NOPE + V_HEAD), KV_LORA_RANK)
            linear(f"{a}.g_proj.weight", MLA_HEADS * V_HEAD, hidden)
            linear(f"{a}.o_proj.weight", hidden, MLA_HEADS * V_HEAD)
    return {k: v.contiguous() for k, v in out.items()}


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what a ByteLevel pre-tokenizer emits)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = 0
    symbols = {}
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def write_byte_tokenizer(path: str | Path) -> dict[str, int]:
    """A byte-level BPE tokenizer with no merges: one token per byte, then SPECIAL_TOKENS.

    Written as `tokenizer.json` / `tokenizer_config.json` directly (no
    tokenizers package needed to write it, nothing downloaded); any text
    encodes and decodes back exactly. Returns the vocabulary.
    """
    path = Path(path)
    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for t in SPECIAL_TOKENS],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
        "model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    return vocab

"""make_model_checkpoint: the whole tiny K3 the vLLM end-to-end suite serves (tests/e2e_vllm)."""
from __future__ import annotations

import json

from safetensors import safe_open

from kimi_k3_moe.weights.synthetic import (
    KDA_HEAD_DIM,
    KDA_HEADS,
    KV_LORA_RANK,
    MODEL_SHAPE,
    QK_ROPE,
    SPECIAL_TOKENS,
    make_checkpoint,
    make_model_checkpoint,
)


def test_a_whole_model_adds_every_non_moe_tensor_and_file(tmp_path, seed):
    path = make_model_checkpoint(tmp_path / "m", seed=seed)
    assert {p.name for p in path.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                 "tokenizer_config.json", "preprocessor_config.json"}
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    assert config["model_type"] == "kimi_k3" and text["num_hidden_layers"] == MODEL_SHAPE["num_layers"] == 4
    assert text["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    assert text["linear_attn_config"]["full_attn_layers"] == [4]
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"]) == (KV_LORA_RANK, QK_ROPE) == (512, 64)
    assert text["vocab_size"] == 256 + len(SPECIAL_TOKENS)
    assert config["media_placeholder_token_id"] == 256 + SPECIAL_TOKENS.index("<|media_pad|>")
    assert "media_proc_cfg" in json.loads((path / "preprocessor_config.json").read_text())
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        a = "language_model.model.layers.1.self_attn."
        assert f.get_tensor(a + "q_conv1d.weight").shape == (KDA_HEADS * KDA_HEAD_DIM, 1, 4)
        assert f.get_tensor(a + "A_log").shape == (KDA_HEADS,)
    for name in ("language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
                 "language_model.lm_head.weight", "language_model.model.layers.0.mlp.gate_proj.weight",
                 "language_model.model.layers.2.self_attn.f_b_proj.weight",
                 "language_model.model.layers.3.self_attn.kv_b_proj.weight",
                 "language_model.model.layers.3.self_attn.g_proj.weight",
                 "language_model.model.layers.3.block_sparse_moe.experts.7.w2.weight_packed"):
        assert name in names, name
    assert not any("layers.0.block_sparse_moe" in n for n in names)  # the dense first layer


def test_the_moe_blocks_are_make_checkpoints(tmp_path, seed):
    whole = make_model_checkpoint(tmp_path / "whole", seed=seed)
    moe = make_checkpoint(tmp_path / "moe", seed=seed, **MODEL_SHAPE)
    with safe_open(whole / "model.safetensors", "pt") as w, safe_open(moe / "model.safetensors", "pt") as m:
        for name in m.keys():
            assert w.get_tensor(name).equal(m.get_tensor(name)), name


def test_the_tokenizer_is_byte_level_with_the_special_tokens_after(tmp_path):
    path = make_model_checkpoint(tmp_path / "m")
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    assert len(vocab) == 256 + len(SPECIAL_TOKENS) and tokenizer["model"]["merges"] == []
    assert [vocab[t] for t in SPECIAL_TOKENS] == list(range(256, 256 + len(SPECIAL_TOKENS)))
    assert vocab["Ġ"] == ord(" ") and vocab["A"] == ord("A")  # GPT-2's byte symbols

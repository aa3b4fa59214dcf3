import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_k3_moe.configs import K3MoEConfig
from kimi_k3_moe.weights import CheckpointError, CheckpointReader, read_layer_experts, read_router
from kimi_k3_moe.weights.checkpoint import expert_tensor_name
from kimi_k3_moe.weights.synthetic import make_checkpoint

SHAPE = dict(hidden_size=128, routed_expert_hidden_size=64, moe_intermediate_size=64,
             num_experts=6, num_experts_per_token=2)


def read(path, **kw):
    return read_layer_experts(path, 1, hidden_size=64, intermediate_size=64, num_experts=6, **kw)


@pytest.mark.parametrize("shards,scale_4d", [(1, False), (3, False), (2, True)])
def test_roundtrip_through_make_checkpoint(tmp_path, seed, shards, scale_4d):
    make_checkpoint(tmp_path, seed=seed, shards=shards, scale_4d=scale_4d, **SHAPE)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shards > 1)
    experts = read(tmp_path)
    assert experts.w13_packed.shape == (6, 128, 32) and experts.w13_scale.shape == (6, 128, 2)
    assert experts.w2_packed.shape == (6, 64, 32) and experts.w2_scale.shape == (6, 64, 2)
    reader = CheckpointReader(tmp_path)
    w1 = reader.get(expert_tensor_name(1, 4, "w1", "weight_packed"))
    w3s = reader.get(expert_tensor_name(1, 4, "w3", "weight_scale"))
    w3s = w3s[:, 0, :, 0] if scale_4d else w3s
    assert torch.equal(experts.w13_packed[4, :64], w1)
    assert torch.equal(experts.w13_scale[4, 64:], w3s)
    gate, bias = read_router(reader, 1)
    assert gate.shape == (6, 128) and bias.dtype == torch.float32


def test_same_seed_same_bytes_new_seed_new_bytes(tmp_path, seed):
    a = read(make_checkpoint(tmp_path / "a", seed=seed, **SHAPE))
    b = read(make_checkpoint(tmp_path / "b", seed=seed, **SHAPE))
    c = read(make_checkpoint(tmp_path / "c", seed=seed + 1, **SHAPE))
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
    assert not torch.equal(a.w13_packed, c.w13_packed)


def test_tensor_and_expert_parallel_slices(tmp_path, seed):
    make_checkpoint(tmp_path, seed=seed, **SHAPE)
    full = read(tmp_path)
    for rank in range(2):
        part = read(tmp_path, tp_rank=rank, tp_size=2)
        rows = list(range(rank * 32, rank * 32 + 32)) + list(range(64 + rank * 32, 64 + rank * 32 + 32))
        assert torch.equal(part.w13_packed, full.w13_packed[:, rows])
        assert torch.equal(part.w2_packed, full.w2_packed[..., rank * 16:(rank + 1) * 16])
        assert torch.equal(part.w2_scale, full.w2_scale[..., rank:rank + 1])
    subset = read(tmp_path, experts=[5, 1])
    assert torch.equal(subset.w2_scale, full.w2_scale[[5, 1]])
    with pytest.raises(CheckpointError, match="outside"):
        read(tmp_path, experts=[6])
    with pytest.raises(CheckpointError, match="multiple of the MXFP4 block"):
        read(tmp_path, tp_rank=0, tp_size=4)


def test_misshaped_tensor_is_named(tmp_path, seed):
    make_checkpoint(tmp_path, seed=seed, **SHAPE)
    tensors = load_file(tmp_path / "model.safetensors")
    bad = expert_tensor_name(1, 2, "w2", "weight_packed")
    tensors[bad] = tensors[bad][:, :-1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{bad}.*shape \(64, 31\).*expected \(64, 32\)"):
        read(tmp_path)


def test_wrong_dtype_is_named(tmp_path, seed):
    make_checkpoint(tmp_path, seed=seed, **SHAPE)
    tensors = load_file(tmp_path / "model.safetensors")
    bad = expert_tensor_name(1, 0, "w1", "weight_scale")
    tensors[bad] = tensors[bad].to(torch.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{bad}.*float32"):
        read(tmp_path)


def test_truncated_shard_is_an_error_naming_the_tensor(tmp_path, seed):
    make_checkpoint(tmp_path, seed=seed, shards=2, **SHAPE)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name = expert_tensor_name(1, 5, "w3", "weight_packed")
    shard = tmp_path / index["weight_map"][name]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"experts\.\d+\.w\d\.weight_(packed|scale)"):
        read(tmp_path)


def test_missing_tensor_is_named(tmp_path, seed):
    make_checkpoint(tmp_path, seed=seed, **SHAPE)
    tensors = load_file(tmp_path / "model.safetensors")
    name = expert_tensor_name(1, 3, "w1", "weight_scale")
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        read(tmp_path)


def test_text_only_prefix(tmp_path, seed):
    make_checkpoint(tmp_path, seed=seed, prefix="model.layers", **SHAPE)
    assert CheckpointReader(tmp_path).prefix == "model.layers"
    assert read(tmp_path).num_experts == 6


def test_config_of_synthetic_checkpoint(tmp_path, seed):
    make_checkpoint(tmp_path, seed=seed, num_layers=4, **SHAPE)
    cfg = K3MoEConfig.from_hf_config(tmp_path)
    assert cfg.moe_layers() == [1, 2, 3]
    assert str(cfg.activation) == "situv2(beta=4, linear_beta=25.0)"

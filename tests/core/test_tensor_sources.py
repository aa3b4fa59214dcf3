"""One rule for which file holds a tensor, and one for 4-D scales, in every reader
(the loaders' `read_layer_experts`, `doctor`'s weight check, `convert`)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_k3_moe.configs import K3MoEConfig
from kimi_k3_moe.weights import CheckpointError, CheckpointReader, convert_run, read_layer_experts
from kimi_k3_moe.weights import converted as conv
from kimi_k3_moe.weights.check import check_weights
from kimi_k3_moe.weights.checkpoint import INDEX_FILE, expert_tensor_name
from kimi_k3_moe.weights.synthetic import make_checkpoint

SHAPE = dict(hidden_size=128, routed_expert_hidden_size=64, moe_intermediate_size=64,
             num_experts=4, num_experts_per_token=2)
SCALE = expert_tensor_name(1, 2, "w1", "weight_scale")


def read(path):
    return read_layer_experts(path, 1, hidden_size=64, intermediate_size=64, num_experts=4)


def doctor(path):
    return check_weights(path, K3MoEConfig.from_hf_config(path), progress=False)


def convert(path, tmp_path):
    return convert_run.convert_checkpoint(path, tmp_path / "out", target="gfx942", progress=False, log=lambda _: None)


def write_stray_copy(folder, gen):
    """A file beside the shards holding another copy of one expert's scale (random, never zeros)."""
    real = CheckpointReader(folder).get(SCALE)
    stray = torch.randint(100, 140, real.shape, generator=gen, dtype=torch.uint8)
    save_file({SCALE: stray}, folder / "zz-stray.safetensors")
    return real


def test_without_an_index_a_tensor_in_two_files_is_refused_naming_both(tmp_path, seed, gen):
    model = make_checkpoint(tmp_path / "m", seed=seed, **SHAPE)
    write_stray_copy(model, gen)
    both = rf"{SCALE}.*in both .*model\.safetensors and .*zz-stray\.safetensors"
    with pytest.raises(CheckpointError, match=both):
        read(model)
    problems, _ = doctor(model)
    assert len(problems) == 1 and "zz-stray.safetensors" in problems[0] and "model.safetensors" in problems[0]
    with pytest.raises(CheckpointError, match=both):
        convert(model, tmp_path)


def test_with_an_index_an_unlisted_file_is_ignored_and_doctor_mentions_it(tmp_path, seed, gen):
    model = make_checkpoint(tmp_path / "m", seed=seed, shards=2, **SHAPE)
    real = write_stray_copy(model, gen)
    reader = CheckpointReader(model)
    assert [p.name for p in reader.unlisted] == ["zz-stray.safetensors"]
    assert torch.equal(reader.get(SCALE), real)
    assert torch.equal(read(model).w13_scale[2, :64], real)
    problems, summary = doctor(model)
    assert problems == [] and f"ignored 1 *.safetensors file(s) that {INDEX_FILE} does not list" in summary
    assert "zz-stray.safetensors" in summary


@pytest.mark.parametrize("shape_of", [
    lambda n, k: (n, 1, k, 2),  # the case: two planes, one silently dropped before
    lambda n, k: (n, 2, k, 1),
    lambda n, k: (1, n, k, 1),
    lambda n, k: (n, k, 1),
])
def test_a_scale_of_an_unknown_layout_is_refused_by_every_reader(tmp_path, seed, gen, shape_of):
    model = make_checkpoint(tmp_path / "m", seed=seed, **SHAPE)
    tensors = load_file(model / "model.safetensors")
    n, k = tensors[SCALE].shape
    tensors[SCALE] = torch.randint(100, 140, shape_of(n, k), generator=gen, dtype=torch.uint8)
    save_file(tensors, model / "model.safetensors")
    shape = str(tuple(shape_of(n, k))).replace("(", r"\(").replace(")", r"\)")
    named = rf"{SCALE}.*shape {shape}"
    with pytest.raises(CheckpointError, match=named):
        read(model)
    problems, _ = doctor(model)
    assert len(problems) == 1 and SCALE in problems[0] and str(tuple(shape_of(n, k))) in problems[0]
    with pytest.raises(CheckpointError, match=named):
        convert(model, tmp_path)
    assert not (tmp_path / "out" / conv.RECORD_FILE).exists()


def test_the_known_4d_layout_reads_as_its_2d_plane(tmp_path, seed):
    flat = read(make_checkpoint(tmp_path / "a", seed=seed, **SHAPE))
    four = make_checkpoint(tmp_path / "b", seed=seed, scale_4d=True, **SHAPE)
    assert CheckpointReader(four).info(SCALE)[1] == (64, 1, 2, 1)
    assert all(torch.equal(x, y) for x, y in zip(flat.tensors(), read(four).tensors()))
    assert doctor(four)[0] == []


def test_index_rule_is_unchanged_for_listed_files(tmp_path, seed):
    model = make_checkpoint(tmp_path / "m", seed=seed, shards=3, **SHAPE)
    index = json.loads((model / INDEX_FILE).read_text())["weight_map"]
    reader = CheckpointReader(model)
    assert reader.unlisted == [] and {reader.shard_of(n).name for n in index} == set(index.values())

"""The pre-converted folder's source fingerprint notices every change; convert redoes a stale
conversion and leaves no file of another TP size behind."""
import os

import pytest

from kimi_k3_moe.weights import convert_run, source
from kimi_k3_moe.weights import converted as conv
from kimi_k3_moe.weights.synthetic import make_checkpoint

SHAPE = dict(num_layers=3, hidden_size=128, routed_expert_hidden_size=64, moe_intermediate_size=64,
             num_experts=4, num_experts_per_token=2)


@pytest.fixture
def model(tmp_path, seed):
    return make_checkpoint(tmp_path / "model", seed=seed, shards=2, **SHAPE)


def convert(model, logged=None, **kw):
    return convert_run.convert_checkpoint(model, model / conv.CONVERTED_DIRNAME, target="gfx942", progress=False,
                                   log=(logged.append if logged is not None else lambda _: None), **kw)


def flip_a_data_byte(shard, keep_mtime):
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x01   # last expert bytes: same size, same header
    shard.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def stale(model):
    with pytest.raises(conv.ConvertedCheckpointError, match="is stale"):
        conv.find_converted(model, tp_size=1, tp_rank=0, env={})
    return True


def test_every_component_of_the_fingerprint_notices_a_change(model, monkeypatch):
    shard = sorted(model.glob("*.safetensors"))[1]
    convert(model)
    os.utime(shard)   # touched (or rewritten with the same bytes): mtime
    assert stale(model)
    convert(model)
    flip_a_data_byte(shard, keep_mtime=True)   # same size and mtime: the sampled content
    assert stale(model)
    monkeypatch.setattr(source, "_SAMPLE_BYTES", 1)   # a change outside the samples, as in a large shard
    convert(model)
    flip_a_data_byte(shard, keep_mtime=False)
    assert stale(model)


def test_convert_redoes_a_stale_conversion(model):
    convert(model)
    flip_a_data_byte(sorted(model.glob("*.safetensors"))[0], keep_mtime=False)
    logged = []
    convert(model, logged)
    assert logged[0].endswith("holds a conversion of an older state of the source: converting again")
    found = conv.find_converted(model, tp_size=1, tp_rank=0, env={})
    assert convert_run.verify_sources(found, model, progress=False) == []
    logged.clear()
    convert(model, logged)
    assert logged[0].endswith("nothing to do")


def test_another_tp_size_replaces_the_old_files(model):
    out = convert(model, tp_size=2).path
    assert sorted(p.name for p in out.glob("layer*")) == [conv.layer_file(layer, r, 2)
                                                          for layer in (1, 2) for r in (0, 1)]
    logged = []
    convert(model, logged, tp_size=1)
    assert sorted(p.name for p in out.glob("layer*")) == [conv.layer_file(1, 0, 1), conv.layer_file(2, 0, 1)]
    assert "removed 4 file(s) of another conversion" in logged[-1]
    assert conv.find_converted(model, tp_size=1, tp_rank=0, env={}).tp_size == 1

"""Pre-converted int4 checkpoints: `kimi-k3-moe convert`, then load as a plugin would."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from moe_helpers import SITU

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.kernels import get_backend
from kimi_k3_moe.loading import prepare_for
from kimi_k3_moe.weights import CheckpointReader, convert_run, read_layer_experts
from kimi_k3_moe.weights import converted as conv
from kimi_k3_moe.weights.requant import requantize_experts
from kimi_k3_moe.weights.synthetic import make_checkpoint

SHAPE = dict(num_layers=3, hidden_size=128, routed_expert_hidden_size=64, moe_intermediate_size=64,
             num_experts=8, num_experts_per_token=2)


def on_the_fly(model, layer, rank, tp, method="search"):
    experts = read_layer_experts(CheckpointReader(model), layer, hidden_size=64, intermediate_size=64,
                                 num_experts=8, tp_rank=rank, tp_size=tp)
    return requantize_experts(experts, method=method, progress=False)


def same_bits(a, b):
    pairs = [(getattr(x, f), getattr(y, f)) for x, y in ((a.w13, b.w13), (a.w2, b.w2))
             for f in ("packed", "scales", "offsets")]
    return a.method == b.method and all((u is None and v is None) or torch.equal(u, v) for u, v in pairs)


@pytest.fixture
def model(tmp_path, seed):
    return make_checkpoint(tmp_path / "model", seed=seed, shards=2, **SHAPE)


def convert(model, **kw):
    kw.setdefault("target", "gfx942")
    return convert_run.convert_checkpoint(model, model / conv.CONVERTED_DIRNAME, progress=False,
                                   log=lambda _: None, **kw)


def test_cli_round_trip_matches_on_the_fly_conversion_bit_for_bit(model):
    out = model / conv.CONVERTED_DIRNAME
    result = subprocess.run([sys.executable, "-m", "kimi_k3_moe", "convert", "--model", str(model),
                             "--out", str(out), "--target", "gfx942", "--tp", "2", "--no-progress"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 MoE layer(s) x TP 2 with method 'search'" in result.stdout
    for rank in range(2):
        found = conv.find_converted(model, tp_size=2, tp_rank=rank, target="gfx942", method="search",
                                    num_experts=8, hidden_size=64, intermediate_size=64, env={})
        assert found is not None and found.layers == [1, 2]
        for layer in found.layers:
            assert same_bits(found.load_layer(layer, rank), on_the_fly(model, layer, rank, 2))
    # Expert parallelism loads a subset, contiguous runs or not.
    subset = found.load_layer(2, 1, experts=[1, 2, 3, 6])
    assert same_bits(subset, on_the_fly(model, 2, 1, 2).select([1, 2, 3, 6]))
    verify = subprocess.run([sys.executable, "-m", "kimi_k3_moe", "convert", "--model", str(model),
                             "--out", str(out), "--target", "gfx942", "--tp", "2", "--verify",
                             "--no-progress"], capture_output=True, text=True, timeout=600)
    assert verify.returncode == 0 and "OK: 4 file(s)" in verify.stdout, verify.stdout + verify.stderr


def test_loaded_experts_serve_on_the_torch_backend(model, gen):
    found = convert(model, method="asym")
    loaded = found.load_layer(1, 0)
    backend = get_backend("torch", weight_format="int4", int4_method=found.method)
    fresh = prepare_for(backend, read_layer_experts(CheckpointReader(model), 1, hidden_size=64,
                                               intermediate_size=64, num_experts=8))
    hidden = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 8, (5, 2), generator=gen, dtype=torch.int32)
    weights = torch.rand(5, 2, generator=gen)
    situ = SITU
    assert torch.equal(backend.forward(backend.prepare(loaded), hidden, weights, ids, situ),
                       backend.forward(fresh, hidden, weights, ids, situ))


def test_stale_source_is_refused_saying_why(model, seed):
    convert(model, tp_size=2)
    make_checkpoint(model, seed=seed + 1, shards=2, **SHAPE)  # the model was re-exported
    with pytest.raises(conv.ConvertedCheckpointError, match="is stale: the weight files in .* changed"):
        conv.find_converted(model, tp_size=2, tp_rank=0, env={})
    found = conv.find_converted(model, tp_size=2, tp_rank=0, check_source=False, env={})
    assert convert_run.verify_sources(found, model, progress=False) == sorted(found.record["files"])


def test_mismatched_settings_are_refused_saying_why(model):
    convert(model, tp_size=2)
    cases = [
        (dict(tp_size=4, tp_rank=0), "converted for tensor-parallel size 2, this server runs 4"),
        (dict(tp_size=2, tp_rank=0, method="asym"), "holds int4 method 'search', the backend asks for 'asym'"),
        (dict(tp_size=2, tp_rank=0, target="gfx950"), "converted for target 'gfx942', this GPU is 'gfx950'"),
        (dict(tp_size=2, tp_rank=0, num_experts=16), "num_experts 8, this model 16"),
    ]
    for kwargs, message in cases:
        with pytest.raises(conv.ConvertedCheckpointError, match=message):
            conv.find_converted(model, env={}, **kwargs)
    found = conv.find_converted(model, tp_size=2, tp_rank=0, env={})
    with pytest.raises(conv.ConvertedCheckpointError, match="no layer 7 for TP rank 0/2"):
        found.load_layer(7, 0)


def test_tampered_files_are_refused(model):
    out = convert(model, tp_size=2).path
    shutil.copy(out / conv.layer_file(2, 0, 2), out / conv.layer_file(1, 0, 2))  # same size, other layer
    found = conv.find_converted(model, tp_size=2, tp_rank=0, env={})
    with pytest.raises(conv.ConvertedCheckpointError, match="layer001-tp0of2.safetensors changed since conversion"):
        found.load_layer(1, 0)
    with open(out / conv.layer_file(2, 1, 2), "ab") as f:
        f.write(b"\0")
    with pytest.raises(conv.ConvertedCheckpointError, match="truncated or replaced"):
        found.load_layer(2, 1)
    record = json.loads((out / conv.RECORD_FILE).read_text())
    record["format_version"] = conv.FORMAT_VERSION + 1
    (out / conv.RECORD_FILE).write_text(json.dumps(record))
    with pytest.raises(conv.ConvertedCheckpointError,
                       match=f"format version {conv.FORMAT_VERSION + 1}, this kimi-k3-moe .* reads version "
                             f"{conv.FORMAT_VERSION}"):
        conv.find_converted(model, tp_size=2, tp_rank=0, env={})


def test_where_plugins_look(model, tmp_path):
    assert conv.find_converted(model, tp_size=1, tp_rank=0, env={}) is None  # nothing converted: convert at load
    with pytest.raises(conv.ConvertedCheckpointError, match="KIMI_K3_MOE_CONVERTED=.* does not exist"):
        conv.find_converted(model, tp_size=1, tp_rank=0, env={conv.ENV_CONVERTED: str(tmp_path / "nope")})
    elsewhere = tmp_path / "elsewhere"
    convert_run.convert_checkpoint(model, elsewhere, target="gfx942", progress=False, log=lambda _: None)
    found = conv.find_converted(model, tp_size=1, tp_rank=0, env={conv.ENV_CONVERTED: str(elsewhere)})
    assert found.path == elsewhere
    with pytest.raises(conv.ConvertedCheckpointError, match="only .*gfx942.* run int4"):
        convert_run.convert_checkpoint(model, elsewhere, target="gfx950", progress=False)
    with pytest.raises(conv.ConvertedCheckpointError, match="is the model folder itself"):
        convert_run.convert_checkpoint(model, model, target="gfx942", progress=False)


def test_interrupted_conversion_is_refused_then_resumed(model, monkeypatch):
    real = convert_run.requantize_experts
    calls = []

    def fail_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(convert_run, "requantize_experts", fail_on_third)
    with pytest.raises(KeyboardInterrupt):
        convert(model, tp_size=2)
    with pytest.raises(conv.ConvertedCheckpointError, match="conversion did not finish"):
        conv.find_converted(model, tp_size=2, tp_rank=0, env={})
    monkeypatch.setattr(convert_run, "requantize_experts", real)
    logged = []
    convert_run.convert_checkpoint(model, model / conv.CONVERTED_DIRNAME, target="gfx942", tp_size=2,
                            progress=False, log=logged.append)
    assert logged == ["resuming: 2 file(s) already converted"]
    found = conv.find_converted(model, tp_size=2, tp_rank=1, env={})
    assert same_bits(found.load_layer(2, 1), on_the_fly(model, 2, 1, 2))


def test_routed_experts_core_serves_a_converted_layer(model, gen):
    """The plugins' layer core loads pre-converted experts as it loads MXFP4 ones (torch backend)."""
    from kimi_k3_moe.dispatch import BackendChoice
    from kimi_k3_moe.platform import Platform
    from kimi_k3_moe.reference import dense_moe, relative_l2
    from kimi_k3_moe.routed_experts import RoutedExperts

    found = convert(model)
    situ = SITU
    plan = [BackendChoice("torch", {"weight_format": "int4", "int4_method": found.method})]
    layer = RoutedExperts(situ, platform=Platform("cpu"), plan=plan, self_check="strict")
    experts = found.load_layer(1, 0)
    layer.load(experts)
    hidden = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 8, (6, 2), generator=gen, dtype=torch.int32)
    weights = torch.rand(6, 2, generator=gen)
    expected = dense_moe(hidden.double(), lambda e: experts.dequantize(e)[0].double(),
                         lambda e: experts.dequantize(e)[1].double(), weights, ids, situ,
                         compute_dtype=torch.float64)
    silu = dense_moe(hidden.double(), lambda e: experts.dequantize(e)[0].double(),
                     lambda e: experts.dequantize(e)[1].double(), weights, ids, ActivationSpec.silu(),
                     compute_dtype=torch.float64)
    out = layer(hidden, weights, ids)
    assert relative_l2(out, expected) < 1e-2 < relative_l2(out, silu)

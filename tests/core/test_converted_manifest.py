"""A converted folder's manifest (the record's per-file size, SHA-256 and sampled digest): the quick
check at load, the full check of `convert --verify` and `doctor --model`, and a fuzz over damaged
folders in which every case is refused at load or by --verify and none is served."""
import json
import random
import shutil
import struct

import pytest
import torch

from kimi_k3_moe import cli
from kimi_k3_moe.weights import convert_run, manifest
from kimi_k3_moe.weights import converted as conv
from kimi_k3_moe.weights.synthetic import make_checkpoint

SHAPE = dict(num_layers=3, hidden_size=128, routed_expert_hidden_size=64, moe_intermediate_size=64,
             num_experts=4, num_experts_per_token=2)
TP = 2


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, module_gen):
    """(model folder, its converted folder), converted once for the module; cases work on copies.

    The quick check's samples shrink to 64 bytes so that, as in a real file of gigabytes, most data
    bytes lie outside them (the test files are ~10 KiB, less than the real 16 x 64 KiB)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(manifest, "SAMPLE_BYTES", 64)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=module_gen))
        model = make_checkpoint(tmp_path_factory.mktemp("model") / "m", seed=seed, **SHAPE)
        out = tmp_path_factory.mktemp("converted") / "int4"
        convert_run.convert_checkpoint(model, out, target="gfx942", tp_size=TP, progress=False, log=lambda _: None)
        yield model, out


@pytest.fixture
def copy(pristine, tmp_path):
    model, out = pristine
    target = tmp_path / "int4"
    shutil.copytree(out, target)
    return model, target


def verify(model, out, capsys) -> tuple[int, str]:
    rc = cli.main(["convert", "--model", str(model), "--out", str(out), "--target", "gfx942",
                   "--tp", str(TP), "--verify", "--no-progress"])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def load_everything(model, out):
    """What a server does at start, for every rank: find the folder, then load each layer."""
    for rank in range(TP):
        found = conv.find_converted(model, tp_size=TP, tp_rank=rank, target="gfx942",
                                    env={conv.ENV_CONVERTED: str(out)})
        for layer in found.layers:
            found.load_layer(layer, rank)


def layer_files(out):
    return sorted(p for p in out.glob("layer*-tp*of*.safetensors"))


def header_span(path):
    length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    return 8, 8 + length


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def test_the_record_lists_every_file_with_its_sha256(pristine):
    _, out = pristine
    record = json.loads((out / conv.RECORD_FILE).read_text())
    assert sorted(record["files"]) == [p.name for p in layer_files(out)]
    for name, entry in record["files"].items():
        assert entry["sha256"] == manifest.file_sha256(out / name)
        assert entry["size"] == (out / name).stat().st_size
    assert record["tp_size"] == TP and record["target"] == "gfx942" and record["method"]
    assert record["source"]["fingerprint"].startswith("sha256:")


def test_verify_names_a_deleted_an_extra_and_a_changed_file(copy, capsys, seed):
    model, out = copy
    files = layer_files(out)
    files[0].unlink()
    # same size, one data byte changed outside the sampled blocks: only the full check sees it
    target = files[1]
    start, end = header_span(target)
    offset = _unsampled_offset(target, random.Random(seed))
    flip(target, offset)
    (out / "notes.txt").write_text("left here\n")
    rc, text = verify(model, out, capsys)
    assert rc == 1, text
    assert f"missing: {files[0]}" in text
    assert f"changed: {target} has other bytes" in text
    assert f"extra: {out / 'notes.txt'}" in text
    assert "OK" not in text


def test_load_refuses_a_changed_header_or_a_missing_file_naming_it(copy, seed):
    model, out = copy
    files = layer_files(out)
    start, end = header_span(files[2])
    flip(files[2], random.Random(seed).randrange(start, end))
    with pytest.raises(conv.ConvertedCheckpointError, match=f"{files[2]} changed since conversion"):
        load_everything(model, out)
    files[3].unlink()
    with pytest.raises(conv.ConvertedCheckpointError, match=f"{files[3]} is listed in .* but missing"):
        conv.find_converted(model, tp_size=TP, tp_rank=1, env={conv.ENV_CONVERTED: str(out)})


def test_doctor_runs_the_full_check(copy, capsys, seed, monkeypatch):
    model, out = copy
    target = layer_files(out)[0]
    flip(target, _unsampled_offset(target, random.Random(seed)))
    monkeypatch.setenv(conv.ENV_CONVERTED, str(out))
    rc = cli.main(["doctor", "--model", str(model), "--tp", str(TP), "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 1
    assert f"CANNOT SERVE: converted int4 experts: changed: {target} has other bytes" in text


def _sampled_ranges(path):
    """Byte ranges the quick check reads (header, then manifest.SAMPLE_BLOCKS blocks of data)."""
    size = path.stat().st_size
    _, data_start = header_span(path)
    data_len = size - data_start
    ranges = [(0, data_start)]
    for k in range(manifest.SAMPLE_BLOCKS):
        first = data_start + data_len * k // manifest.SAMPLE_BLOCKS
        ranges.append((first, first + min(manifest.SAMPLE_BYTES, data_len)))
    return ranges


def _unsampled_offset(path, rng):
    """A data byte the quick check does not read; shrinks the sample to one byte when needed, as in
    a file far larger than the samples."""
    outside = [o for o in range(path.stat().st_size)
               if not any(a <= o < b for a, b in _sampled_ranges(path))]
    if not outside:
        pytest.skip("the test files are smaller than the sampled blocks")
    return rng.choice(outside)


def _cases(out, rng):
    """(kind, whether the quick check at load reads the damaged bytes, how to damage a copy) over
    deletions, truncations, appends, and byte flips in headers and data."""
    files = [p.name for p in layer_files(out)]
    cases = [("delete", True, lambda d, n=n: (d / n).unlink()) for n in files]
    cases.append(("delete record", True, lambda d: (d / conv.RECORD_FILE).unlink()))
    for n in files:
        size = (out / n).stat().st_size
        cut = rng.randrange(0, size)
        cases.append(("truncate", True, lambda d, n=n, cut=cut: (d / n).write_bytes((d / n).read_bytes()[:cut])))
        cases.append(("append", True, lambda d, n=n: (d / n).write_bytes((d / n).read_bytes() + b"\x01")))
        start, end = header_span(out / n)
        for offset in [rng.randrange(0, 8), *rng.sample(range(start, end), 3)]:
            cases.append(("header flip", True, lambda d, n=n, o=offset: flip(d / n, o)))
        sampled = _sampled_ranges(out / n)
        inside = [o for o in range(end, size) if any(a <= o < b for a, b in sampled)]
        outside = sorted(set(range(end, size)) - set(inside))
        for seen, offsets in ((True, inside), (False, outside)):
            for offset in rng.sample(offsets, 3):
                cases.append(("data flip", seen, lambda d, n=n, o=offset: flip(d / n, o)))
    # a file the record does not list is never opened at load; --verify names it
    cases.append(("extra file", False, lambda d: shutil.copy(d / files[0], d / "layer009-tp0of2.safetensors")))
    return cases


def test_fuzz_every_damaged_folder_is_refused_and_none_is_served(pristine, tmp_path, capsys, seed):
    model, out = pristine
    rng = random.Random(seed)
    served, kinds = [], set()
    for k, (kind, load_sees_it, damage) in enumerate(_cases(out, rng)):
        kinds.add((kind, load_sees_it))
        case = tmp_path / f"case{k}"
        shutil.copytree(out, case)
        damage(case)
        try:
            load_everything(model, case)
            refused_at_load = False
        except conv.ConvertedCheckpointError:
            refused_at_load = True
        rc, text = verify(model, case, capsys)
        if rc == 0:
            served.append(f"{kind}: --verify said {text.strip()!r}")
        if refused_at_load != load_sees_it:
            served.append(f"{kind}: refused at load {refused_at_load}, expected {load_sees_it}")
        shutil.rmtree(case)
    assert served == []
    assert len(kinds) == 8, kinds


def test_convert_again_redoes_a_damaged_folder_instead_of_nothing_to_do(copy):
    model, out = copy
    victim = layer_files(out)[1]
    victim.unlink()
    said = []
    convert_run.convert_checkpoint(model, out, target="gfx942", tp_size=TP, progress=False, log=said.append)
    assert any(f"{victim} is listed in" in line and "converting again" in line for line in said), said
    rc = cli.main(["convert", "--model", str(model), "--out", str(out), "--target", "gfx942",
                   "--tp", str(TP), "--verify", "--no-progress"])
    assert rc == 0 and victim.is_file()

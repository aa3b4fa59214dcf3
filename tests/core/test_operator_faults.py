"""Operator faults, made real where this machine allows: a full disk (a small tmpfs, or a file-size
limit), a read-only filesystem, a shard this user may not read (root with CAP_DAC_OVERRIDE and
CAP_DAC_READ_SEARCH dropped: root ignores file modes otherwise), another model's conversion, a manifest
of binary bytes, a typo in --layers. Each ends in one line naming the path or value and the real
cause, exit 2; the loaders raise their own error type with the same line."""
from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_errors import SHAPE, cli, doctor_problems, one_line_error

from kimi_k3_moe.weights import converted as conv
from kimi_k3_moe.weights.checkpoint import INDEX_FILE, CheckpointError, CheckpointReader
from kimi_k3_moe.weights.synthetic import make_checkpoint

REPO = Path(__file__).resolve().parents[2]
NO_DAC = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]


def convert_args(model, out, *extra):
    return ("convert", "--model", model, "--out", out, "--target", "gfx942", "--no-progress", *extra)


@pytest.fixture
def model(tmp_path, seed):
    return make_checkpoint(tmp_path / "model", seed=seed, shards=2, **SHAPE)


@pytest.fixture
def mount_point(tmp_path):
    """A folder to mount a tmpfs on, unmounted afterwards; skips where mounting is not permitted."""
    where = tmp_path / "fs"
    where.mkdir()
    mounted = []

    def mount(*options: str) -> Path:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {result.stderr.strip()}")
        mounted.append(where)
        return where
    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def without_dac(*args):
    """The CLI as root without the capabilities that let root read any file, or skip saying why."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run without CAP_DAC_OVERRIDE")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*NO_DAC, sys.executable, "-m", "kimi_k3_moe", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env=env)


def unreadable(path: Path) -> Path:
    os.chown(path, 65534, 65534)  # nobody's, mode 0600: root without DAC capabilities may not read it
    path.chmod(0o600)
    return path


def test_convert_onto_a_full_disk_names_the_file_and_no_space(model, mount_point):
    fs = mount_point("size=16k")
    out = fs / "int4"
    line = one_line_error(cli(*convert_args(model, out)), "convert", f"cannot write {out}/", "no space left on device")
    assert "internal error" not in line and "SafetensorError" not in line
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))  # no half-written file left
    subprocess.run(["mount", "-o", "remount,size=4m", str(fs)], check=True)  # space freed: convert again
    result = cli(*convert_args(model, out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert conv.find_converted(model, tp_size=1, tp_rank=0, env={conv.ENV_CONVERTED: str(out)}) is not None


def test_convert_past_a_file_size_limit_names_the_file(model, tmp_path):
    def limit():  # RLIMIT_FSIZE: writes past 4 KiB fail with EFBIG once SIGXFSZ no longer kills
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "kimi_k3_moe", *map(str, convert_args(model, tmp_path / "o"))],
                            capture_output=True, text=True, timeout=300, env=env, preexec_fn=limit)
    one_line_error(result, "convert", f"cannot write {tmp_path / 'o'}/", "file too large")


def test_convert_into_a_read_only_filesystem_names_the_cause(model, mount_point):
    fs = mount_point("size=4m")
    out = fs / "int4"
    assert cli(*convert_args(model, out)).returncode == 0
    subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
    one_line_error(cli(*convert_args(model, out, "--tp", "2")), "convert", str(out), "read-only file system")


def test_an_unreadable_shard_is_a_permission_error_not_corruption(model):
    shard = unreadable(sorted(model.glob("*.safetensors"))[1])
    problems = doctor_problems(without_dac("doctor", "--model", model, "--no-progress"))
    assert any(f"cannot read shard {shard}: permission denied" in p for p in problems), problems
    assert not any("corrupt" in p for p in problems), problems
    line = one_line_error(without_dac(*convert_args(model, model.parent / "out")), "convert")
    assert str(shard) in line and "permission denied" in line


def test_doctor_and_convert_read_the_same_files(model):
    """A stray unreadable *.safetensors beside the index: doctor ignores it (naming it), and so do convert
    and its source fingerprint (it refused the folder); what doctor blesses, convert accepts."""
    stray = model / "zz-stray.safetensors"
    shutil.copy(sorted(model.glob("model-*.safetensors"))[0], stray)
    unreadable(stray)
    result = without_dac("doctor", "--model", model, "--no-progress")
    assert result.returncode == 0 and "ignored 1 *.safetensors file(s)" in result.stdout, result.stdout + result.stderr
    result = without_dac(*convert_args(model, model.parent / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert [p.name for p in CheckpointReader(model).unlisted] == ["zz-stray.safetensors"]


def test_the_loaders_raise_their_own_type_with_the_cause(model, tmp_path):
    """In a process without DAC capabilities: CheckpointError / ConvertedCheckpointError, 'permission denied'."""
    assert cli(*convert_args(model, model / conv.CONVERTED_DIRNAME)).returncode == 0
    layer = unreadable(model / conv.CONVERTED_DIRNAME / conv.layer_file(1, 0, 1))
    shard = unreadable(sorted(model.glob("model-*.safetensors"))[0])
    locked = tmp_path / "locked"  # a folder it may not list: glob saw it empty ("no *.safetensors files")
    locked.mkdir()
    os.chown(locked, 65534, 65534)
    locked.chmod(0o700)
    script = f"""
from kimi_k3_moe.weights import converted as conv
from kimi_k3_moe.weights.checkpoint import CheckpointError, CheckpointReader
try:
    reader = CheckpointReader({str(model)!r})
    reader.get(next(n for n in reader.names() if reader.shard_of(n).name == {shard.name!r}))
except CheckpointError as exc:
    print("checkpoint:", exc)
found = conv.find_converted({str(model)!r}, tp_size=1, tp_rank=0, check_source=False, env={{}})
try:
    found.load_layer(1, 0)
except conv.ConvertedCheckpointError as exc:
    print("converted:", exc)
try:
    CheckpointReader({str(locked)!r})
except CheckpointError as exc:
    print("folder:", exc)
"""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run without CAP_DAC_OVERRIDE")
    out = subprocess.run([*NO_DAC, sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 3, out.stdout + out.stderr
    assert lines[0].startswith("checkpoint: tensor '") and \
        lines[0].endswith(f": cannot read shard {shard}: permission denied"), lines[0]
    assert lines[1] == f"converted: cannot read {layer}: permission denied", lines[1]
    assert lines[2] == f"folder: cannot read folder {locked}: permission denied", lines[2]


@pytest.mark.parametrize("layers, needle", [
    ("4-2", "'4-2' is a reversed range"),
    ("1,,2", "'' is not N or N-M"),
    ("-3", "'-3' is not N or N-M"),
    ("0-99999999999999999999", "layer numbers run from 0 to 100000"),
])
def test_a_typo_in_layers_is_refused_before_anything_is_written(model, tmp_path, layers, needle):
    out = tmp_path / "out"
    one_line_error(cli(*convert_args(model, out, "--layers", layers)), "convert", "--layers", needle)
    assert not out.exists()  # it wrote an empty conversion, which doctor blessed and servers refused


def test_another_models_conversion_is_kept_unless_forced(model, tmp_path, seed):
    other = make_checkpoint(tmp_path / "other", seed=seed + 1, shards=1, **SHAPE)
    out = tmp_path / "int4"
    assert cli(*convert_args(other, out)).returncode == 0
    before = json.loads((out / conv.RECORD_FILE).read_text())
    line = one_line_error(cli(*convert_args(model, out)), "convert", "holds a conversion of another model",
                          str(other.resolve()), str(model.resolve()), "--force")
    assert "older state" not in line
    assert json.loads((out / conv.RECORD_FILE).read_text()) == before  # untouched
    with pytest.raises(conv.ConvertedCheckpointError, match="holds a conversion of another model"):  # the loaders
        conv.find_converted(model, tp_size=1, tp_rank=0, env={conv.ENV_CONVERTED: str(out)})
    result = cli(*convert_args(model, out, "--force"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "a conversion of another model (--force): converting again" in result.stdout
    record = json.loads((out / conv.RECORD_FILE).read_text())
    assert record["source"]["path"] == str(model.resolve())
    assert record["source"]["identity"]["shards"] == {p.name: p.stat().st_size for p in model.glob("*.safetensors")}


def test_a_manifest_of_binary_bytes_is_named_by_every_reader(model, seed):
    out = model / conv.CONVERTED_DIRNAME
    assert cli(*convert_args(model, out)).returncode == 0
    record = out / conv.RECORD_FILE
    record.write_bytes(bytes(random.Random(seed).randrange(128, 256) for _ in range(300)))
    needle = f"{record} is not UTF-8 text"
    with pytest.raises(conv.ConvertedCheckpointError, match="is not UTF-8 text"):
        conv.find_converted(model, tp_size=1, tp_rank=0, env={})
    one_line_error(cli(*convert_args(model, out, "--verify")), "convert", needle)
    assert any(needle in p for p in doctor_problems(cli("doctor", "--model", model, "--no-progress")))
    one_line_error(cli(*convert_args(model, out)), "convert", needle, "--force")  # converting refuses too


def test_an_index_that_is_not_utf8_is_named(model):
    (model / INDEX_FILE).write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE} is not UTF-8 text"):
        CheckpointReader(model)

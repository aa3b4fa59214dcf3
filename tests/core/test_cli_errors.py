"""Broken inputs, as a user would hand them to the CLI (a subprocess each): one line on stderr naming the
thing, exit 2 for usage/data errors (1 for a model doctor finds unservable), never a traceback."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_k3_moe.weights.checkpoint import INDEX_FILE, expert_tensor_name
from kimi_k3_moe.weights.synthetic import make_checkpoint

REPO = Path(__file__).resolve().parents[2]
SHAPE = dict(num_layers=2, hidden_size=64, routed_expert_hidden_size=64, moe_intermediate_size=64,
             num_experts=4, num_experts_per_token=2)


def cli(*args, **env):
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-m", "kimi_k3_moe", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env=full)


def one_line_error(result, command, *needles, code=2):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "error" not in result.stdout.lower(), result.stderr
    assert len(lines) == 1 and lines[0].startswith(f"kimi-k3-moe {command}: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def doctor_problems(result):
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if line.startswith("CANNOT SERVE: ")]


@pytest.fixture
def model(tmp_path, seed):
    return make_checkpoint(tmp_path / "model", seed=seed, shards=2, **SHAPE)


def shard_holding(model, name):
    return model / json.loads((model / INDEX_FILE).read_text())["weight_map"][name]


def rewrite(model, name, change):
    shard = shard_holding(model, name)
    tensors = load_file(shard)
    tensors[name] = change(tensors[name])
    save_file(tensors, shard)


def test_doctor_passes_a_good_model_and_checks_its_weights(model):
    result = cli("doctor", "--model", model, "--no-progress")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "weights: 2 shard(s); 1 MoE layer(s) x 4 experts x 6 tensors checked" in result.stdout
    assert result.stdout.rstrip().endswith("OK")


def test_doctor_finds_nan_scale_bytes_wrong_dtypes_and_shapes(model):
    nan = expert_tensor_name(1, 2, "w3", "weight_scale")
    rewrite(model, nan, lambda t: torch.where((torch.arange(t.shape[0]) == 3)[:, None]
                                              & (torch.arange(t.shape[1]) == 1), 255, t).to(torch.uint8))
    wrong_dtype = expert_tensor_name(1, 1, "w2", "weight_packed")
    rewrite(model, wrong_dtype, lambda t: t.view(torch.int8))
    quick = cli("doctor", "--model", model, "--config-only")
    assert quick.returncode == 0 and "weights: not checked (--config-only)" in quick.stdout
    problems = doctor_problems(cli("doctor", "--model", model, "--no-progress"))
    assert problems == [f"CANNOT SERVE: layer 1: tensor {wrong_dtype!r} has dtype I8; expected U8 (uint8)"]
    rewrite(model, wrong_dtype, lambda t: t.view(torch.uint8))
    (problem,) = doctor_problems(cli("doctor", "--model", model, "--no-progress"))
    assert "layer 1: expert 2 tensor w13_scale holds 1 NaN scale byte(s) 0xFF" in problem
    assert "checkpoint w3 (up) row 3" in problem
    rewrite(model, wrong_dtype, lambda t: t[:, :16].contiguous())
    problems = doctor_problems(cli("doctor", "--model", model, "--no-progress"))
    assert f"CANNOT SERVE: layer 1: tensor {wrong_dtype!r} has shape (64, 16); expected (64, 32)" in problems


def test_doctor_finds_unreadable_and_missing_shards(model):
    first, second = sorted(model.glob("*.safetensors"))
    second.write_bytes(second.read_bytes()[:-100])
    problems = doctor_problems(cli("doctor", "--model", model))
    assert problems[0].startswith(f"CANNOT SERVE: {second} is not a readable safetensors file")
    assert "expert tensor(s) are in the unreadable shard(s) above" in problems[1]
    first.unlink()
    (problem,) = doctor_problems(cli("doctor", "--model", model))
    assert f"lists 1 shard(s) that are missing: {first.name}" in problem
    (model / INDEX_FILE).write_text('{"weight_map": ')
    (problem,) = doctor_problems(cli("doctor", "--model", model))
    assert f"{model / INDEX_FILE} is not valid JSON" in problem


def test_doctor_validates_settings_and_arguments():
    (problem,) = doctor_problems(cli("doctor", KIMI_K3_MOE_SELF_CHECK="sometimes"))
    assert problem == ("CANNOT SERVE: KIMI_K3_MOE_SELF_CHECK='sometimes' is not accepted; choose one of "
                       "fallback, strict, off")
    one_line_error(cli("doctor", "--tp", "0"), "doctor", "argument --tp: 0 is not a positive integer")
    one_line_error(cli("doctor", "--config-only"), "doctor", "--config-only needs --model")


def test_doctor_refuses_a_model_path_that_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-model"
    for extra in ((), ("--config-only",)):
        result = cli("doctor", "--model", missing, *extra)
        one_line_error(result, "doctor", f"--model {missing} does not exist")
        assert result.stdout == ""  # refused before the report, like any usage error
    empty = tmp_path / "empty"
    empty.mkdir()  # exists but holds no model: doctor's answer (1), not a usage error
    assert doctor_problems(cli("doctor", "--model", empty)) == [f"CANNOT SERVE: model config {empty}: no config.json "
                                                                f"at {empty / 'config.json'}"]


def test_doctor_and_convert_refuse_a_model_without_moe_layers(model, tmp_path):
    cfg = json.loads((model / "config.json").read_text())
    cfg["text_config"]["first_k_dense_replace"] = 5
    (model / "config.json").write_text(json.dumps(cfg))
    needle = "no MoE layers: first_k_dense_replace 5 >= num_hidden_layers 2, so every layer is dense"
    (problem,) = doctor_problems(cli("doctor", "--model", model, "--no-progress"))  # it said OK
    assert needle in problem
    one_line_error(cli("convert", "--model", model, "--out", tmp_path / "out", "--target", "gfx942", "--layers", "1"),
                   "convert", needle)


def test_an_unknown_argument_is_reported_by_its_command():
    # argparse's own message named the top command: `kimi-k3-moe: error: unrecognized arguments: ...`
    one_line_error(cli("demo", "--model", "x"), "demo", "unrecognized arguments: --model x")
    one_line_error(cli("-v", "doctor", "--frob"), "doctor", "unrecognized arguments: --frob")


@pytest.mark.parametrize("field, value, needle", [
    ("activation_situ_beta", 0, "beta (activation_situ_beta) must be finite and > 0, got 0"),
    ("activation_situ_beta", "4.0", "beta (activation_situ_beta) must be a number, got '4.0'"),
    # finite in Python, inf in the kernels' float32: passed the checks and served NaN
    ("activation_situ_beta", 1e39, "beta (activation_situ_beta) 1e+39 is outside float32's normal range"),
    ("activation_situ_linear_beta", 1e-45, "activation_situ_linear_beta) 1e-45 is outside float32's normal range"),
    ("activation_situ_beta", 10**400, "must be finite and > 0, got 100000000000... (401 digits)"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
    ("num_expert_group", 0, "'num_expert_group' must be an integer >= 1, got 0"),
    # every layer dense: converted 0 layers and said so, or an IndexError with --layers
    ("first_k_dense_replace", 2, "no MoE layers: first_k_dense_replace 2 >= num_hidden_layers 2"),
])
def test_convert_refuses_bad_config_values(model, tmp_path, field, value, needle):
    cfg = json.loads((model / "config.json").read_text())
    cfg["text_config"][field] = value
    (model / "config.json").write_text(json.dumps(cfg))
    one_line_error(cli("convert", "--model", model, "--out", tmp_path / "out", "--target", "gfx942"),
                   "convert", needle)


def test_convert_refuses_unreadable_checkpoints_naming_the_file(tmp_path, seed):
    single = make_checkpoint(tmp_path / "single", seed=seed, **SHAPE)
    weights = single / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    args = ("convert", "--model", single, "--out", tmp_path / "out", "--target", "gfx942", "--no-progress")
    one_line_error(cli(*args), "convert", f"{weights} is not a readable safetensors file")
    (single / "config.json").write_text("{oops")
    one_line_error(cli(*args), "convert", f"{single / 'config.json'} is not valid JSON")


def test_convert_refuses_bad_arguments(model, tmp_path):
    base = ("convert", "--model", model, "--target", "gfx942")
    out = ("--out", tmp_path / "out")
    one_line_error(cli(*base, *out, "--device", "bogus"), "convert", "'bogus' is not a device")
    one_line_error(cli(*base, *out, "--device", "cuda"), "convert", "'cuda': no GPU is visible here")
    for bad in ("0", "-4"):
        one_line_error(cli(*base, *out, "--chunk-mib", bad), "convert", f"argument --chunk-mib: {bad} is not")
    one_line_error(cli(*base, *out, "--tp", "0"), "convert", "argument --tp: 0 is not a positive integer")
    existing = tmp_path / "a-file"
    existing.write_text("")
    one_line_error(cli(*base, "--out", existing), "convert", f"--out {existing} is an existing file")
    # an --out that cannot be created is named (it was a bare "[Errno 20] Not a directory: ...")
    one_line_error(cli(*base, "--out", existing / "sub"), "convert", f"--out {existing / 'sub'} cannot be created")
    one_line_error(cli("demo", "--out", existing / "sub"), "demo", f"--out {existing / 'sub'} cannot be written")


def test_convert_verify_refuses_a_folder_converted_with_other_options(model, tmp_path):
    out = tmp_path / "out"
    base = ("convert", "--model", model, "--target", "gfx942", "--out", out, "--no-progress")
    assert cli(*base).returncode == 0
    # this said "OK" for a TP 1 folder, which a TP 2 server then refuses
    one_line_error(cli(*base, "--verify", "--tp", "2", "--method", "asym"), "convert",
                   f"--out {out} holds a conversion made with --tp 1, --method search, not --tp 2, --method asym")
    one_line_error(cli(*base, "--verify", "--layers", "2"), "convert", "made with --layers [1], not --layers [2]")
    ok = cli(*base, "--verify")
    assert ok.returncode == 0 and "OK: 1 file(s)" in ok.stdout, ok.stdout + ok.stderr


@pytest.mark.parametrize("variable, value, allowed", [
    ("KIMI_K3_MOE_BACKEND", "cuda", "choose one of torch, triton, flydsl"),
    ("KIMI_K3_MOE_ACT_DTYPE", "fp16", "choose one of bf16, fp8, fp4"),
    ("KIMI_K3_MOE_SELF_CHECK", "yes", "choose one of fallback, strict, off"),
    ("KIMI_K3_MOE_VALIDATE_WEIGHTS", "0", "choose one of on, off"),
])
def test_demo_refuses_bad_settings_with_the_allowed_values(tmp_path, variable, value, allowed):
    one_line_error(cli("demo", "--out", tmp_path, "--tokens", "1", **{variable: value}), "demo",
                   f"{variable}={value!r} is not accepted; {allowed}")


def test_demo_arguments_are_range_checked_and_debug_shows_the_traceback(tmp_path):
    one_line_error(cli("demo", "--tokens", "-3"), "demo", "argument --tokens: -3 is not a non-negative integer")
    one_line_error(cli("demo", "--seed", "x"), "demo", "argument --seed: 'x' is not an integer")
    one_line_error(cli("demo", "--tokens", "1", str(2**31 - 1)), "demo",
                   f"--tokens {2**31 - 1} is above the demo's limit of 65536 tokens")
    (tmp_path / "a-file").write_text("")
    one_line_error(cli("demo", "--out", tmp_path / "a-file"), "demo", "is an existing file, not a folder")
    model = make_checkpoint(tmp_path / "a-model", **SHAPE)
    one_line_error(cli("demo", "--out", model), "demo", f"--out {model} is a non-empty folder that no demo wrote")
    debug = cli("demo", "--debug", "--out", tmp_path / "demo", KIMI_K3_MOE_BACKEND="cuda")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "SettingError" in debug.stderr


def test_demo_verdict_says_what_was_measured(tmp_path):
    nothing = cli("demo", "--out", tmp_path, "--tokens", "0")
    assert nothing.returncode == 1, nothing.stdout + nothing.stderr
    verdict = nothing.stdout.strip().splitlines()[-1]
    assert verdict.startswith("FAIL: nothing measured") and "SiTUv2" not in verdict
    fp8 = cli("demo", "--out", tmp_path, "--tokens", "3", KIMI_K3_MOE_ACT_DTYPE="fp8")
    assert "backend: torch[mxfp4, a8 emulated]" in fp8.stdout, fp8.stdout
    verdict = fp8.stdout.strip().splitlines()[-1]
    assert "torch[mxfp4, a8 emulated] on 1 batch(es) of 3 token(s)" in verdict
    if fp8.returncode:
        assert verdict.startswith("FAIL: ") and "activations are quantized" in verdict
        assert "follows SiTUv2" not in verdict and "really applied" not in verdict


def test_missing_linear_beta_decision_is_stated(tmp_path, caplog):
    import logging

    from kimi_k3_moe.activation import ActivationSpec
    from kimi_k3_moe.plugin_entrypoints.common import log_serving_once

    model = make_checkpoint(tmp_path / "m", activation_situ_linear_beta=None, **SHAPE)
    result = cli("doctor", "--model", model, "--config-only")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "activation: situv2(beta=4, linear_beta=None)" in result.stdout
    assert "no activation_situ_linear_beta in the config: the up half passes unchanged" in result.stdout
    with caplog.at_level(logging.INFO, logger="kimi_k3_moe"):
        log_serving_once(f"test-engine-{tmp_path.name}", "torch[mxfp4]", ActivationSpec.situv2(4.0, None))
    assert "activation situv2(beta=4, linear_beta=None) (no activation_situ_linear_beta in the config" \
        in caplog.text

"""The console commands, run as a user would: in a subprocess."""
import json
import subprocess
import sys

from kimi_k3_moe.weights.synthetic import make_checkpoint, synthetic_config


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kimi_k3_moe", *args], capture_output=True,
                          text=True, timeout=600, env=env)


def test_demo_prints_the_table_and_passes(tmp_path, seed):
    result = cli("demo", "--out", str(tmp_path), "--tokens", "1", "9", "--seed", str(seed))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "situv2(beta=4, linear_beta=25.0)" in out
    assert "rel. L2 vs float64" in out and "SiLU vs SiTUv2" in out
    assert "backend: torch" in out and "PASS" in out
    assert (tmp_path / "config.json").exists()


def test_doctor_reports_platform_and_backend():
    result = cli("doctor")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "torch" in result.stdout and "platform: cpu" in result.stdout
    assert "would serve with: torch[mxfp4]" in result.stdout


def test_doctor_with_a_servable_model(tmp_path, seed):
    make_checkpoint(tmp_path, seed=seed)
    result = cli("doctor", "--model", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "activation: situv2(beta=4, linear_beta=25.0)" in result.stdout


def test_doctor_refuses_unservable_models(tmp_path):
    cfg = synthetic_config(num_layers=2, hidden_size=256, routed_expert_hidden_size=128,
                           moe_intermediate_size=64, num_experts=8, num_experts_per_token=2,
                           num_shared_experts=1, first_k_dense_replace=1, hidden_act="gelu",
                           activation_situ_beta=None, activation_situ_linear_beta=None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result = cli("doctor", "--model", str(tmp_path))
    assert result.returncode == 1 and "CANNOT SERVE" in result.stdout and "'gelu'" in result.stdout

    k3 = synthetic_config(num_layers=93, hidden_size=7168, routed_expert_hidden_size=3584,
                          moe_intermediate_size=3072, num_experts=896, num_experts_per_token=16,
                          num_shared_experts=2, first_k_dense_replace=1, hidden_act="situ",
                          activation_situ_beta=4.0, activation_situ_linear_beta=25.0)
    (tmp_path / "config.json").write_text(json.dumps(k3))
    result = cli("doctor", "--model", str(tmp_path), "--tp", "8")
    assert result.returncode == 1
    assert "384 per rank at TP 8" in result.stdout
    assert "routed experts alone need" in result.stdout  # 1.4 TB does not fit a CPU box


def test_importing_the_package_pulls_in_no_engine_or_compiler():
    code = ("import sys, kimi_k3_moe, kimi_k3_moe.kernels, kimi_k3_moe.dispatch, kimi_k3_moe.cli, "
            "kimi_k3_moe.routed_experts, kimi_k3_moe.plugin_entrypoints;"
            "print(sorted(m for m in ('vllm', 'sglang', 'triton', 'flydsl') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr


def test_doctor_says_whether_vllm_would_load_the_plugin():
    import importlib.metadata as md
    import os

    installed = any(ep.name == "kimi_k3_moe" for ep in md.entry_points(group="vllm.general_plugins"))
    result = cli("doctor", env={**os.environ, "VLLM_PLUGINS": "other"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "engine plugins:" in result.stdout
    expected = "vllm    off: VLLM_PLUGINS='other' leaves kimi_k3_moe out" if installed \
        else "vllm    entry point not installed"
    assert expected in result.stdout


def test_the_cli_and_the_checkpoint_reader_fold_errors_to_one_line_the_same_way(monkeypatch, capsys):
    from kimi_k3_moe import doctor
    from kimi_k3_moe.cli import main
    from kimi_k3_moe.weights.checkpoint import one_line

    assert one_line(ValueError("safetensors said:\n  header\ttoo large ")) == "safetensors said: header too large"
    assert one_line(KeyError()) == "KeyError"  # an empty message still says something

    def raising(exc):
        def run(args):
            raise exc
        return run
    for exc, code, line in ((ValueError("bad\n   value"), 2, "kimi-k3-moe doctor: error: bad value\n"),
                            (TypeError(), 1, "kimi-k3-moe doctor: error: internal error TypeError: TypeError "
                                             "(rerun with --debug for the traceback)\n")):
        monkeypatch.setattr(doctor, "run", raising(exc))
        assert main(["doctor"]) == code
        assert capsys.readouterr().err == line


def test_the_demo_judges_quantized_activations_against_a_reference_that_quantizes_alike(monkeypatch, capsys,
                                                                                       tmp_path, seed):
    """fp8 activations cost ~0.046 against unquantized ones (docs/FORMATS.md), which the demo's bf16 bound (1e-2)
    failed; it now holds the output to that bound against a reference rounding the activations the same way, and
    shows the cost against unquantized activations (bound here 2^-4, the e4m3 estimate; measured 0.045-0.050 at
    16-64 tokens). A path that skips the quantization must still fail."""
    import re

    from kimi_k3_moe.cli import main
    from kimi_k3_moe.kernels.torch.backend import TorchBackend
    from kimi_k3_moe.reference import dense_moe

    monkeypatch.setenv("KIMI_K3_MOE_ACT_DTYPE", "fp8")
    argv = ["demo", "--out", str(tmp_path), "--tokens", "16", "64", "--seed", str(seed % 2**31)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("PASS: torch[mxfp4, a8 emulated]") and "the same activation quantization, fp8 e4m3" \
        in verdict and "fp8 cost" in out, out
    same = float(re.search(r"worst relative L2 (\S+) \(bound 0.01\)", verdict).group(1))
    cost = float(re.search(r"against unquantized activations (\S+),", verdict).group(1))
    assert same <= 1e-2 and 1e-2 < cost <= 2 ** -4, verdict  # quantized, and by no more than e4m3 costs

    def unquantized_forward(self, prepared, hidden, topk_weights, topk_ids, activation, expert_map=None):
        return dense_moe(hidden, lambda e: prepared.dequantize(e)[0], lambda e: prepared.dequantize(e)[1],
                         topk_weights, topk_ids, activation, expert_map, compute_dtype=self.compute_dtype)
    monkeypatch.setattr(TorchBackend, "forward", unquantized_forward)
    monkeypatch.setenv("KIMI_K3_MOE_SELF_CHECK", "off")  # else the load-time check refuses it first
    assert main(argv) == 1
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("FAIL: ") and "exceeds the bound 0.01" in verdict, verdict

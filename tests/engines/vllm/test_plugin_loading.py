"""vLLM's plugin loader finds and runs our entry point; VLLM_PLUGINS filters it; repeats are harmless."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_entry_point_is_declared_in_vllms_group():
    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("kimi_k3_moe") == "kimi_k3_moe.plugin_entrypoints.vllm:register"


def test_vllms_loader_runs_register(vllm_plugins_loaded):
    from vllm.model_executor.layers.quantization import get_quantization_config

    from kimi_k3_moe.plugin_entrypoints._vllm_method import K3Mxfp4Config

    assert get_quantization_config("mxfp4") is K3Mxfp4Config


def test_running_the_plugins_again_is_harmless(vllm_plugins_loaded, monkeypatch):
    """vLLM calls general plugins in every process, sometimes twice in one."""
    from vllm import plugins
    from vllm.model_executor.layers import quantization

    from kimi_k3_moe.plugin_entrypoints import vllm as entry
    from kimi_k3_moe.plugin_entrypoints._vllm_method import K3Mxfp4Config

    monkeypatch.setattr(plugins, "plugins_loaded", False)  # vLLM's own once-per-process flag
    plugins.load_general_plugins()
    entry.register()
    assert quantization.get_quantization_config("mxfp4") is K3Mxfp4Config
    assert quantization.QUANTIZATION_METHODS.count("mxfp4") == 1
    forwarders = [h for h in logging.getLogger("kimi_k3_moe").handlers
                  if isinstance(h, entry._ForwardToVllm)]
    assert len(forwarders) == 1


CHILD = """
import json, sys
from vllm.plugins import load_general_plugins
load_general_plugins()
from kimi_k3_moe.plugin_entrypoints import vllm as entry
entry.register()  # a direct call honours VLLM_PLUGINS too
from vllm.model_executor.layers.quantization import get_quantization_config
from vllm_k3 import make_vllm_config
config = make_vllm_config(sys.argv[1])
print("RESULT " + json.dumps({"registered": get_quantization_config("mxfp4").__name__,
                              "resolved": type(config.quant_config).__name__}))
"""


def test_vllm_plugins_naming_others_leaves_us_out(k3_checkpoint):
    """A fresh process (vLLM loads plugins once per process), as a worker started with the variable set."""
    env = {**os.environ, "VLLM_PLUGINS": "lora_filesystem_resolver",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", CHILD, str(k3_checkpoint)], env=env, capture_output=True,
                         text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result == {"registered": "Mxfp4Config", "resolved": "Mxfp4Config"}

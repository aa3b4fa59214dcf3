"""SGLang's own plugin loader finds our entry point (from the editable install),
SGLANG_PLUGINS filters it, loading twice is harmless, and the hook lands on the
real `Mxfp4Config.get_quant_method`.

`load_plugins()` runs once per process, so each scenario is a fresh interpreter.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

TARGET = "sglang.srt.layers.quantization.mxfp4.Mxfp4Config.get_quant_method"

PROBE = textwrap.dedent(f"""
    import json, logging, sys
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logging.getLogger("sglang.srt.plugins").addHandler(Keep())
    logging.getLogger("sglang.srt.plugins").setLevel(logging.INFO)
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    load_plugins()
    report = dict(ours_imported="kimi_k3_moe.plugin_entrypoints.sglang" in sys.modules,
                  hooks=len(HookRegistry._hooks.get("{TARGET}", [])),
                  patched="{TARGET}" in HookRegistry._patched)
    if report["ours_imported"]:
        from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config
        from kimi_k3_moe.plugin_entrypoints import sglang as plugin
        def wrap_depth(fn):
            depth = 0
            while hasattr(fn, "__wrapped__"):
                fn, depth = fn.__wrapped__, depth + 1
            return depth, fn.__qualname__
        report["before_reload"] = wrap_depth(Mxfp4Config.get_quant_method)
        load_plugins(); plugin.register(); HookRegistry.apply_hooks()   # again, three ways
        report["after_reload"] = wrap_depth(Mxfp4Config.get_quant_method)
        report["hooks_after_reload"] = len(HookRegistry._hooks["{TARGET}"])
        hook_type, hook, source = HookRegistry._hooks["{TARGET}"][0]
        report["hook"] = [hook_type.value, hook is plugin.around_get_quant_method, source.plugin_name]
    report["log"] = [m for m in records if "plugin" in m.lower()]
    print("REPORT" + json.dumps(report))
""")


def run_loader(plugins: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS", "SGLANG_USE_CPU_ENGINE")}
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("REPORT"))
    return json.loads(line[len("REPORT"):])


def test_loader_finds_runs_and_hooks_the_real_class():
    report = run_loader(None)
    log = "\n".join(report["log"])
    assert "kimi_k3_moe -> kimi_k3_moe.plugin_entrypoints.sglang:register" in log
    assert "Executed general plugin: kimi_k3_moe" in log
    assert "smg-servicer" in log  # SGLang's own dependency registers plugins in the same group
    assert report["ours_imported"] and report["patched"] and report["hooks"] == 1
    assert report["before_reload"] == [1, "Mxfp4Config.get_quant_method"]
    # Loading again (SGLang's loader, our register(), apply_hooks()) changes nothing.
    assert report["after_reload"] == report["before_reload"] and report["hooks_after_reload"] == 1
    assert report["hook"] == ["around", True, "kimi_k3_moe"]


def test_sglang_plugins_without_ours_leaves_sglang_alone():
    report = run_loader("smg-servicer,smg-zmq")  # how a user turns the plugin off, keeping the others
    assert not report["ours_imported"] and report["hooks"] == 0 and not report["patched"]
    assert "Skipping plugin kimi_k3_moe (not in SGLANG_PLUGINS)" in "\n".join(report["log"])


def test_sglang_plugins_listing_ours_loads_it():
    report = run_loader(" smg-servicer , kimi_k3_moe ")
    log = "\n".join(report["log"])
    assert report["ours_imported"] and report["patched"] and report["hooks"] == 1
    assert "Skipping plugin smg-zmq (not in SGLANG_PLUGINS)" in log


def test_register_respects_sglang_plugins_when_called_directly(monkeypatch):
    """A direct call (not through SGLang's loader) honours the same filter."""
    from kimi_k3_moe.plugin_entrypoints import sglang as plugin

    monkeypatch.setenv("SGLANG_PLUGINS", "smg-servicer")
    monkeypatch.setattr(plugin, "_registered", False)
    registered = []
    monkeypatch.setattr("sglang.srt.plugins.hook_registry.HookRegistry.register",
                        lambda *args, **kwargs: registered.append(args))
    plugin.register()
    assert registered == [] and plugin._registered is False


def test_entry_point_imports_lazily():
    """Every SGLang process (launcher, detokenizer, ...) imports the entry point: it pulls in
    no sglang module, and register() none of SGLang's model or MoE code."""
    code = textwrap.dedent("""
        import sys
        import kimi_k3_moe.plugin_entrypoints.sglang as plugin
        at_import = sorted(m for m in sys.modules if m.split(".")[0] == "sglang")
        plugin.register()
        heavy = sorted(m for m in sys.modules if m.startswith(("sglang.srt.layers", "sglang.srt.models")))
        print(at_import, heavy)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[] []"

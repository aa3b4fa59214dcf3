"""gfx950: the engine's own hardware-tuned Kimi-K3 path keeps the layers unless a measurement on this
GPU found ours faster, or $KIMI_K3_MOE_BACKEND forces ours (dispatch.engine_keeps_layer)."""
from __future__ import annotations

import pytest

from kimi_k3_moe import __version__
from kimi_k3_moe.bench.verdict import SERVED, record_verdicts
from kimi_k3_moe.configs import engine_verdicts
from kimi_k3_moe.dispatch import engine_keeps_layer
from kimi_k3_moe.platform import Platform

MI355X = Platform("rocm", "gfx950", "AMD Instinct MI355X")
ME = {"name": "AMD Instinct MI355X", "key": "amd_instinct_mi355x", "arch": "gfx950", "driver": "hip 7.1"}
KEY = engine_verdicts.shape_key(3584, 384, 896, 16)
AITER = lambda: "vLLM's aiter a16w4 MoE (aiter test)"  # noqa: E731


@pytest.fixture
def env(tmp_path):
    return {"KIMI_K3_MOE_TABLES": str(tmp_path)}


def keeps(env, platform=MI355X, path=AITER, identity=ME):
    return engine_keeps_layer(platform, path, KEY, identity=identity, env=env)


@pytest.mark.parametrize("platform", [Platform("rocm", "gfx942"), Platform("cuda", "sm_90"), Platform("cpu")])
def test_ours_serves_wherever_the_engine_has_no_tuned_k3_path(env, platform):
    asked = []
    assert keeps(env, platform, path=lambda: asked.append(1) or "x") is None
    assert not asked    # aiter is not even looked for off gfx950


def test_gfx950_without_aiters_situ_path_gets_ours(env):
    assert keeps(env, path=lambda: None) is None


def test_gfx950_with_the_engine_path_and_no_measurement_keeps_the_engines(env):
    reason = keeps(env)
    assert "aiter a16w4" in reason and "KIMI_K3_MOE_BACKEND=flydsl" in reason and "no measurement" in reason
    assert "\n" not in reason


def test_a_forced_backend_serves_ours(env):
    assert keeps({**env, "KIMI_K3_MOE_BACKEND": "flydsl"}) is None


def _result(ours_us, engine_us, engine_available=True):
    rows = [{"tokens": t, "results": {SERVED: {"status": "ok", "median_us": o},
                                      "aiter": {"status": "ok", "median_us": e}}}
            for t, o, e in zip((1, 16, 1024), ours_us, engine_us)]
    return {"shape": {"hidden": 3584, "inter": 384, "num_experts": 896, "local_experts": None, "topk": 16},
            "entries": {SERVED: {"role": "ours", "available": True},
                        "aiter": {"role": "engine", "available": engine_available}}, "rows": rows}


def test_ours_serves_only_where_this_gpu_measured_it_faster_at_every_count(env):
    assert record_verdicts(_result([20, 90, 400], [26, 100, 407]), ME, env)
    assert keeps(env) is None
    assert record_verdicts(_result([20, 120, 400], [26, 100, 407]), ME, env)   # slower at 16 tokens
    assert "ours not faster at every count" in keeps(env)


def test_a_measurement_serves_only_on_the_device_and_version_that_made_it(env, tmp_path):
    record_verdicts(_result([20, 90, 400], [26, 100, 407]), ME, env)
    other = {**ME, "driver": "hip 7.2"}
    assert "another device" in keeps(env, identity=other)
    path = engine_verdicts.verdict_path(ME["key"], env)
    path.write_text(path.read_text().replace(f'"{__version__}"', '"0.0.1"'))
    assert "0.0.1" in keeps(env)
    path.write_text("{not json")
    assert "absent or unreadable" in keeps(env)


def test_nothing_is_recorded_without_both_paths_timed_at_every_count(env):
    assert record_verdicts(_result([20, 90, 400], [26, 100, 407], engine_available=False), ME, env) == []
    partial = _result([20, 90, 400], [26, 100, 407])
    partial["rows"][1]["results"]["aiter"] = {"status": "failed", "why": "rel L2 too large"}
    assert record_verdicts(partial, ME, env) == []
    assert "no measurement" in keeps(env)

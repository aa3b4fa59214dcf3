"""`kimi-k3-moe tune` when its backend target cannot be built: the backend's own "cannot run here" errors
are a one-line usage answer (exit 2); anything else is a bug, reported as the CLI reports every internal
error (exit 1). The GPU check and the GPU data are stubbed (no GPU here): this tests only the mapping."""
import pytest

from kimi_k3_moe.bench import shapes
from kimi_k3_moe.cli import main
from kimi_k3_moe.kernels.base import BackendUnavailable
from kimi_k3_moe.tune import command


@pytest.fixture
def builder(monkeypatch):
    monkeypatch.setattr(shapes, "require_gpu", lambda why: None)
    monkeypatch.setattr(command, "random_layer", lambda shape, seed: None)

    def raising(exc):
        def make_target(*args):
            raise exc
        monkeypatch.setattr(command, "make_target", make_target)
    return raising


@pytest.mark.parametrize("exc", [RuntimeError("no ROCm ld.lld found"), BackendUnavailable("triton is not installed"),
                                 ValueError("I 100 is not a multiple of 32"), ImportError("No module named 'flydsl'")])
def test_a_backend_that_cannot_run_here_is_a_one_line_usage_error(builder, capsys, exc):
    builder(exc)
    assert main(["tune", "--backend", "flydsl", "--shape", "tiny"]) == 2
    assert capsys.readouterr().err == f"kimi-k3-moe tune: error: the flydsl backend cannot be tuned here: {exc}\n"


@pytest.mark.parametrize("exc", [TypeError("__init__() got an unexpected keyword argument 'tiers'"),
                                 AttributeError("'NoneType' object has no attribute 'device'"), KeyError("arch")])
def test_a_bug_while_building_the_target_is_an_internal_error(builder, capsys, exc):
    builder(exc)
    assert main(["tune", "--backend", "triton", "--shape", "tiny"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kimi-k3-moe tune: error: internal error {type(exc).__name__}: ") and err.count("\n") == 1
    assert "cannot be tuned here" not in err and "--debug" in err
    with pytest.raises(type(exc)):
        main(["tune", "--debug", "--backend", "triton", "--shape", "tiny"])


def test_routing_takes_a_comma_list_of_distinct_routings():
    import argparse

    from kimi_k3_moe.bench.routing import routings_arg
    assert [str(r) for r in routings_arg("uniform,skewed:2")] == ["uniform", "skewed:2"]
    for bad in ("uniform,uniform", "uniform,skewed:0", "uniform,"):
        with pytest.raises(argparse.ArgumentTypeError, match="--routing"):
            routings_arg(bad)

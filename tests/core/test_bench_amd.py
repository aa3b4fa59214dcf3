"""`kimi-k3-moe bench` on ROCm, without an AMD GPU: the default token counts cover every prefill chunk
size of the large-batch tiers (2048-16384), so ours and aiter's fused_moe are timed side by side there;
elsewhere the defaults stay. torch.version.hip is patched: the test says so, nothing runs on a GPU."""
import torch

from kimi_k3_moe.bench import command


def test_rocm_defaults_add_the_prefill_sizes(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)   # FAKED: a ROCm build of torch
    rocm = [int(t) for t in command.default_tokens().split(",")]
    assert {2048, 4096, 8192, 16384} <= set(rocm) and rocm == sorted(rocm)
    assert command.default_ours()[0] == "flydsl"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert command.default_tokens() == command.DEFAULT_TOKENS


def test_an_explicit_token_list_wins(monkeypatch):
    import argparse
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert parser.parse_args([]).tokens is None
    assert parser.parse_args(["--tokens", "2048,8192"]).tokens == "2048,8192"

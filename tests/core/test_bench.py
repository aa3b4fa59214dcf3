"""`kimi-k3-moe bench` on the CPU: the row runner, its checks, the table and the JSON.

The GPU timer is replaced by a fake clock (no GPU here). The engines' peers
cannot run on a CPU; their adapters must say so instead of failing. Nothing
here fakes aiter or Humming: the test peers below are plain functions of this
file, named as such.
"""
from __future__ import annotations

import json

import pytest
import torch

from kimi_k3_moe.activation import ActivationSpec
from kimi_k3_moe.bench import report
from kimi_k3_moe.bench.peers import OTHER, Peer, Runner, make_ours, make_peer
from kimi_k3_moe.bench.peers.align import align_block_size
from kimi_k3_moe.bench.peers.humming import humming_activation
from kimi_k3_moe.bench.runner import run_bench
from kimi_k3_moe.bench.shapes import NAMED, parse_shape
from kimi_k3_moe.bench.timing import FakeClock
from kimi_k3_moe.reference import moe_forward

SITU = ActivationSpec.situv2(4.0, 25.0)


class SiluPeer(Peer):
    """A peer that ignores the requested activation (runs SiLU): must be reported wrong, not timed."""

    name, role, label = "silu_peer", OTHER, "test peer computing SiLU"

    def probe(self):
        return True, "test"

    def build(self, experts, activation, shape, expert_map):
        silu = ActivationSpec.silu()
        return Runner(run=lambda h, routed: moe_forward(h, *experts.tensors(), *routed, silu),
                      activation=activation)


class AbsentPeer(Peer):
    name, role, label = "absent", OTHER, "not installed"

    def probe(self):
        return False, "engine path: not available (not installed)"

    def build(self, *a):
        raise AssertionError("never built")


def test_rows_are_checked_then_timed_and_reported(seed, tmp_path):
    clock = FakeClock(lambda label: 10.0)
    peers = [make_ours("torch"), SiluPeer(), AbsentPeer(), make_peer("aiter"), make_peer("humming")]
    result = run_bench(peers, NAMED["tiny"], [1, 7], SITU, clock, device="cpu", seed=seed,
                       ceilings={"copy_GBps": 100.0, "bf16_TFLOPs": 1.0})
    assert [r["tokens"] for r in result["rows"]] == [1, 7]
    for row in result["rows"]:
        ours = row["results"]["ours_torch_mxfp4"]
        assert ours["status"] == "ok" and ours["rel_l2"] < 1e-2 and ours["median_us"] == 10.0
        assert ours["x_floor"] == 10.0 / row["floor_us"] and ours["x_best_other"] is None
        wrong = row["results"]["silu_peer"]
        assert wrong["status"] == "wrong" and "median_us" not in wrong and "SiLU" in wrong["why"]
        assert "absent" not in row["results"] and "aiter" not in row["results"]
    for name in ("aiter", "humming", "absent"):
        assert not result["entries"][name]["available"]
        assert result["entries"][name]["found"].startswith("engine path: not available (")
    lines = report.table_rows(result)
    assert lines[0][:2] == ("1", "floor") and lines[1][1] == "ours_torch_mxfp4" and lines[1][2] == "10.0"
    assert lines[2][1:3] == ("silu_peer", "WRONG")
    assert len(lines) == 6 and all(len(line) == len(report.COLUMNS) for line in lines)
    path = report.write_json(tmp_path / "r.json", dict(result, info={"device": {"name": "cpu"}}))
    back = json.loads(path.read_text())
    assert set(back) >= {"shape", "activation", "timing", "ceilings", "entries", "rows", "info", "seed"}
    assert "fake clock" in back["timing"]
    report.render(back)


def _check_alignment(ids, block, num_experts):
    """align_block_size's contract: every pair with an id >= 0 in exactly one block of its expert,
    padding (and pairs of other ranks, id < 0) as the sentinel T*K, whole blocks."""
    sorted_ids, expert_ids, padded = align_block_size(ids, block, num_experts)
    flat = ids.reshape(-1).tolist()
    n, total = len(flat), int(padded)
    assert total % block == 0
    assert sorted(x for x in sorted_ids[:total].tolist() if x != n) == [i for i, e in enumerate(flat) if e >= 0]
    for b in range(total // block):
        rows = [x for x in sorted_ids[b * block:(b + 1) * block].tolist() if x != n]
        assert rows and all(flat[x] == int(expert_ids[b]) for x in rows)
    assert all(x == n for x in sorted_ids[total:].tolist())


def test_alignment_matches_its_contract(gen):
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(11)]).int()
    _check_alignment(ids, 4, 8)


def test_alignment_skips_other_ranks_pairs(gen):
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(11)]).int()
    _check_alignment(torch.where(ids < 5, ids, -1), 4, 5)  # experts 5..7 live on another rank


def test_humming_activation_snippet_carries_the_betas_and_differs_from_silu():
    situ = humming_activation(SITU)
    silu = humming_activation(ActivationSpec.silu())
    assert situ["activation_type"] == silu["activation_type"] == "binary_split"
    assert "(4.0f)" in situ["activation_impl"] and "(25.0f)" in situ["activation_impl"]
    assert situ["activation_impl"] != silu["activation_impl"]
    no_linear = humming_activation(ActivationSpec.situv2(2.0, None))["activation_impl"]
    assert "(2.0f)" in no_linear and "const float u = b;" in no_linear


def test_shapes_parse_and_refuse_with_a_message():
    assert parse_shape("tp16").inter == 192 and parse_shape("ep16").is_ep
    assert parse_shape("3584,384,896,16").num_experts == 896
    for bad, words in (("3584,384", "H,I,E,K"), ("3584,383,896,16", "multiples"), ("256,64,8,9", "top-k")):
        try:
            parse_shape(bad)
        except ValueError as exc:
            assert words in str(exc)
        else:
            raise AssertionError(bad)


def test_expert_parallel_rows_sum_only_the_rank_s_experts(seed):
    from kimi_k3_moe.bench.shapes import Shape
    shape = Shape("tiny_ep", 256, 64, 8, topk=2, local_experts=4)
    result = run_bench([make_ours("torch"), make_peer("torch")], shape, [5], SITU, FakeClock(lambda label: 1.0),
                       device="cpu", seed=seed, ceilings={"copy_GBps": 100.0, "bf16_TFLOPs": 1.0})
    row = result["rows"][0]
    assert row["results"]["ours_torch_mxfp4"]["status"] == "ok"
    assert row["distinct_experts"] <= 4


def test_commands_refuse_bad_input_and_a_missing_gpu_with_one_line(capsys):
    from kimi_k3_moe.cli import main
    assert main(["bench", "--shape", "3584,384"]) == 2
    assert "H,I,E,K" in capsys.readouterr().err
    assert main(["bench", "--tokens", "1,x"]) == 2
    assert "--tokens" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--shape", "tiny"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no GPU" in err
        assert main(["tune", "--backend", "triton", "--shape", "tiny"]) == 2
        assert "no GPU" in capsys.readouterr().err


def test_bench_and_tune_numbers_are_range_checked_before_any_gpu_work(capsys):
    from kimi_k3_moe.cli import main
    for argv, words in ((["bench", "--reps", "0"], "argument --reps: 0 is not a positive integer"),
                        (["bench", "--tp", "0", "--model", "m"], "argument --tp: 0 is not a positive integer"),
                        (["bench", "--seed", "-1"], "argument --seed: -1 is not a non-negative integer"),
                        (["bench", "--tokens", "0,4"], "--tokens '0,4': every value must be in [1, "),
                        (["bench", "--shape", "0,32,8,2"], "H, I and E must be positive"),
                        (["tune", "--reps", "0"], "argument --reps"),
                        (["tune", "--tp", "-8"], "argument --tp"),
                        (["tune", "--budget-min", "nan"], "argument --budget-min: nan is not a positive finite"),
                        (["tune", "--budget-min", "0"], "argument --budget-min"),
                        (["tune", "--tiers", "16,-4"], "--tiers '16,-4': every value must be in [1, "),
                        (["tune", "--tiers", "1,x"], "--tiers '1,x': expected a comma list of integers"),
                        (["tune", "--format", "fp8"], "argument --format: invalid choice: 'fp8'")):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and words in err, (argv, err)
        assert err.startswith(f"kimi-k3-moe {argv[0]}: error: "), err


def test_a_typo_in_ours_is_a_usage_error_not_a_row_saying_not_available(capsys):
    from kimi_k3_moe.cli import main
    for bad in ("trtion", "triton:fp3", "torch:mxfp4:fp9", "torch:mxfp4:fp8:x"):
        try:
            make_ours(bad)
        except ValueError as exc:
            assert f"--ours {bad!r}" in str(exc) and "flydsl, triton, torch" in str(exc)
        else:
            raise AssertionError(bad)
    assert make_ours("torch:int4:fp8").probe()[0]
    assert main(["bench", "--shape", "tiny", "--ours", "torch,trtion"]) == 2
    assert "--ours 'trtion'" in capsys.readouterr().err


def test_a_non_finite_reference_never_passes(gen):
    from kimi_k3_moe.bench.check import judge
    out = torch.randn(4, 8, generator=gen)
    ref = out.clone()
    ref[1, 2] = float("nan")  # rel L2 is NaN, and NaN > bound is False: this passed
    verdict = judge(out, ref)
    assert not verdict.ok and "rel L2 nan" in verdict.why
    assert judge(out, out.clone()).ok


def test_an_unwritable_json_path_is_refused_before_any_gpu_work(tmp_path, capsys, monkeypatch):
    from kimi_k3_moe.bench import shapes
    from kimi_k3_moe.cli import main

    def no_gpu_work(why):
        raise AssertionError("reached the GPU check before refusing --json")
    monkeypatch.setattr(shapes, "require_gpu", no_gpu_work)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for bad, why in ((a_file / "sub" / "out.json", f"{a_file} is a file, not a folder"),
                     (tmp_path, "Is a directory")):
        assert main(["bench", "--shape", "tiny", "--json", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err == f"kimi-k3-moe bench: error: --json {bad} cannot be written: {why}\n", err
    good = tmp_path / "new" / "r.json"
    assert report.require_writable(good) == good and not good.exists() and good.parent.is_dir()
    assert a_file.read_text() == "x" and report.require_writable(a_file) == a_file and a_file.read_text() == "x"


def test_ep_routing_gives_the_rank_its_share(gen):
    """EP16 bench rows: the rank holding 56 of 896 experts gets about T*K/16 pairs and never none
    (a draw with none would time an empty MoE and cannot tell SiLU from SiTUv2)."""
    from kimi_k3_moe.bench.data import random_routing
    for tokens in (1, 4, 64):
        for _ in range(20):
            weights, ids = random_routing(tokens, 896, 16, "cpu", gen, held=56)
            local = int((ids < 56).sum())
            assert 1 <= local and abs(local - tokens) <= max(1.0, (tokens * 15 / 16) ** 0.5)
            assert torch.allclose(weights.sum(1), torch.ones(tokens))


def test_routing_choices_parse_and_refuse_with_one_line(tmp_path, capsys):
    from kimi_k3_moe.bench.routing import Routing, parse_routing
    from kimi_k3_moe.cli import main
    assert parse_routing("uniform") == Routing() and str(parse_routing("skewed")) == "skewed:1"
    assert parse_routing("skewed:0.5").sigma == 0.5
    for bad in ("skewed:x", "skewed:-1", "zipf", "file:", f"file:{tmp_path}/none.pt"):
        try:
            code = main(["bench", "--routing", bad])
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2
        assert err.count("\n") == 1 and "--routing" in err, err


def test_skewed_routing_favours_the_same_experts_in_every_batch(gen):
    from kimi_k3_moe.bench.data import RoutingSource
    from kimi_k3_moe.bench.routing import Routing
    uniform = RoutingSource(Routing(), 896, 16, "cpu", gen)
    skewed = RoutingSource(Routing("skewed", 1.0), 896, 16, "cpu", gen)
    distinct = {name: torch.unique(src(256)[1]).numel() for name, src in (("u", uniform), ("s", skewed))}
    assert distinct["s"] < 0.85 * distinct["u"], distinct          # fewer experts take the pairs
    first, again = skewed(512)[1], skewed(512)[1]
    popular = torch.bincount(first.flatten().long(), minlength=896).topk(50).indices
    counts = torch.bincount(again.flatten().long(), minlength=896)
    assert counts[popular].float().mean() > 2 * counts.float().mean()   # the same ones, batch after batch
    w, ids = skewed(7)
    assert ids.dtype == torch.int32 and all(len(set(r)) == 16 for r in ids.tolist())
    assert torch.allclose(w.sum(1), torch.ones(7)) and bool((w > 0).all())


@pytest.mark.parametrize("suffix", [".pt", ".npy"])
def test_recorded_routing_replays_a_routers_ids_and_is_recorded_in_the_result(tmp_path, seed, suffix, gen):
    import numpy as np

    from kimi_k3_moe.bench.routing import parse_routing
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(5)])     # the tiny shape: 8 experts
    path = tmp_path / f"ids{suffix}"
    torch.save(ids, path) if suffix == ".pt" else np.save(path, ids.numpy())
    routing = parse_routing(f"file:{path}")
    result = run_bench([make_ours("torch")], NAMED["tiny"], [3, 7], SITU, FakeClock(lambda label: 1.0),
                       device="cpu", seed=seed, ceilings={"copy_GBps": 100.0, "bf16_TFLOPs": 1.0}, routing=routing)
    assert result["routing"] == f"file:{path}"
    assert result["rows"][0]["distinct_experts"] == torch.unique(ids[:3]).numel()
    assert all(r["results"]["ours_torch_mxfp4"]["status"] == "ok" for r in result["rows"])
    from kimi_k3_moe.bench.data import RoutingSource
    for bad in (torch.zeros(5, 3, dtype=torch.int64), torch.full((5, 2), 8), torch.rand(5, 2)):
        torch.save(bad, tmp_path / "bad.pt")
        with pytest.raises(ValueError, match="--routing file:.*bad.pt"):
            RoutingSource(parse_routing(f"file:{tmp_path}/bad.pt"), 8, 2, "cpu", gen)

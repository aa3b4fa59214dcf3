"""Two ranks on the CPU (two processes, gloo): tensor parallelism and expert parallelism.

Each rank builds vLLM's K3 block from the same checkpoint, loads its share
through vLLM's loader, and runs the same tokens through vLLM's runner, which
all-reduces the latent routed partials (the sharded up-projection tail of
LatentMoERunner and ROCmLatentMoERunner at TP 2). Modes: "tp" (CUDA/CPU
variant of K3's block, TP 2), "ep" (the same with expert parallelism),
"amd-tp" (the ROCm variant, TP 2). In "tp" the tiny model's 32 intermediate
rows per rank are padded by K3 to 256: the test also checks that padding.
"""
from __future__ import annotations

import pytest
import torch
from moe_helpers import SITU

from kimi_k3_moe.activation import ActivationSpec

SILU = ActivationSpec.silu()


@pytest.fixture(scope="module")
def two_ranks(k3_checkpoint, tmp_path_factory, session_seed):
    """{rank: {mode: ...}} from two spawned ranks (see vllm_k3.two_rank_worker)."""
    import torch.multiprocessing as mp
    import vllm_k3 as k3

    out_dir = tmp_path_factory.mktemp("ranks")
    ctx = mp.get_context("spawn")
    port = k3.free_port()
    procs = [ctx.Process(target=k3.two_rank_worker, args=(rank, port, str(k3_checkpoint), str(out_dir),
                                                          session_seed))
             for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=540)
    failures = [(out_dir / f"rank{r}.err").read_text() for r in range(2) if (out_dir / f"rank{r}.err").exists()]
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return {r: torch.load(out_dir / f"rank{r}.pt") for r in range(2)}


def _full(k3_checkpoint, call, activation):
    import vllm_k3 as k3

    return k3.routed_reference(k3.reference_experts(k3_checkpoint), call["x"], call["topk_weights"],
                               call["topk_ids"], activation)


MODES = ["tp", "ep", "amd-tp"]


@pytest.mark.parametrize("mode", MODES)
def test_partials_sum_to_the_single_rank_result(two_ranks, k3_checkpoint, mode):
    import vllm_k3 as k3

    from kimi_k3_moe.dispatch import BackendChoice
    from kimi_k3_moe.platform import Platform
    from kimi_k3_moe.routed_experts import RoutedExperts

    a, b = two_ranks[0][mode]["call"], two_ranks[1][mode]["call"]
    assert torch.equal(a["x"], b["x"]) and torch.equal(a["topk_ids"], b["topk_ids"])  # replicated tokens
    total = a["out"].double() + b["out"].double()
    single = RoutedExperts(SITU, platform=Platform("cpu"), plan=[BackendChoice("torch", {"weight_format": "mxfp4"})])
    single.load(k3.reference_experts(k3_checkpoint))
    single_out = single(a["x"], a["topk_weights"], a["topk_ids"])
    assert k3.rel_l2(total, single_out) <= 1e-2
    assert k3.rel_l2(total, _full(k3_checkpoint, a, SITU)) <= 1e-2
    assert k3.rel_l2(total, _full(k3_checkpoint, a, SILU)) > 5e-2
    assert k3.rel_l2(a["out"], single_out) > 0.1  # a partial alone is not the answer


@pytest.mark.parametrize("mode", MODES)
def test_block_output_after_vllms_all_reduce(two_ranks, k3_checkpoint, session_seed, mode):
    import vllm_k3 as k3

    x = k3.two_rank_tokens(session_seed)
    eps = two_ranks[0]["eps"]
    out0, out1 = two_ranks[0][mode]["out"], two_ranks[1][mode]["out"]
    assert torch.equal(out0, out1)
    ids = two_ranks[0][mode]["call"]["topk_ids"]  # what vLLM's router picked (ties: see block_reference)
    assert k3.rel_l2(out0, k3.block_reference(k3_checkpoint, x, SITU, SITU, eps, engine_ids=ids)) <= 1e-2
    assert k3.rel_l2(out0, k3.block_reference(k3_checkpoint, x, SILU, SITU, eps, engine_ids=ids)) > 5e-2


def test_tp_split_and_padding(two_ranks, k3_checkpoint):
    """vLLM narrowed I per rank and padded it to 256 with zeros; the prepared layer dropped the
    padding, so the MXFP4 parameters were released."""
    import vllm_k3 as k3

    i = k3.INTER // 2
    for rank in range(2):
        tp = two_ranks[rank]["tp"]
        assert tp["intermediate_per_partition"] == 256 and tp["unpadded"] == i
        mine = k3.reference_experts(k3_checkpoint, tp_rank=rank, tp_size=2)
        w13, w13_scale, w2, w2_scale = tp["loaded"]
        assert torch.equal(w13[:, :i], mine.w13_packed[:, :i])
        assert torch.equal(w13[:, 256:256 + i], mine.w13_packed[:, i:])
        assert torch.equal(w13_scale[:, :i], mine.w13_scale[:, :i])
        assert torch.equal(w2[:, :, :i // 2], mine.w2_packed) and torch.equal(w2_scale[:, :, :i // 32], mine.w2_scale)
        for t in (w13[:, i:256], w13[:, 256 + i:], w13_scale[:, i:256], w2[:, :, i // 2:], w2_scale[:, :, i // 32:]):
            assert not t.any()
        assert tp["prepared_intermediate"] == i and tp["released"]


def test_ep_maps_and_local_experts(two_ranks):
    half = 4
    maps = [two_ranks[r]["ep"]["call"]["expert_map"].tolist() for r in range(2)]
    assert maps == [list(range(half)) + [-1] * half, [-1] * half + list(range(half))]
    assert all(two_ranks[r]["ep"]["local_experts"] == half for r in range(2))

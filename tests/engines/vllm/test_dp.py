"""vLLM data parallelism with the plugin: two DP ranks (spawned, gloo), each with its own batch.

Modes (dp_ranks.py builds and runs them; it says what stands in and why):
- "dp-ep": DP 2 + --enable-expert-parallel, default all2all backend
  (allgather_reducescatter): vLLM's naive DP/EP prepare/finalize around the
  plugin's experts, 4 of 8 experts per rank.
- "dp": DP 2 without EP, the LatentMoERunner tail that is correct
  (the shared-experts stream on, every batch under its threshold).
- "dp-tail": DP 2 without EP through `_shard_up_proj_tail` (the tail every CPU
  batch and every GPU batch above VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD
  takes), with the plugin's refusal left out: it settles the suspected vLLM
  bug. The plugin refuses this setup at build ("refusal").
- "dp-tp-ep": DP 2 x TP 2 + --enable-expert-parallel (four processes, about
  3 minutes on two cores): K3 switches to sequence parallelism, each TP rank's
  MoE input is its slice of its DP rank's tokens, the EP group spans all four
  ranks (2 of 8 experts each) and the naive DP/EP prepare/finalize gathers
  the slices of all four.
Every rank's output is compared with the float64 block on that rank's tokens.
Not run here: any real all-to-all library (DeepEP, MoRI: GPU only;
test_modular_kernel.py checks their layouts with a stand-in).
"""
from __future__ import annotations

import pytest
import torch
from moe_helpers import SITU

from kimi_k3_moe.activation import ActivationSpec

SILU = ActivationSpec.silu()


def _spawn(worker, ranks: int, k3_checkpoint, out_dir, seed) -> dict:
    import torch.multiprocessing as mp
    import vllm_k3 as k3

    ctx = mp.get_context("spawn")
    port = k3.free_port()
    procs = [ctx.Process(target=worker, args=(rank, port, str(k3_checkpoint), str(out_dir), seed))
             for rank in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=540)
    failures = [(out_dir / f"rank{r}.err").read_text() for r in range(ranks) if (out_dir / f"rank{r}.err").exists()]
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return {r: torch.load(out_dir / f"rank{r}.pt") for r in range(ranks)}


@pytest.fixture(scope="module")
def dp_ranks(k3_checkpoint, tmp_path_factory, session_seed):
    import dp_ranks as dp

    return _spawn(dp.dp_rank_worker, dp.DP, k3_checkpoint, tmp_path_factory.mktemp("dp"), session_seed)


def _eps(k3_checkpoint):
    import vllm_k3 as k3

    return k3.make_vllm_config(k3_checkpoint).model_config.hf_text_config.rms_norm_eps


@pytest.mark.parametrize("mode", ["dp-ep", "dp"])
def test_each_dp_rank_matches_the_reference(dp_ranks, k3_checkpoint, mode):
    import vllm_k3 as k3

    eps = _eps(k3_checkpoint)
    for result in dp_ranks.values():
        got = result[mode]
        assert got["prepare_finalize"] == "MoEPrepareAndFinalizeNaiveDPEPModular"
        assert got["experts"] == "K3ModularExperts" and not got["naive"]
        assert got["local_experts"] == (k3.EXPERTS // 2 if mode == "dp-ep" else k3.EXPERTS)
        x, ids = result["x"], got["ids"]
        assert got["out"].shape == x.shape
        assert k3.rel_l2(got["out"], k3.block_reference(k3_checkpoint, x, SITU, SITU, eps, engine_ids=ids)) <= 1e-2
        assert k3.rel_l2(got["out"], k3.block_reference(k3_checkpoint, x, SILU, SITU, eps, engine_ids=ids)) > 5e-2


def test_latent_tail_bug_under_dp_without_ep(dp_ranks, k3_checkpoint):
    """vLLM 0.33's `_shard_up_proj_tail` under DP 2, TP 1, no EP: the MoE TP size is 2 (flattened over DP),
    the attention TP rank is 0 on both ranks, so only the first half of the hidden columns gets the
    routed output; the second half holds the shared experts' output alone."""
    import vllm_k3 as k3

    eps, half = _eps(k3_checkpoint), k3.HIDDEN // 2
    for result in dp_ranks.values():
        out, x = result["dp-tail"]["out"], result["x"]
        routed, shared = k3.block_reference_parts(k3_checkpoint, x, SITU, SITU, eps,
                                                  engine_ids=result["dp-tail"]["ids"])
        assert k3.rel_l2(out[:, :half], (routed + shared)[:, :half]) <= 1e-2
        assert k3.rel_l2(out[:, half:], shared[:, half:]) <= 1e-2
        assert k3.rel_l2(out[:, half:], (routed + shared)[:, half:]) > 0.1


def test_dp_without_ep_is_refused_at_build(dp_ranks):
    for result in dp_ranks.values():
        message = result["refusal"]
        assert "\n" not in message and "LatentMoERunner._shard_up_proj_tail" in message
        assert "--enable-expert-parallel" in message


def test_dp2_x_tp2_with_ep_matches_the_reference(k3_checkpoint, tmp_path_factory, session_seed):
    """Each of the four ranks (DP rank r // 2, TP rank r % 2) gets the block's output for its own slice."""
    import dp_ranks as dp
    import vllm_k3 as k3

    ranks = _spawn(dp.dp_tp_rank_worker, dp.DP * dp.TP, k3_checkpoint, tmp_path_factory.mktemp("dp_tp"),
                   session_seed)
    eps = _eps(k3_checkpoint)
    for rank, got in ranks.items():
        assert got["prepare_finalize"] == "MoEPrepareAndFinalizeNaiveDPEPModular"
        assert got["experts"] == "K3ModularExperts" and not got["naive"]
        assert got["local_experts"] == k3.EXPERTS // (dp.DP * dp.TP)
        x, ids = got["x"], got["ids"]
        assert x.shape[0] == dp.SIZES_TP[rank // dp.TP] // dp.TP and got["out"].shape == x.shape
        assert k3.rel_l2(got["out"], k3.block_reference(k3_checkpoint, x, SITU, SITU, eps, engine_ids=ids)) <= 1e-2
        assert k3.rel_l2(got["out"], k3.block_reference(k3_checkpoint, x, SILU, SITU, eps, engine_ids=ids)) > 5e-2

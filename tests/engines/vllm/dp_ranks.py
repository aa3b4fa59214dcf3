"""Two data-parallel ranks of vLLM's K3 block on the CPU (spawned processes, gloo), for test_dp.py.

Real: vLLM's DP x TP x EP groups from `initialize_model_parallel` with
data_parallel_size 2, `FusedMoEParallelConfig.make`, the forward context's
DP metadata, the all-gather / reduce-scatter all2all manager, the prepare/
finalize `maybe_make_prepare_finalize` picks for DP (with and without EP),
`FusedMoEKernel`, K3's block and `LatentMoERunner`.

Stand-in: vLLM 0.33's CPU communicator has no `all_gatherv` / `reduce_scatterv`
(the CUDA one runs them over NCCL; on the CPU they raise NotImplementedError,
so vLLM itself cannot run a MoE model with DP on the CPU). `gloo_collectives`
adds the two over torch.distributed (gloo), with the same semantics: gather
rows of uneven sizes, sum then keep this rank's rows.
"""
from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path

import torch
import vllm_k3 as k3

DP = 2
SIZES = (7, 4)  # uneven batches: the sizes come from the DP metadata, not from the shapes


def dp_tokens(seed: int, rank: int) -> torch.Tensor:
    return torch.randn(SIZES[rank], k3.HIDDEN,
                       generator=torch.Generator().manual_seed(seed + 101 * rank)).to(torch.bfloat16)


def gloo_collectives() -> None:
    """`all_gatherv` / `reduce_scatterv` on vLLM's CPU communicator (module docstring)."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    def all_gatherv(self, input_, dim=0, sizes=None):
        assert dim == 0 and sizes is not None
        tensors = input_ if isinstance(input_, list) else [input_]
        gathered = []
        for t in tensors:
            padded = t.new_zeros((max(sizes), *t.shape[1:]))
            padded[:t.shape[0]] = t
            parts = [torch.empty_like(padded) for _ in range(self.world_size)]
            torch.distributed.all_gather(parts, padded, group=self.device_group)
            gathered.append(torch.cat([p[:n] for p, n in zip(parts, sizes)]))
        return gathered if isinstance(input_, list) else gathered[0]

    def reduce_scatterv(self, input_, dim=-1, sizes=None):
        assert dim == 0 and sizes is not None
        summed = input_.float().contiguous()
        torch.distributed.all_reduce(summed, group=self.device_group)
        start = sum(sizes[:self.rank_in_group])
        return summed[start:start + sizes[self.rank_in_group]].to(input_.dtype)

    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv


def dp_config(checkpoint: Path, rank: int, ep: bool, tp: int = 1):
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig

    model = ModelConfig(model=str(checkpoint), dtype="bfloat16", max_model_len=512, enforce_eager=True,
                        skip_tokenizer_init=True, limit_mm_per_prompt={"image": 0})
    parallel = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=DP, data_parallel_rank=rank,
                              enable_expert_parallel=ep)
    return VllmConfig(model_config=model, cache_config=CacheConfig(enable_prefix_caching=False),
                      parallel_config=parallel)


@contextlib.contextmanager
def env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dp_forward(block, config, x: torch.Tensor, sizes=SIZES) -> torch.Tensor:
    """The block under the forward context of a DP rank with `sizes` tokens per DP rank (its own: x's,
    or under sequence parallelism the whole DP rank's, of which x is this TP rank's slice)."""
    from vllm.forward_context import set_forward_context

    across = torch.tensor(sizes, dtype=torch.int32)
    mine = int(across[config.parallel_config.data_parallel_rank])
    with torch.no_grad(), set_forward_context(None, config, num_tokens=mine, num_tokens_across_dp=across):
        return block(x)


def init_dp(config, rank: int, port: int, tp: int = 1, tp_rank: int = 0) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    # As a DP engine's worker: world size and rank within this DP rank (TP x PP); vLLM widens them
    # to DP x TP and meets the other ranks at the DP master port, here one all ranks were given.
    config.parallel_config.data_parallel_master_ip = "127.0.0.1"
    config.parallel_config._data_parallel_master_port_list = [port]
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=tp, rank=tp_rank, local_rank=rank * tp + tp_rank,
                                     distributed_init_method="tcp://127.0.0.1:0", backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=tp)


def served_block(config, checkpoint: Path, use_sequence_parallel: bool = False):
    """(block, recorder of what vLLM's runner handed our method's apply)."""
    block = k3.build_block(config, use_sequence_parallel=use_sequence_parallel)
    k3.load_block(block, config, checkpoint)
    k3.process_after_loading(block, config)
    return block, k3.ApplyRecorder(k3.routed_layer(block).quant_method)


def kernel_facts(block) -> dict:
    method = k3.routed_layer(block).quant_method
    return dict(prepare_finalize=type(method.moe_kernel.prepare_finalize).__name__,
                experts=type(method.moe_kernel.fused_experts).__name__,
                naive=block.experts.do_naive_dispatch_combine,
                local_experts=k3.routed_layer(block).local_num_experts)


# Tail of LatentMoERunner's fused path, by the env that picks it (vLLM's CPU platform turns the stream off).
TIER1 = dict(VLLM_DISABLE_SHARED_EXPERTS_STREAM=0, VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD=2048)
TIER2 = dict(VLLM_DISABLE_SHARED_EXPERTS_STREAM=1)


def dp_rank_worker(rank: int, port: int, checkpoint: str, out_dir: str, seed: int) -> None:
    """One DP rank; writes rank<r>.pt with each mode's output, or rank<r>.err."""
    try:
        import vllm.plugins

        from kimi_k3_moe.plugin_entrypoints import _vllm_method

        vllm.plugins.load_general_plugins()
        gloo_collectives()
        path = Path(checkpoint)
        # one config per build: vLLM registers each MoE layer's name in its config
        configs = {mode: dp_config(path, rank, ep=mode == "dp-ep") for mode in ("refusal", "dp-ep", "dp", "dp-tail")}
        init_dp(configs["dp-ep"], rank, port)
        x = dp_tokens(seed, rank)
        result: dict = {"x": x}
        with env(**TIER2):  # as on the CPU: DP without EP is refused at build
            try:
                k3.build_block(configs["refusal"])
            except _vllm_method.UnsupportedVllmSetup as exc:
                result["refusal"] = str(exc)
        for mode, tail in (("dp-ep", TIER2), ("dp", TIER1)):
            with env(**tail):
                block, recorder = served_block(configs[mode], path)
                result[mode] = dict(out=dp_forward(block, configs[mode], x), ids=recorder.calls[0]["topk_ids"],
                                    **kernel_facts(block))
        # The faulty tail, reached by leaving the refusal out (what the engine's own method would do).
        refuse = _vllm_method.refuse_latent_tail_under_dp
        _vllm_method.refuse_latent_tail_under_dp = lambda *args: None
        try:
            with env(**TIER2):
                block, recorder = served_block(configs["dp-tail"], path)
                result["dp-tail"] = dict(out=dp_forward(block, configs["dp-tail"], x),
                                         ids=recorder.calls[0]["topk_ids"])
        finally:
            _vllm_method.refuse_latent_tail_under_dp = refuse
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise


# DP 2 x TP 2 + EP: K3's decoder layer hands each TP rank its sequence-parallel slice of its DP
# rank's tokens (sizes divisible by TP here, so no slice is padded); the MoE's EP group spans all four.
TP = 2
SIZES_TP = (8, 4)


def dp_tp_rank_worker(rank: int, port: int, checkpoint: str, out_dir: str, seed: int) -> None:
    """Global rank `rank` = DP rank * TP + TP rank; writes rank<r>.pt (its slice, output, ids) or rank<r>.err."""
    try:
        import vllm.plugins

        vllm.plugins.load_general_plugins()
        gloo_collectives()
        dp_rank, tp_rank = divmod(rank, TP)
        path = Path(checkpoint)
        config = dp_config(path, dp_rank, ep=True, tp=TP)
        init_dp(config, dp_rank, port, tp=TP, tp_rank=tp_rank)
        tokens = torch.randn(SIZES_TP[dp_rank], k3.HIDDEN,
                             generator=torch.Generator().manual_seed(seed + 101 * dp_rank)).to(torch.bfloat16)
        x = tokens.chunk(TP)[tp_rank]
        with env(**TIER2):
            block, recorder = served_block(config, path, use_sequence_parallel=True)
            out = dp_forward(block, config, x, SIZES_TP)
        torch.save(dict(x=x, out=out, ids=recorder.calls[0]["topk_ids"], **kernel_facts(block)),
                   Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise

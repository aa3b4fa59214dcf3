"""The few-shot prompt vLLM's and lm-eval's GSM8K jobs send.

k worked examples from the training split, each `Question: q\nAnswer: a`
followed by a blank line, then `Question: q\nAnswer:` for the test question.
Generation is greedy and stops at the next `Question`.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

# the stop strings of vLLM's and SGLang's GSM8K jobs
STOP = ("Question", "Assistant:", "<|separator|>")


def few_shot_prefix(examples: Sequence[tuple[str, str]]) -> str:
    return "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in examples)


def build_prompt(prefix: str, question: str) -> str:
    return f"{prefix}Question: {question}\nAnswer:"


def cut_at_stop(reply: str, stop: Sequence[str] = STOP) -> str:
    """The reply up to the first stop string: a server that ignores `stop`
    would otherwise be scored on the next question it invents."""
    cut = min((i for i in (reply.find(s) for s in stop) if i >= 0), default=len(reply))
    return reply[:cut]


def prompt_id(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()[:16]

"""The few-shot prompt text lm-eval's gsm8k task and vLLM's GSM8K script both send.

Each worked example is `Question: q\\nAnswer: a` followed by a blank line
(lm-eval: target delimiter " ", fewshot delimiter "\\n\\n"), then
`Question: q\\nAnswer:` for the test question. Which examples, and where
generation stops, is the protocol's business (protocols.py).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence


def build_prompt(examples: Sequence[tuple[str, str]], question: str) -> str:
    shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in examples)
    return f"{shots}Question: {question}\nAnswer:"


def cut_at_stop(reply: str, stop: Sequence[str]) -> str:
    """The reply up to the first stop string: a server that ignores `stop`
    would otherwise be scored on the next question it invents."""
    cut = min((i for i in (reply.find(s) for s in stop) if i >= 0), default=len(reply))
    return reply[:cut]


def prompt_id(prompt: str) -> str:
    return hashlib.sha256(prompt.encode()).hexdigest()[:16]

"""The two GSM8K protocols the job reproduces: which examples go in each prompt,
where generation stops, how a reply is scored.

lm-eval: lm-eval's `gsm8k` task, version 3.0, as `lm_eval --tasks gsm8k` runs it
         against a completions server: for every question its own few-shot
         examples, drawn from the train split by lm-eval's default sampler
         (`random.Random(1234).sample(train, k)`, one generator drawn from question
         after question in test order, so question i gets the i-th draw), stop at
         `Question:`, `</s>`, `<|im_end|>`; strict-match and flexible-extract
         scored by exact_match (answers_lmeval.py).
vllm:    vLLM's GSM8K CI script: the first k training examples for every question,
         stop at `Question`, `Assistant:`, `<|separator|>`; its integer score as
         flexible plus a value-compared strict score of ours (answers_vllm.py).

Both render an example as `Question: q\\nAnswer: a` followed by a blank line and end
with `Question: q\\nAnswer:`; both decode greedily, 256 tokens by default.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

from kimi_k3_moe.gsm8k import answers_lmeval, answers_vllm
from kimi_k3_moe.gsm8k.data import Problem
from kimi_k3_moe.gsm8k.prompts import build_prompt

NAMES = ("lm-eval", "vllm")


class Protocol:
    name: str
    reproduces: str
    stop: tuple[str, ...]
    scores: dict[str, str]      # metric -> what it is, for the printed table
    fewshot_seed: int | None = None

    def shots(self, num_train: int, num_questions: int, k: int) -> list[list[int]]:
        """Per test question (in test order), the train indices of its examples."""
        raise NotImplementedError

    def gold(self, problem: Problem) -> dict[str, str]:
        """What each score compares a reply's answer with; ValueError if the record has none."""
        raise NotImplementedError

    def score(self, reply: str, problem: Problem) -> tuple[dict, dict]:
        """(extracted answers, correct) per metric."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"protocol": self.name, "reproduces": self.reproduces, "stop": list(self.stop),
                "fewshot_seed": self.fewshot_seed, "scores": dict(self.scores)}


class LmEval(Protocol):
    name = "lm-eval"
    reproduces = ("lm-eval's gsm8k task version 3.0 (lm_eval --model local-completions --tasks gsm8k, "
                  "default fewshot seed 1234, --limit N for the first N questions)")
    stop = ("Question:", "</s>", "<|im_end|>")
    scores = {"strict": "strict-match: first '#### N', exact_match",
              "flexible": "flexible-extract: last number, exact_match"}
    fewshot_seed = 1234  # lm-eval's DEFAULT_OTHER_SEED, its --fewshot_random_seed default

    def shots(self, num_train, num_questions, k):
        rng = random.Random(self.fewshot_seed)
        return [rng.sample(range(num_train), k) for _ in range(num_questions)]

    def gold(self, problem):
        target = answers_lmeval.normalize(problem.answer)
        return {"strict": target, "flexible": target}

    def score(self, reply, problem):
        extracted = {"strict": answers_lmeval.strict_match(reply),
                     "flexible": answers_lmeval.flexible_extract(reply)}
        return extracted, {m: answers_lmeval.exact_match(v, problem.answer) for m, v in extracted.items()}


class Vllm(Protocol):
    name = "vllm"
    reproduces = ("vLLM's GSM8K CI script tests/evals/gsm8k/gsm8k_eval.py (its accuracy is the flexible "
                  "score; the strict score is ours)")
    stop = ("Question", "Assistant:", "<|separator|>")
    scores = {"strict": "first '#### N' by value (ours)",
              "flexible": "vLLM's score: last digits as an integer"}

    def shots(self, num_train, num_questions, k):
        return [list(range(k))] * num_questions

    def gold(self, problem):
        label = answers_vllm.flexible_answer(problem.answer)
        if label is None:
            raise ValueError("vLLM's script reads no integer label from the answer")
        return {"strict": problem.gold, "flexible": label}

    def score(self, reply, problem):
        gold = self.gold(problem)
        extracted = {"strict": answers_vllm.strict_answer(reply),
                     "flexible": answers_vllm.flexible_answer(reply)}
        return extracted, {m: v == gold[m] for m, v in extracted.items()}


PROTOCOLS: dict[str, Protocol] = {p.name: p for p in (LmEval(), Vllm())}


def no_answer(extracted: str | None) -> bool:
    """lm-eval's filters say "[invalid]", the vllm protocol None."""
    return extracted is None or extracted == answers_lmeval.INVALID


def build_prompts(protocol: Protocol, train: Sequence[Problem], problems: Sequence[Problem],
                  k: int) -> tuple[list[str], list[list[int]]]:
    shots = protocol.shots(len(train), len(problems), k)
    prompts = [build_prompt([(train[i].question, train[i].answer) for i in s], p.question)
               for s, p in zip(shots, problems)]
    return prompts, shots

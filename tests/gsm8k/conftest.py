"""Fixtures: synthetic GSM8K files, the answer server, and the command run in-process."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from .answer_server import AnswerServer
from .synthetic import assign_replies, write_gsm8k

# 24 questions: 14 right both ways, 4 right only by the last number, 3 only by '####', 3 wrong
COUNTS = {"right": 14, "flexible_only": 4, "strict_only": 3, "wrong": 3}
STRICT, FLEXIBLE = 17 / 24, 18 / 24
# fast settings for a server on localhost
FAST = ["--timeout", "2", "--retries", "3", "--backoff", "0.01", "--concurrency", "4", "--no-progress"]


@dataclass
class World:
    data_dir: str
    train: list
    test: list
    key: dict
    server: AnswerServer
    report: str

    def args(self, *extra: str) -> list[str]:
        return ["gsm8k", "--base-url", self.server.url, "--data-dir", self.data_dir, "--num-shots", "3",
                "--report", self.report, *FAST, *extra]

    def read_report(self) -> dict:
        with open(self.report) as f:
            return json.load(f)


@pytest.fixture
def world(tmp_path, seed):
    rng = random.Random(seed)
    train, test = write_gsm8k(tmp_path / "gsm8k", rng)
    key, strict, flexible = assign_replies(rng, test, COUNTS)
    assert (strict, flexible) == (STRICT, FLEXIBLE)
    server = AnswerServer(key).start()
    try:
        yield World(str(tmp_path / "gsm8k"), train, test, key, server, str(tmp_path / "out" / "report.json"))
    finally:
        server.close()

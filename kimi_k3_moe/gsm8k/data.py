"""GSM8K's train and test splits: from a folder, else from the Hugging Face hub.

The repository ships no GSM8K text; the user supplies it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from kimi_k3_moe import io_errors, settings
from kimi_k3_moe.gsm8k.answers_vllm import gold_answer

DATA_DIR_ENV = settings.GSM8K_DIR
HF_DATASET = ("openai/gsm8k", "main")
WHERE_TO_PUT_IT = (
    "put GSM8K's train.jsonl and test.jsonl (from github.com/openai/grade-school-math, "
    "folder grade_school_math/data) in a folder and pass --data-dir FOLDER "
    f"(or set {DATA_DIR_ENV}); or install the Hugging Face `datasets` package on a machine "
    f"that can reach the hub ({HF_DATASET[0]})")


class DataError(Exception):
    """GSM8K could not be found or a record is malformed; the message says which."""


@dataclass(frozen=True)
class Problem:
    index: int      # position in its split
    question: str
    answer: str     # the worked solution, ending in `#### N`
    gold: str       # N, canonical


def _problem(index: int, record: object, where: str) -> Problem:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with 'question' and 'answer', got "
                        f"{type(record).__name__}")
    for field in ("question", "answer"):
        if not isinstance(record.get(field), str) or not record[field].strip():
            raise DataError(f"{where}: field {field!r} is missing or not a non-empty string")
    try:
        gold = gold_answer(record["answer"])
    except ValueError as exc:
        raise DataError(f"{where}: field 'answer': {exc}") from None
    return Problem(index, record["question"], record["answer"], gold)


def read_split(path: Path) -> list[Problem]:
    problems = []
    try:
        with open(path, "rb") as f:
            lines = list(f)
    except OSError as exc:
        raise DataError(io_errors.describe(exc, path)) from None
    for lineno, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: line {lineno} column {exc.start + 1}: not UTF-8 "
                            f"(byte 0x{raw[exc.start]:02x})") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: line {lineno} column {exc.colno}: not JSON: {exc.msg}") from None
        problems.append(_problem(len(problems), record, f"{path}: line {lineno}"))
    if not problems:
        raise DataError(f"{path} holds no records")
    return problems


def _from_folder(folder: Path) -> tuple[list[Problem], list[Problem]]:
    missing = [name for name in ("train.jsonl", "test.jsonl") if not (folder / name).is_file()]
    if missing:
        raise DataError(f"{folder} lacks {' and '.join(missing)}: {WHERE_TO_PUT_IT}")
    return read_split(folder / "train.jsonl"), read_split(folder / "test.jsonl")


def _from_hub() -> tuple[list[Problem], list[Problem]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"no GSM8K data given and the `datasets` package is not installed: "
                        f"{WHERE_TO_PUT_IT}") from None
    try:
        loaded = datasets.load_dataset(*HF_DATASET)
        splits = [loaded[name] for name in ("train", "test")]
    except Exception as exc:  # the hub raises many kinds (offline, auth, cache)
        raise DataError(f"could not load {HF_DATASET[0]} with `datasets` "
                        f"({type(exc).__name__}: {exc}): {WHERE_TO_PUT_IT}") from None
    return tuple([_problem(i, dict(r), f"{HF_DATASET[0]}[{name}][{i}]") for i, r in enumerate(split)]
                 for name, split in zip(("train", "test"), splits))


def load_gsm8k(data_dir: str | os.PathLike | None) -> tuple[list[Problem], list[Problem], str]:
    """(train, test, where they came from)."""
    if data_dir:
        folder = Path(data_dir).expanduser()
        if not folder.is_dir():
            raise DataError(f"--data-dir {folder} is not a folder: {WHERE_TO_PUT_IT}")
        train, test = _from_folder(folder)
        return train, test, str(folder.resolve())
    train, test = _from_hub()
    return train, test, f"huggingface:{'/'.join(HF_DATASET)}"


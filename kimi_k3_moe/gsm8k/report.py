"""The JSON report: settings, one record per answered question, both accuracies,
throughput, the gate verdict. It doubles as the resume journal, so it is
rewritten atomically (write a sibling file, then rename) while the job runs.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from kimi_k3_moe import io_errors
from kimi_k3_moe.gsm8k.gate import Gate
from kimi_k3_moe.gsm8k.protocols import no_answer

KIND = "kimi-k3-moe gsm8k report"
VERSION = 2  # 2: protocols (lm-eval, vllm); version-1 records were scored by value only
# settings that change what a question's answer means; the rest (URL, concurrency,
# timeouts, gate) may differ between a run and its resumption
RESUME_MUST_MATCH = ("protocol", "api", "model", "num_shots", "num_questions", "max_tokens", "stop",
                     "data_sha256")


class ReportError(Exception):
    """The report cannot be read or resumed; the message says why."""


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Report:
    def __init__(self, settings: dict):
        self.settings = dict(settings)
        self.records: dict[int, dict] = {}
        self.errors: dict[int, dict] = {}   # questions that ran out of retries, to ask again
        self.sessions: list[dict] = []

    # -- reading and resuming ----------------------------------------------------------------------

    @classmethod
    def load(cls, path: Path) -> Report:
        try:
            data = io_errors.read_json(path, ReportError)
        except ReportError as exc:
            raise ReportError(f"cannot read report: {exc}") from None
        if not isinstance(data, dict) or data.get("kind") != KIND or data.get("version") != VERSION:
            raise ReportError(f"{path} is not a version-{VERSION} {KIND}")
        try:
            report = cls(dict(data["settings"]))
            for record in data.get("records", []):
                if record["id"] in report.records:
                    raise ReportError(f"{path}: question {record['id']} is recorded twice")
                report.records[record["id"]] = record
            report.sessions = list(data.get("sessions", []))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ReportError):
                raise
            raise ReportError(f"{path}: malformed report ({type(exc).__name__}: {exc}); start again with "
                              "--overwrite") from None
        return report

    def check_resumable(self, settings: dict) -> None:
        differ = [f"{key}: report has {self.settings.get(key)!r}, this run {settings.get(key)!r}"
                  for key in RESUME_MUST_MATCH if self.settings.get(key) != settings.get(key)]
        if differ:
            raise ReportError("the report was made with other settings, so its answers do not "
                              "carry over (start again with --overwrite):\n  " + "\n  ".join(differ))
        self.settings.update(settings)

    # -- filling in ----------------------------------------------------------------------------

    def add(self, record: dict) -> None:
        qid = record["id"]
        if qid in self.records:
            raise AssertionError(f"question {qid} answered twice")  # the job must never do this
        self.records[qid] = record
        self.errors.pop(qid, None)

    def add_error(self, qid: int, error: str, attempts: int) -> None:
        self.errors[qid] = {"id": qid, "error": error, "attempts": attempts}

    # -- results -------------------------------------------------------------------------------

    @property
    def num_questions(self) -> int:
        return self.settings["num_questions"]

    @property
    def complete(self) -> bool:
        return len(self.records) == self.num_questions

    def accuracy(self, metric: str) -> float | None:
        if not self.records:
            return None
        return sum(r["correct"][metric] for r in self.records.values()) / len(self.records)

    def summary(self) -> dict:
        records = self.records.values()
        out = {"questions": self.num_questions, "answered": len(self.records),
               "unanswered": self.num_questions - len(self.records), "complete": self.complete}
        for metric in ("strict", "flexible"):
            out[f"{metric}_correct"] = sum(r["correct"][metric] for r in records)
            out[f"{metric}_accuracy"] = self.accuracy(metric)
            out[f"{metric}_no_answer"] = sum(no_answer(r["extracted"][metric]) for r in records)
        return out

    def throughput(self) -> dict:
        wall = sum(s["wall_s"] for s in self.sessions)
        tokens = [r["completion_tokens"] for r in self.records.values() if r["completion_tokens"] is not None]
        latencies = [r["latency_s"] for r in self.records.values()]
        out = {"wall_s": round(wall, 3),
               "questions_per_s": len(self.records) / wall if wall > 0 else None,
               "completion_tokens": sum(tokens) if tokens else None,
               "completion_tokens_per_s": sum(tokens) / wall if tokens and wall > 0 else None}
        if latencies:
            out["latency_s"] = {"mean": statistics.fmean(latencies), "p50": _percentile(latencies, 0.5),
                                "p90": _percentile(latencies, 0.9), "max": max(latencies)}
        return out

    def verdict(self, gate: Gate | None) -> dict:
        if gate is None:
            return {"verdict": "no gate", "passed": None}
        out = {**gate.to_json(), "protocol": self.settings.get("protocol"),
               "accuracy": self.accuracy(gate.metric)}
        if not self.complete:
            return {**out, "verdict": "not judged: the run is incomplete", "passed": None}
        passed = gate.passes(out["accuracy"])
        return {**out, "verdict": "PASS" if passed else "FAIL", "passed": passed}

    def to_json(self, gate: Gate | None) -> dict:
        return {"kind": KIND, "version": VERSION, "settings": self.settings,
                "status": "complete" if self.complete else "incomplete",
                "summary": self.summary(), "throughput": self.throughput(), "gate": self.verdict(gate),
                "sessions": self.sessions, "errors": [self.errors[k] for k in sorted(self.errors)],
                "records": [self.records[k] for k in sorted(self.records)]}

    def save(self, path: Path, gate: Gate | None) -> None:
        """Write the report atomically; ReportError naming the path and the cause (no space, ...)."""
        path = Path(path)
        with io_errors.mapped(ReportError, path, "cannot write the report"):
            path.parent.mkdir(parents=True, exist_ok=True)
        io_errors.write_text(path, json.dumps(self.to_json(gate), indent=1), ReportError)

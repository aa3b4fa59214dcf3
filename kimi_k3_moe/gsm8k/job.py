"""Ask every question not yet in the report, a bounded number at a time.

Workers are daemon threads fed from a queue, so Ctrl-C returns at once even
while requests are stalled inside their timeout. Only this thread touches the
report, so a question is recorded at most once, however many times it was sent.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, timezone

from tqdm import tqdm

from kimi_k3_moe.gsm8k.client import Completion, RequestFailed, RetryNotice, RetryPolicy, Server, with_retries
from kimi_k3_moe.gsm8k.data import Problem
from kimi_k3_moe.gsm8k.prompts import cut_at_stop, prompt_id
from kimi_k3_moe.gsm8k.protocols import Protocol
from kimi_k3_moe.gsm8k.report import Report


def score(protocol: Protocol, problem: Problem, prompt: str, shots: Sequence[int],
          completion: Completion) -> dict:
    scored = cut_at_stop(completion.text, protocol.stop)
    extracted, correct = protocol.score(scored, problem)
    return {"id": problem.index, "prompt_id": prompt_id(prompt), "shots": list(shots),
            "question": problem.question, "gold": protocol.gold(problem), "reply": completion.text,
            "cut_at_stop": scored != completion.text, "extracted": extracted, "correct": correct,
            "latency_s": round(completion.latency_s, 4), "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens, "attempts": completion.attempts}


def run_questions(server: Server, policy: RetryPolicy, protocol: Protocol, problems: Sequence[Problem],
                  prompts: Sequence[str], shots: Sequence[Sequence[int]], report: Report, *,
                  concurrency: int, checkpoint: Callable[[], None],
                  checkpoint_every_s: float = 2.0, progress: bool | None = None) -> str | None:
    """Fill `report` in; returns None, or why the job stopped early (it then leaves the rest
    for --resume). Calls `checkpoint` now and then and once at the end, whatever happens."""
    tasks: queue.Queue[Problem] = queue.Queue()
    for problem in problems:
        if problem.index not in report.records:
            tasks.put(problem)
    if tasks.empty():  # a finished report, resumed to judge it with another gate
        checkpoint()
        return None
    results: queue.Queue = queue.Queue()
    stop = threading.Event()
    notice = RetryNotice(f"no answer from {server.base_url}", policy,
                         lambda line: tqdm.write(line, file=sys.stderr))

    def worker() -> None:
        while not stop.is_set():
            try:
                problem = tasks.get_nowait()
            except queue.Empty:
                return
            try:
                completion, attempts = with_retries(
                    lambda problem=problem: server.complete_once(prompts[problem.index]),
                    policy, should_stop=stop.is_set, on_retry=notice)
                outcome = replace(completion, attempts=attempts)
            except RequestFailed as exc:
                stop.set()  # finish what is in flight, start nothing new
                outcome = exc
            except Exception as exc:  # a bug must not silently lose the question with its thread
                stop.set()
                outcome = RequestFailed(f"unexpected {type(exc).__name__}: {exc}", retryable=False)
            results.put((problem, outcome))

    session = {"started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "base_url": server.base_url, "concurrency": concurrency, "wall_s": 0.0, "answered": 0}
    report.sessions.append(session)
    failure = None
    start = last_checkpoint = time.monotonic()
    bar = tqdm(total=report.num_questions, initial=len(report.records), desc="gsm8k", unit="q",
               disable=None if progress is None else not progress, dynamic_ncols=True)
    threads = [threading.Thread(target=worker, name=f"gsm8k-{i}", daemon=True)
               for i in range(min(concurrency, tasks.qsize()))]
    for t in threads:
        t.start()

    def handle(problem: Problem, outcome: Completion | RequestFailed) -> None:
        nonlocal failure
        if isinstance(outcome, RequestFailed):
            report.add_error(problem.index, str(outcome), outcome.attempts)
            if failure is None:
                failure = (f"question {problem.index} failed after {outcome.attempts} "
                           f"attempt(s): {outcome}")
            return
        report.add(score(protocol, problem, prompts[problem.index], shots[problem.index], outcome))
        session["answered"] += 1
        bar.update(1)
        bar.set_postfix(flexible=f"{report.accuracy('flexible'):.3f}", refresh=False)

    try:
        while True:
            try:
                handle(*results.get(timeout=0.1))
            except queue.Empty:
                if not any(t.is_alive() for t in threads):
                    while not results.empty():  # a worker may have put a result just before exiting
                        handle(*results.get_nowait())
                    break
            now = time.monotonic()
            session["wall_s"] = round(now - start, 3)
            if now - last_checkpoint >= checkpoint_every_s:
                checkpoint()
                last_checkpoint = now
    except KeyboardInterrupt:
        failure = "interrupted"
        raise
    finally:
        stop.set()
        session["wall_s"] = round(time.monotonic() - start, 3)
        if failure:
            session["stopped"] = failure
        bar.close()
        checkpoint()
    return failure

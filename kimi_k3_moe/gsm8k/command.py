"""`kimi-k3-moe gsm8k`: GSM8K accuracy of a live vLLM or SGLang server, with a CI gate.

Exit status: 0 the gate passed (or no gate was given and every question was
answered), 1 the gate failed, 2 a usage, data or connection error or an
incomplete run (the report is still written; --resume finishes it),
130 interrupted (Ctrl-C), 143 terminated (SIGTERM): the report is saved either way.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from pathlib import Path

from kimi_k3_moe import settings as env_settings
from kimi_k3_moe.cli import INT_MAX, exit_status
from kimi_k3_moe.gsm8k.client import (
    APIS,
    MAX_TIMEOUT_S,
    RequestFailed,
    RetryNotice,
    RetryPolicy,
    Server,
    check_timeout,
    with_retries,
)
from kimi_k3_moe.gsm8k.data import DATA_DIR_ENV, DataError, load_gsm8k
from kimi_k3_moe.gsm8k.gate import DEFAULT_RTOL, METRICS, make_gate
from kimi_k3_moe.gsm8k.job import run_questions
from kimi_k3_moe.gsm8k.protocols import NAMES, PROTOCOLS, build_prompts
from kimi_k3_moe.gsm8k.report import Report, ReportError

HELP = "GSM8K accuracy of a running vLLM or SGLang server, with a pass/fail gate"
EPILOG = f"""\
protocols: lm-eval (default) sends and scores exactly as lm-eval's gsm8k task 3.0:
per question 5 examples drawn with lm-eval's default seed, strict = strict-match,
flexible = flexible-extract, both lm-eval's exact_match (string comparison, so
'18.00' is not '18'). vllm sends and scores as vLLM's GSM8K CI script: the first
examples, flexible = the last digits read as an integer; strict = the '#### N'
number by value (ours). The gate reads the flexible score unless --gate-on strict.
gate: --threshold T passes iff accuracy >= T; --baseline B [--rtol R] passes iff
accuracy >= B*(1-R) (R defaults to {DEFAULT_RTOL}, vLLM's). No gate: exit 0 once all is answered.
exit status: 0 pass, 1 fail, 2 usage/data/connection error or incomplete run, 130 interrupted,
143 terminated (the report is saved on both signals; --resume asks only the rest).
"""
NO_LIMIT = ("none", "off", "inf")  # what --timeout takes for "no deadline"
MAX_RETRIES, MAX_CONCURRENCY, MAX_BACKOFF_S = 100, 4096, 3600.0


class UsageError(Exception):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--base-url", required=True,
                        help="the server, e.g. http://localhost:8000 (a trailing /v1 is accepted)")
    parser.add_argument("--api", choices=list(APIS), default="completions",
                        help="; ".join(f"{k}: {v[1]} ({v[0]})" for k, v in APIS.items())
                        + " (default: %(default)s)")
    parser.add_argument("--protocol", choices=NAMES, default="lm-eval",
                        help="whose GSM8K to reproduce: lm-eval's gsm8k task or vLLM's CI script "
                             "(default: %(default)s)")
    parser.add_argument("--model", help="model name to request (default: the one /v1/models lists)")
    parser.add_argument("--num-shots", type=int, default=5, help="worked examples (default: %(default)s)")
    parser.add_argument("--num-questions", type=int,
                        help="ask the first N test questions (default: all 1319)")
    parser.add_argument("--concurrency", type=int, default=32,
                        help="requests in flight at once (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256, help="per reply (default: %(default)s)")
    parser.add_argument("--timeout", type=_timeout, default=600.0,
                        help="hard wall-clock deadline in seconds on each attempt: connect, send, headers and "
                             f"reply together, however slowly the server trickles; at most {MAX_TIMEOUT_S:g} "
                             "(a week), or 'none' for no limit (default: %(default)s)")
    parser.add_argument("--retries", type=int, default=5,
                        help="extra attempts on connection errors, timeouts, 5xx and malformed "
                             "replies (default: %(default)s)")
    parser.add_argument("--backoff", type=float, default=1.0,
                        help="seconds before the first retry, doubling up to 30 (default: %(default)s)")
    gate = parser.add_argument_group("gate")
    gate.add_argument("--baseline", type=float, help="the accuracy this deployment should reach")
    gate.add_argument("--threshold", type=float, help="pass iff accuracy >= THRESHOLD")
    gate.add_argument("--rtol", type=float,
                      help=f"pass iff accuracy >= BASELINE*(1-RTOL) (default {DEFAULT_RTOL} with --baseline)")
    gate.add_argument("--gate-on", choices=METRICS, default="flexible",
                      help="which accuracy the gate reads (default: %(default)s)")
    parser.add_argument("--report", default="gsm8k_report.json",
                        help="JSON report, also the journal --resume reads (default: %(default)s)")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true",
                        help="continue the run in --report; questions it answered are not asked again")
    resume.add_argument("--overwrite", action="store_true", help="replace an existing --report")
    parser.add_argument("--data-dir",
                        help=f"folder with GSM8K's train.jsonl and test.jsonl (default: ${DATA_DIR_ENV}; "
                             "else the Hugging Face `datasets` loader if installed)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token for the server (default: $OPENAI_API_KEY); never written to the report")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _timeout(text: str) -> float | None:
    if text.strip().lower() in NO_LIMIT:
        return None
    try:
        return check_timeout(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--timeout ")
                                         if "give seconds" in str(exc) else f"{text!r} is not a number") from None


def _check_numbers(args: argparse.Namespace) -> None:
    for name, low, high in (("num_shots", 0, INT_MAX), ("num_questions", 1, INT_MAX),
                            ("concurrency", 1, MAX_CONCURRENCY), ("max_tokens", 1, INT_MAX),
                            ("retries", 0, MAX_RETRIES)):
        value = getattr(args, name)
        if value is not None and not low <= value <= high:
            raise UsageError(f"--{name.replace('_', '-')} {value}: must be in [{low}, {high}]")
    if not 0 < args.backoff <= MAX_BACKOFF_S:  # NaN fails too
        raise UsageError(f"--backoff {args.backoff}: must be in (0, {MAX_BACKOFF_S:g}] seconds")
    for name in ("baseline", "threshold", "rtol"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            raise UsageError(f"--{name} {value}: must be a finite number")


def _data_dir(args: argparse.Namespace) -> str | None:
    """--data-dir, else the setting (which must then name a folder), else None (the hub)."""
    if args.data_dir:
        return args.data_dir
    try:
        return env_settings.path(DATA_DIR_ENV)
    except env_settings.SettingError as exc:
        raise UsageError(str(exc)) from None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _served_model(server: Server, policy: RetryPolicy) -> str:
    notice = RetryNotice(f"no answer from {server.base_url}/v1/models", policy, _say)
    try:
        models, _ = with_retries(server.served_models, policy, on_retry=notice)
    except RequestFailed as exc:
        raise UsageError(f"cannot list the server's models ({exc}); is --base-url right? "
                         "Or pass --model") from None
    if len(models) != 1:
        raise UsageError(f"the server lists {len(models)} models ({', '.join(models) or 'none'}): "
                         "choose one with --model")
    return models[0]


def _prepare(args: argparse.Namespace):
    _check_numbers(args)
    try:
        gate = make_gate(args.baseline, args.threshold, args.rtol, args.gate_on)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    report_path = Path(args.report)
    if report_path.exists() and not (args.resume or args.overwrite):
        raise UsageError(f"report {report_path} exists: --resume continues it, --overwrite replaces it")
    try:
        train, test, source = load_gsm8k(_data_dir(args))
    except DataError as exc:
        raise UsageError(f"GSM8K data: {exc}") from None
    if args.num_shots > len(train):
        raise UsageError(f"--num-shots {args.num_shots}: the training split has {len(train)} examples")
    num_questions = len(test) if args.num_questions is None else args.num_questions
    if num_questions > len(test):
        raise UsageError(f"--num-questions {num_questions}: the test split has {len(test)} questions")
    protocol = PROTOCOLS[args.protocol]
    problems = test[:num_questions]
    golds = []
    for problem in problems:
        try:
            golds.append(protocol.gold(problem))
        except ValueError as exc:
            raise UsageError(f"GSM8K data: test question {problem.index}: {exc}") from None
    try:
        server = Server(args.base_url, args.api, model=args.model, max_tokens=args.max_tokens,
                        stop=protocol.stop, timeout_s=args.timeout, api_key=args.api_key,
                        connections=args.concurrency)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    policy = RetryPolicy(retries=args.retries, backoff_s=args.backoff)
    try:
        if server.api != "sglang-generate" and not server.model:
            server.model = _served_model(server, policy)
        report = _open_report(args, gate, server, protocol, problems, golds, (train, source))
    except BaseException:
        server.close()
        raise
    return gate, report_path, server, policy, protocol, problems, *report


def _open_report(args, gate, server, protocol, problems, golds, data):
    """(prompts, shots, the report: new or resumed) once the server is known."""
    report_path, num_questions = Path(args.report), len(problems)
    train, source = data
    prompts, shots = build_prompts(protocol, train, problems, args.num_shots)
    settings = {**protocol.describe(),  # protocol, reproduces, stop, fewshot_seed, scores
                "base_url": server.base_url, "api": server.api, "model": server.model,
                "num_shots": args.num_shots, "num_questions": num_questions, "max_tokens": args.max_tokens,
                "temperature": 0, "data_source": source,
                "data_sha256": _fingerprint(prompts, golds), "first_prompt": prompts[0]}
    if args.resume and report_path.exists():
        try:
            report = Report.load(report_path)
            report.check_resumable(settings)
        except ReportError as exc:
            raise UsageError(str(exc)) from None
        print(f"resuming {report_path}: {len(report.records)} of {num_questions} answered already")
    else:
        if args.resume:
            print(f"no report at {report_path} yet: starting a new run")
        report = Report(settings)
    try:  # find out now, not after an hour of questions, that the report cannot be written
        report.save(report_path, gate)
    except ReportError as exc:
        raise UsageError(str(exc)) from None
    return prompts, shots, report


def _fingerprint(prompts: list[str], golds: list[dict]) -> str:
    """Of what the questions are: their exact prompts and what the replies are compared with."""
    return hashlib.sha256(json.dumps([prompts, golds]).encode()).hexdigest()[:16]


def _print_summary(report: Report, gate_json: dict, report_path: Path) -> None:
    s, t, cfg = report.summary(), report.throughput(), report.settings
    print(f"GSM8K {cfg['num_shots']}-shot, protocol {cfg['protocol']}, {s['answered']}/{s['questions']} "
          f"questions answered by {cfg['model'] or 'the server'} via {cfg['api']} at {cfg['base_url']}")
    print(f"  protocol {cfg['protocol']} reproduces {cfg['reproduces']}")
    for metric in ("strict", "flexible"):
        acc = s[f"{metric}_accuracy"]
        print(f"  {cfg['protocol']:<7} {metric:<8} accuracy {'n/a' if acc is None else f'{acc:.4f}'} "
              f"({s[f'{metric}_correct']}/{s['answered']}, {cfg['scores'][metric]}; "
              f"no answer in {s[f'{metric}_no_answer']} replies)")
    if t.get("questions_per_s"):
        line = f"  throughput {t['questions_per_s']:.2f} questions/s"
        if t["completion_tokens_per_s"]:
            line += f", {t['completion_tokens_per_s']:.1f} output tokens/s"
        lat = t.get("latency_s")
        if lat:
            line += f"; latency p50 {lat['p50']:.2f} s, p90 {lat['p90']:.2f} s"
        print(line)
    if gate_json.get("rule"):
        print(f"gate: {cfg['protocol']} {gate_json['rule']}: {gate_json['verdict']}")
    print(f"report: {report_path}")


def run(args: argparse.Namespace) -> int:
    try:
        gate, report_path, server, policy, protocol, problems, prompts, shots, report = _prepare(args)
    except UsageError as exc:
        print(f"kimi-k3-moe gsm8k: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        return exit_status(exc)

    def checkpoint() -> None:
        report.save(report_path, gate)

    try:
        failure = run_questions(server, policy, protocol, problems, prompts, shots, report,
                                concurrency=args.concurrency, checkpoint=checkpoint,
                                progress=False if args.no_progress else None)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the job saved the report on its way out
        print(f"\ninterrupted: {len(report.records)} answered are in {report_path}; "
              "--resume finishes the run", file=sys.stderr)
        return exit_status(exc)
    except ReportError as exc:
        print(f"kimi-k3-moe gsm8k: error: {exc}; the answers since the last save are lost", file=sys.stderr)
        return 2
    finally:
        server.close()
    verdict = report.verdict(gate)
    _print_summary(report, verdict, report_path)
    if failure or not report.complete:
        print(f"kimi-k3-moe gsm8k: error: incomplete: {failure or 'questions left unanswered'}; "
              f"fix the server and run again with --resume", file=sys.stderr)
        return 2
    return 0 if verdict["passed"] in (True, None) else 1

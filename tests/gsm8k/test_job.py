"""`kimi-k3-moe gsm8k` against the answer server: scores, gate, exit codes, report."""
import json
import os
import subprocess
import sys

import pytest

from kimi_k3_moe.gsm8k.answers_lmeval import normalize
from kimi_k3_moe.gsm8k.protocols import PROTOCOLS

from .conftest import FLEXIBLE, STRICT

TABLE = {
    "lm-eval": (f"lm-eval strict   accuracy {STRICT:.4f} (17/24, strict-match: first '#### N', exact_match; "
                "no answer in 4 replies)",
                f"lm-eval flexible accuracy {FLEXIBLE:.4f} (18/24, flexible-extract: last number, exact_match; "
                "no answer in 0 replies)"),
    "vllm": (f"vllm    strict   accuracy {STRICT:.4f} (17/24, first '#### N' by value (ours); no answer in 4 replies)",
             f"vllm    flexible accuracy {FLEXIBLE:.4f} (18/24, vLLM's score: last digits as an integer; "
             "no answer in 0 replies)"),
}


@pytest.mark.parametrize("api, protocol", [("completions", "lm-eval"), ("completions", "vllm"),
                                           ("chat", "lm-eval"), ("sglang-generate", "lm-eval"),
                                           ("sglang-generate", "vllm")])
def test_scores_are_exact_on_every_api(world, gsm8k, api, protocol):
    extra = () if protocol == "lm-eval" else ("--protocol", protocol)  # lm-eval is the default
    code, out, err = gsm8k(world.args("--api", api, "--max-tokens", "123", *extra))
    assert code == 0, out + err
    report = world.read_report()
    s = report["summary"]
    assert (s["strict_accuracy"], s["flexible_accuracy"]) == (STRICT, FLEXIBLE)
    assert (s["strict_correct"], s["flexible_correct"], s["answered"], s["unanswered"]) == (17, 18, 24, 0)
    assert f"GSM8K 3-shot, protocol {protocol}, 24/24 questions" in out
    assert TABLE[protocol][0] in out and TABLE[protocol][1] in out
    proto = PROTOCOLS[protocol]
    settings = report["settings"]
    assert settings["protocol"] == protocol and settings["stop"] == list(proto.stop)
    assert settings["reproduces"] == proto.reproduces and f"protocol {protocol} reproduces {proto.reproduces}" in out
    first = next(e for e in world.server.log if e["question"] == world.test[0]["question"])
    sent = first["body"].get("prompt") or first["body"].get("text") or first["body"]["messages"][0]["content"]
    assert settings["first_prompt"] == sent

    # each question asked exactly once, greedily, with 3 shots and the stop string
    assert sorted(world.server.requests.values()) == [1] * 24
    assert {entry["api"] for entry in world.server.log} == {api}
    assert all(entry["shots"] == 3 for entry in world.server.log)
    body = world.server.log[0]["body"]
    stop = body["sampling_params"]["stop"] if api == "sglang-generate" else body["stop"]
    assert stop == list(proto.stop)
    if api == "sglang-generate":
        assert body["sampling_params"]["max_new_tokens"] == 123 and "model" not in body
        assert report["settings"]["model"] is None
    else:
        assert body["max_tokens"] == 123 and body["model"] == "toy-gsm8k"  # found via /v1/models
        assert report["settings"]["model"] == "toy-gsm8k"

    records = report["records"]
    assert [r["id"] for r in records] == list(range(24))
    by_question = {t["question"]: t for t in world.test}
    for r in records:
        truth = by_question[r["question"]]
        assert r["gold"] == {"strict": str(truth["value"]), "flexible": str(truth["value"])}
        assert r["reply"] == world.key[r["question"]].split("Question")[0]  # the server honoured stop
        compare = normalize if protocol == "lm-eval" else str
        for m in ("strict", "flexible"):
            assert r["correct"][m] == (compare(r["extracted"][m]) == r["gold"][m])
        assert len(r["shots"]) == 3 and len(set(r["shots"])) == 3
        if protocol == "vllm":
            assert r["shots"] == [0, 1, 2]
        assert r["latency_s"] > 0 and r["completion_tokens"] > 0 and r["prompt_tokens"] > 0
        assert r["attempts"] == 1 and len(r["prompt_id"]) == 16 and not r["cut_at_stop"]
    assert len({r["prompt_id"] for r in records}) == 24
    t = report["throughput"]
    assert t["questions_per_s"] > 0 and t["completion_tokens"] == sum(r["completion_tokens"] for r in records)
    assert set(t["latency_s"]) == {"mean", "p50", "p90", "max"}
    assert report["status"] == "complete" and report["gate"] == {"verdict": "no gate", "passed": None}


def test_gate_verdicts_and_exit_codes(world, gsm8k):
    code, out, _ = gsm8k(world.args("--threshold", str(FLEXIBLE)))  # exactly at the bar passes
    assert code == 0 and f"gate: lm-eval flexible accuracy >= {FLEXIBLE:g}: PASS" in out
    gate = world.read_report()["gate"]
    assert gate["passed"] is True and gate["metric"] == "flexible" and gate["accuracy"] == FLEXIBLE
    assert gate["protocol"] == "lm-eval"

    # A finished report can be judged again with another gate without asking anything
    asked = sum(world.server.requests.values())
    between = (STRICT + FLEXIBLE) / 2
    code, out, _ = gsm8k(world.args("--resume", "--threshold", str(between), "--gate-on", "strict"))
    assert code == 1 and "FAIL" in out and world.read_report()["gate"]["passed"] is False
    code, _, _ = gsm8k(world.args("--resume", "--threshold", str(between)))
    assert code == 0
    # --baseline with --rtol: accuracy >= B * (1 - R)
    code, out, _ = gsm8k(world.args("--resume", "--baseline", "0.8", "--rtol", "0.05"))
    assert code == 1 and "flexible accuracy >= 0.8 * (1 - 0.05) = 0.7600: FAIL" in out
    code, _, _ = gsm8k(world.args("--resume", "--baseline", "0.8", "--rtol", "0.07"))
    assert code == 0
    code, _, _ = gsm8k(world.args("--resume", "--baseline", "0.8"))  # default rtol 0.08
    assert code == 0 and world.read_report()["gate"]["rtol"] == 0.08
    assert sum(world.server.requests.values()) == asked
    assert len(world.read_report()["sessions"]) == 1  # judging again is not a session


def test_usage_errors_exit_2(world, gsm8k, monkeypatch, tmp_path):
    code, _, err = gsm8k(world.args("--threshold", "0.5", "--rtol", "0.1"))
    assert code == 2 and "not both" in err
    code, out, err = gsm8k(world.args("--threshold", "0.5", "--baseline", "0.9"))
    assert code == 2 and out == "" and err == (
        "kimi-k3-moe gsm8k: error: --threshold and --baseline are two different gates: "
        "give --threshold T or --baseline B [--rtol R], not both\n")
    code, _, err = gsm8k(world.args("--num-questions", "25"))
    assert code == 2 and "test split has 24 questions" in err
    code, _, err = gsm8k(world.args("--num-shots", "7"))
    assert code == 2 and "training split has 6 examples" in err
    code, _, err = gsm8k(world.args("--concurrency", "0"))
    assert code == 2 and "--concurrency 0: must be in [1, 4096]" in err
    code, _, err = gsm8k(["gsm8k", "--base-url", "localhost:8000", "--data-dir", world.data_dir])
    assert code == 2 and "not an http(s)://host[:port] URL" in err
    test_file = os.path.join(world.data_dir, "test.jsonl")
    good = open(test_file).read()
    with open(test_file, "a") as f:
        f.write('{"question": "a\tb", "answer": "#### 1"}\n')  # a raw tab inside a string
    code, out, err = gsm8k(world.args())
    assert code == 2 and out == "" and err == (
        f"kimi-k3-moe gsm8k: error: GSM8K data: {test_file}: line 25 column 16: "
        "not JSON: Invalid control character at\n")
    with open(test_file, "w") as f:
        f.write(good)
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.chdir(tmp_path)
    code, _, err = gsm8k(["gsm8k", "--base-url", world.server.url])
    assert code == 2 and "put GSM8K's train.jsonl and test.jsonl" in err and "--data-dir" in err
    with pytest.raises(SystemExit) as exc:  # argparse's own usage errors are 2 as well
        gsm8k(["gsm8k", "--base-url", world.server.url, "--api", "grpc"])
    assert exc.value.code == 2
    assert not os.path.exists(world.report)

    code, _, _ = gsm8k(world.args("--num-questions", "2"))
    assert code == 0
    code, _, err = gsm8k(world.args("--num-questions", "2"))
    assert code == 2 and "exists: --resume continues it, --overwrite replaces it" in err
    code, _, _ = gsm8k(world.args("--num-questions", "2", "--overwrite"))
    assert code == 0


def test_model_choice(world, gsm8k):
    code, _, err = gsm8k(world.args("--model", "no-such-model"))
    assert code == 2 and "HTTP 404" in err and "no-such-model" in err
    errors = world.read_report()["errors"]
    assert world.server.posts <= 4 and [e["attempts"] for e in errors] == [1] * len(errors)  # no retries
    world.server.models = ["a", "b"]
    code, _, err = gsm8k(world.args("--overwrite"))
    assert code == 2 and "lists 2 models (a, b): choose one with --model" in err
    code, _, _ = gsm8k(world.args("--overwrite", "--model", "b", "--num-questions", "3"))
    assert code == 0 and {e["body"]["model"] for e in world.server.log} == {"b"}


def test_a_server_that_ignores_stop_is_cut_at_the_next_question(world, gsm8k):
    world.server.honor_stop = False
    code, out, err = gsm8k(world.args("--api", "sglang-generate"))
    assert code == 0, out + err
    report = world.read_report()
    assert (report["summary"]["strict_accuracy"], report["summary"]["flexible_accuracy"]) == (STRICT, FLEXIBLE)
    assert all(r["cut_at_stop"] and "\nQuestion: Tom" in r["reply"] for r in report["records"])


def test_console_command_exit_codes(world):
    """As a user runs it: a separate process, the gate decides the exit status."""
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "kimi_k3_moe", *world.args(*extra)],
                              capture_output=True, text=True, timeout=120)

    result = run("--threshold", "0.9")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "gate: lm-eval flexible accuracy >= 0.9: FAIL" in result.stdout
    assert json.loads(open(world.report).read())["gate"]["verdict"] == "FAIL"
    result = run("--resume", "--threshold", "0.7")
    assert result.returncode == 0 and "PASS" in result.stdout
    help_text = subprocess.run([sys.executable, "-m", "kimi_k3_moe", "gsm8k", "--help"],
                               capture_output=True, text=True).stdout
    assert "The gate reads the flexible" in help_text and "exit status: 0 pass, 1 fail, 2" in help_text

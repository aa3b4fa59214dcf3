"""Faults on the wire: each question ends up in the report exactly once, answered
or listed as an error, the report is always written, and --resume finishes."""
import json
import random
import signal
import subprocess
import sys
import time

import pytest

from .conftest import FLEXIBLE, STRICT


def _assert_exact(report, answered=24):
    ids = [r["id"] for r in report["records"]]
    assert len(ids) == len(set(ids)) == answered
    if answered == 24:
        assert ids == list(range(24)) and report["status"] == "complete"
        s = report["summary"]
        assert (s["strict_accuracy"], s["flexible_accuracy"]) == (STRICT, FLEXIBLE)


def test_transient_faults_are_retried_and_counted_once(world, gsm8k, seed):
    rng = random.Random(seed)
    kinds = ["drop", "500", "503", "stall", "garbage", "truncated", "no_choices"]
    questions = [t["question"] for t in world.test]
    plan = {q: rng.sample(kinds, rng.randint(0, 2)) for q in questions}
    for kind in kinds:  # every kind at least once
        plan[questions[kinds.index(kind)]] = [kind]
    world.server.faults = {q: list(f) for q, f in plan.items()}
    world.server.stall_s = 3.0
    code, out, err = gsm8k(world.args("--timeout", "1", "--api", "completions"))
    assert code == 0, out + err
    report = world.read_report()
    _assert_exact(report)
    attempts = {r["question"]: r["attempts"] for r in report["records"]}
    for q, faults in plan.items():
        # asked once per fault plus once more; recorded once
        assert world.server.requests[q] == len(faults) + 1 == attempts[q], (q, faults)
    assert report["errors"] == []


def test_outage_leaves_a_report_that_resume_finishes(world, gsm8k):
    def go_down(server, count):
        if count == 9:
            server.stop()  # requests already accepted are still answered
    world.server.on_request = go_down
    code, out, err = gsm8k(world.args("--retries", "2"))
    assert code == 2 and "incomplete" in err and "--resume" in err
    assert "ConnectionRefusedError" in err
    report = world.read_report()
    answered_first = {r["question"] for r in report["records"]}
    assert report["status"] == "incomplete" and 9 <= len(answered_first) <= 12  # 4 in flight
    _assert_exact(report, answered=len(answered_first))
    assert report["gate"]["passed"] is None and report["errors"]
    assert not answered_first & {world.test[e["id"]]["question"] for e in report["errors"]}
    asked_first = dict(world.server.requests)

    world.server.on_request = None
    world.server.start()  # back on the same port
    code, out, err = gsm8k(world.args("--resume", "--threshold", "0.7"))
    assert code == 0, out + err
    assert "resuming" in out and "PASS" in out
    report = world.read_report()
    _assert_exact(report)
    for q in answered_first:  # not asked again
        assert world.server.requests[q] == asked_first[q] == 1
    assert len(report["sessions"]) == 2 and report["gate"]["passed"] is True


def test_a_server_restarted_mid_run_costs_nothing(world, gsm8k):
    def bounce(server, count):
        if count == 10:
            server.restart_later(down_s=0.3)
    world.server.on_request = bounce
    code, out, err = gsm8k(world.args("--retries", "8", "--backoff", "0.05"))
    assert code == 0, out + err
    report = world.read_report()
    _assert_exact(report)
    assert max(r["attempts"] for r in report["records"]) > 1  # some requests did meet the gap


def test_a_request_the_server_refuses_stops_the_run_without_retrying(world, gsm8k):
    bad = world.test[5]["question"]
    world.server.faults = {bad: ["400"]}
    code, out, err = gsm8k(world.args("--concurrency", "1"))
    assert code == 2 and "question 5 failed after 1 attempt(s)" in err and "HTTP 400" in err
    report = world.read_report()
    assert [r["id"] for r in report["records"]] == [0, 1, 2, 3, 4]
    assert report["errors"] == [{"id": 5, "attempts": 1, "error": report["errors"][0]["error"]}]
    code, _, _ = gsm8k(world.args("--resume", "--concurrency", "1"))  # the fault was one-off
    assert code == 0
    _assert_exact(world.read_report())
    assert world.server.requests[bad] == 2


def test_resume_refuses_a_report_made_with_other_settings(world, gsm8k):
    assert gsm8k(world.args("--num-questions", "4"))[0] == 0
    code, _, err = gsm8k(world.args("--num-questions", "4", "--resume", "--num-shots", "2"))
    assert code == 2 and "num_shots: report has 3, this run 2" in err and "data_sha256" in err
    code, _, err = gsm8k(world.args("--num-questions", "4", "--resume", "--api", "chat"))
    assert code == 2 and "api: report has 'completions', this run 'chat'" in err
    code, _, err = gsm8k(world.args("--num-questions", "4", "--resume", "--protocol", "vllm"))
    assert code == 2 and "protocol: report has 'lm-eval', this run 'vllm'" in err
    with open(world.report, "w") as f:
        f.write("{not json")
    code, _, err = gsm8k(world.args("--resume"))
    assert code == 2 and "cannot read report" in err


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_writes_the_report_and_resume_finishes(world, signum, status):
    """A real process stopped while requests hang, by Ctrl-C or by SIGTERM (a CI cancel, `timeout`,
    `docker stop`, which skipped the last save): exit 128+signal, every answer on disk."""
    stalled = {t["question"] for t in world.test[6:]}
    world.server.faults = {q: ["stall"] for q in stalled}
    world.server.stall_s = 60
    cmd = [sys.executable, "-m", "kimi_k3_moe", *world.args("--timeout", "60", "--concurrency", "2")]
    # SIGINT and the signal under test at their defaults, as at a terminal, even when the suite runs as
    # a background job (the shell hands every child SIGINT ignored, and Python then installs no
    # KeyboardInterrupt) or under nohup (SIGHUP ignored, which the job rightly leaves so)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signum)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # 6 answered, 2 stalled in flight; no wait for a periodic save
            if sum(world.server.requests.values()) == 8:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the job did not ask 8 questions")
        time.sleep(0.3)  # the answers reach the job's thread
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == status, out + err
    assert "--resume finishes the run" in err
    report = json.load(open(world.report))
    assert report["status"] == "incomplete" and len(report["records"]) == 6

    world.server.release.set()  # stalls end; the server answers normally from now on
    result = subprocess.run([sys.executable, "-m", "kimi_k3_moe", *world.args("--resume")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    _assert_exact(json.load(open(world.report)))
    assert all(world.server.requests[t["question"]] == 1 for t in world.test[:6])


def test_an_unexpected_client_error_is_reported_not_lost(world, gsm8k, monkeypatch):
    """A bug in our own client, planted by patching it: no server reply can raise KeyError."""
    from kimi_k3_moe.gsm8k.client import Server
    real = Server.complete_once
    calls = []

    def flaky(self, prompt):
        calls.append(prompt)
        if len(calls) == 3:
            raise KeyError("boom")
        return real(self, prompt)
    monkeypatch.setattr(Server, "complete_once", flaky)
    code, _, err = gsm8k(world.args("--concurrency", "1"))
    assert code == 2 and "unexpected KeyError" in err
    report = world.read_report()
    assert len(report["records"]) == 2 and [e["id"] for e in report["errors"]] == [2]


def test_a_server_that_does_not_answer_gets_one_progress_line(world, gsm8k):
    """Nothing listens on the port: one line says that the job is retrying and for how
    long at most, then the error; not half a minute of silence, not a line per retry."""
    world.server.stop()
    code, out, err = gsm8k(world.args("--retries", "3"))  # the model is looked up first
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 2, err
    assert lines[0].startswith(f"kimi-k3-moe gsm8k: no answer from {world.server.url}/v1/models: ")
    assert "ConnectionRefusedError" in lines[0]
    assert lines[0].endswith("retrying, up to 3 more attempts over at most 0.07 s")
    assert lines[1].startswith("kimi-k3-moe gsm8k: error: cannot list the server's models")

    code, out, err = gsm8k(world.args("--retries", "3", "--model", "toy-gsm8k", "--overwrite"))
    notices = [line for line in err.splitlines() if "retrying" in line]
    assert code == 2 and len(notices) == 1, err  # 4 workers, each retrying, one line in all
    assert notices[0].startswith(f"kimi-k3-moe gsm8k: no answer from {world.server.url}: POST ")
    assert "error: incomplete: question" in err

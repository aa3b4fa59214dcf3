"""--timeout is a hard wall-clock deadline on each request: a server on 127.0.0.1 that sends a byte
every 0.25 s (in its headers or its body) cannot stretch it, and the report keeps what finished."""
import socket
import threading
import time

import pytest

from kimi_k3_moe.gsm8k.client import RequestFailed, Server

from .answer_server import TRICKLE_S

TIMEOUT_S = 1.0
SLACK_S = 0.75  # thread start-up on a loaded box; far below the 27 s a trickle reached before

BODY = b'{"choices": [{"text": "The answer is 18. #### 18"}]}'
HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(BODY)).encode() + b"\r\n\r\n")


class LoopbackServer:
    """Listens on 127.0.0.1 only. Per connection: reads the request, sends `at_once`, then `trickled`
    one byte every TRICKLE_S. Bounded: at most len(trickled) bytes, ending at close() or when the
    client hangs up."""

    def __init__(self, at_once: bytes, trickled: bytes):
        self.at_once, self.trickled = at_once, trickled
        self.stop = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(65536)
                conn.sendall(self.at_once)
                for k in range(len(self.trickled)):
                    if self.stop.wait(TRICKLE_S):
                        return
                    conn.sendall(self.trickled[k:k + 1])
            except OSError:  # the client shut the connection, as its deadline should
                return

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close()


@pytest.fixture(params=["body", "headers"])
def trickle(request):
    # "body": the headers at once, then the body a byte at a time; "headers": even the status line
    server = LoopbackServer(HEAD, BODY) if request.param == "body" else LoopbackServer(b"", HEAD + BODY)
    yield server
    server.close()


def test_a_trickling_server_cannot_stretch_the_deadline(trickle):
    server = Server(f"http://127.0.0.1:{trickle.port}", "completions", timeout_s=TIMEOUT_S)
    start = time.monotonic()
    with pytest.raises(RequestFailed, match=f"TimeoutError: no complete reply within {TIMEOUT_S:g} s") as caught:
        server.complete_once("Question: 1 + 1?\nAnswer:")
    took = time.monotonic() - start
    assert TIMEOUT_S - 0.05 <= took <= TIMEOUT_S + SLACK_S, took
    assert caught.value.retryable


def test_a_prompt_reply_is_unaffected():
    server = LoopbackServer(HEAD + BODY, b"")
    try:
        reply = Server(f"http://127.0.0.1:{server.port}", "completions", timeout_s=TIMEOUT_S).complete_once("Q")
        assert reply.text == "The answer is 18. #### 18"
    finally:
        server.close()


def test_the_job_ends_on_time_and_keeps_what_finished(world, gsm8k):
    slow = [t["question"] for t in world.test[:2]]
    world.server.faults = {q: ["trickle"] for q in slow}
    start = time.monotonic()
    code, out, err = gsm8k(world.args("--timeout", "1", "--retries", "0"))
    took = time.monotonic() - start
    assert code == 2, out + err
    report = world.read_report()
    assert report["status"] == "incomplete"
    assert len(report["records"]) == len(world.test) - 2
    assert {world.test[e["id"]]["question"] for e in report["errors"]} == set(slow)
    assert all("no complete reply within 1 s" in e["error"] for e in report["errors"]), report["errors"]
    assert took < 10, took  # each trickled reply alone would take ~50 s (200 bytes x 0.25 s)


def test_timeout_none_means_no_limit_and_the_job_finishes(world, gsm8k):
    code, out, err = gsm8k(world.args("--timeout", "none", "--num-questions", "4"))
    assert code == 0, out + err
    assert Server("http://127.0.0.1:1", "completions", timeout_s=None).timeout_s is None


@pytest.mark.parametrize("flag, value, needle", [
    ("--timeout", "nan", "give seconds in (0, 604800] (a week), or 'none' for no limit"),
    ("--timeout", "1e9", "give seconds in (0, 604800]"),   # a thread timer raised OverflowError past ~1e8 s
    ("--timeout", "0", "give seconds in (0, 604800]"),
    ("--timeout", "soon", "'soon' is not a number"),
    ("--retries", "1000000000", "--retries 1000000000: must be in [0, 100]"),
    ("--concurrency", "99999999", "--concurrency 99999999: must be in [1, 4096]"),
    ("--backoff", "1e308", "--backoff 1e+308: must be in (0, 3600] seconds"),
    ("--baseline", "nan", "--baseline nan: must be a finite number"),
])
def test_numbers_it_cannot_hold_are_refused_in_one_line(world, gsm8k, capsys, flag, value, needle):
    try:
        code, _out, err = gsm8k(world.args(flag, value))
    except SystemExit as exc:  # argparse's usage error, as the command line would end
        code, (_out, err) = exc.code, capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kimi-k3-moe gsm8k: error: "), err
    assert needle in lines[0], lines[0]

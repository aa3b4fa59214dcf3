"""A real HTTP server on 127.0.0.1 that plays an inference engine for the tests.

It speaks OpenAI completions and chat (/v1/completions, /v1/chat/completions,
/v1/models) and SGLang's /generate, answers each GSM8K-format prompt from an
answer key (so the expected accuracy is exact), honours `stop` as engines do,
and injects faults on request: per question, a queue of faults consumed one
per request; plus a hook that sees every request (to stop or restart the server
mid-run).
"""
from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = ("drop", "500", "503", "stall", "garbage", "truncated", "no_choices", "400", "trickle")
TRICKLE_S = 0.25  # "trickle": the reply's headers, then one byte of its body this often


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status: int, payload: bytes, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload) if length is None else length))
        self.end_headers()
        self.wfile.write(payload)

    def _json(self, status: int, obj: object) -> None:
        self._send(status, json.dumps(obj).encode())

    def do_GET(self):
        owner = self.server.owner
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in owner.models]})
        elif self.path == "/health":
            self._send(200, b"")
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self):
        owner = self.server.owner
        with owner._lock:
            owner.posts += 1
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            return self._json(400, {"error": "body is not JSON"})
        try:
            api, prompt, params = _unpack(self.path, body, owner.models)
        except LookupError as exc:
            return self._json(404, {"error": {"message": str(exc)}})
        except ValueError as exc:
            return self._json(400, {"error": {"message": str(exc)}})
        question = _question(prompt)
        if question not in owner.key:
            return self._json(400, {"error": {"message": f"unknown question {question[:60]!r}"}})
        fault = owner._arrive(question, api, body, prompt)
        if fault == "drop":  # close the connection without a byte of reply
            self.close_connection = True
            return
        if fault in ("500", "503", "400"):
            return self._json(int(fault), {"error": {"message": f"injected {fault}"}})
        if fault == "stall":
            owner.release.wait(owner.stall_s)
        if fault == "garbage":
            return self._send(200, b'{"choices": [{"text": "#### 4')
        if fault == "truncated":  # promise more bytes than are sent, then hang up
            self.close_connection = True
            return self._send(200, b'{"choices": [', length=4096)
        if fault == "no_choices":
            return self._json(200, {"object": "text_completion", "choices": []})
        reply = owner.key[question]
        if owner.honor_stop:
            cuts = [i for i in (reply.find(s) for s in params["stop"]) if i >= 0]
            reply = reply[:min(cuts)] if cuts else reply
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": len(reply.split())}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if api == "sglang-generate":
            out = {"text": reply, "meta_info": {"id": "x", "finish_reason": {"type": "stop"},
                                                "prompt_tokens": usage["prompt_tokens"],
                                                "completion_tokens": usage["completion_tokens"]}}
        elif api == "chat":
            out = {"object": "chat.completion", "model": body.get("model"), "usage": usage,
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                "finish_reason": "stop"}]}
        else:
            out = {"object": "text_completion", "model": body.get("model"), "usage": usage,
                   "choices": [{"index": 0, "text": reply, "finish_reason": "stop"}]}
        try:
            if fault == "trickle":
                return self._trickle(json.dumps(out).encode(), owner.release)
            self._json(200, out)
        except OSError:  # the client gave up on a stalled request
            pass

    def _trickle(self, payload: bytes, release: threading.Event) -> None:
        """The whole reply, one byte every TRICKLE_S: each read sees progress, so only a deadline
        on the whole request ends it early. Bounded by the payload and by `release`."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.flush()
        for k in range(len(payload)):
            if release.wait(TRICKLE_S):
                return
            self.wfile.write(payload[k:k + 1])
            self.wfile.flush()


def _unpack(path: str, body: dict, models: list[str]) -> tuple[str, str, dict]:
    """(api, prompt, sampling params), validated as strictly as an engine would."""
    if path == "/generate":
        params = body.get("sampling_params") or {}
        prompt, limit = body.get("text"), params.get("max_new_tokens")
        api = "sglang-generate"
    elif path in ("/v1/completions", "/v1/chat/completions"):
        params, limit = body, body.get("max_tokens")
        if "model" in body and body["model"] not in models:
            raise LookupError(f"The model `{body['model']}` does not exist.")
        if path == "/v1/completions":
            api, prompt = "completions", body.get("prompt")
        else:
            messages = body.get("messages")
            if not (isinstance(messages, list) and len(messages) == 1 and messages[0].get("role") == "user"):
                raise ValueError("expected one user message")
            api, prompt = "chat", messages[0].get("content")
    else:
        raise LookupError(f"no route {path}")
    if not isinstance(prompt, str):
        raise ValueError("no prompt")
    if params.get("temperature") != 0:
        raise ValueError("GSM8K is greedy: temperature must be 0")
    if not isinstance(limit, int) or limit < 1:
        raise ValueError("bad token limit")
    if not any(str(s).startswith("Question") for s in params.get("stop") or []):
        raise ValueError("stop must include Question or Question:")
    return api, prompt, params


def _question(prompt: str) -> str:
    """The test question: the text of the last `Question: ...\\nAnswer:` block."""
    head, _, last = prompt.rpartition("Question: ")
    if not last.endswith("\nAnswer:"):
        return ""
    return last[: -len("\nAnswer:")]


class AnswerServer:
    def __init__(self, key: dict[str, str], *, models=("toy-gsm8k",), honor_stop: bool = True,
                 stall_s: float = 5.0):
        self.key = key
        self.models = list(models)
        self.honor_stop = honor_stop
        self.stall_s = stall_s
        self.faults: dict[str, list[str]] = {}
        self.requests: Counter[str] = Counter()   # questions that reached the answer key
        self.posts = 0                              # every POST, valid or not
        self.log: list[dict] = []
        self.on_request = None          # called with (server, number of requests so far)
        self.release = threading.Event()  # ends every stall at once
        self._lock = threading.Lock()
        self._httpd = None
        self._thread = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _arrive(self, question: str, api: str, body: dict, prompt: str) -> str | None:
        with self._lock:
            self.requests[question] += 1
            self.log.append({"api": api, "body": body, "shots": prompt.count("Question: ") - 1,
                             "question": question})
            queue = self.faults.get(question)
            fault = queue.pop(0) if queue else None
            count = len(self.log)
        if self.on_request:
            self.on_request(self, count)
        return fault

    def start(self) -> AnswerServer:
        self._httpd = _HTTPServer(("127.0.0.1", self.port), _Handler)
        self._httpd.owner = self
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join()
            self._httpd = None

    def restart_later(self, down_s: float) -> None:
        """Stop now and come back on the same port after `down_s` seconds. Safe to call
        from a request handler: handlers run on their own threads, not the server's."""
        self.stop()

        def come_back():
            time.sleep(down_s)
            self.start()
        threading.Thread(target=come_back, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.stop()

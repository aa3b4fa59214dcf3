"""One HTTP client for three APIs: OpenAI completions, OpenAI chat, SGLang /generate.

Each request opens its own connection (a GSM8K question costs seconds of
generation; a TCP handshake is noise) so a dropped or half-read connection can
never poison the next request. The timeout is a hard wall-clock deadline on
each attempt (connect, send, headers and body together): a timer shuts the
socket down when it passes, so a server that trickles a byte at a time or
stalls mid-reply cannot stretch it, as a per-read socket timeout would let it.
"""
from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

APIS = {
    # name: (path, what it is)
    "completions": ("/v1/completions", "OpenAI completions (vLLM, SGLang)"),
    "chat": ("/v1/chat/completions", "OpenAI chat completions, the prompt as one user message"),
    "sglang-generate": ("/generate", "SGLang's native API"),
}
T = TypeVar("T")
RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class RequestFailed(Exception):
    """One attempt failed. `retryable` says whether asking again can help."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable
        self.attempts = 1


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int | None
    completion_tokens: int | None
    latency_s: float
    attempts: int = 1


def normalize_base_url(url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000': users paste OpenAI base URLs."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url {url!r} is not an http(s)://host[:port] URL")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) else None


class Server:
    """Where and how to ask: base URL, API flavour, model and generation settings."""

    def __init__(self, base_url: str, api: str, *, model: str | None = None, max_tokens: int = 256,
                 stop: Sequence[str] = (), timeout_s: float = 600.0, api_key: str | None = None):
        if api not in APIS:
            raise ValueError(f"--api {api!r}: choose one of {', '.join(APIS)}")
        self.base_url = normalize_base_url(base_url)
        self.api = api
        self.model = model
        self.max_tokens = max_tokens
        self.stop = list(stop)
        self.timeout_s = timeout_s
        self._api_key = api_key
        parts = urlsplit(self.base_url)
        self._https = parts.scheme == "https"
        self._host, self._port, self._prefix = parts.hostname, parts.port, parts.path

    # -- one attempt -----------------------------------------------------------------------------

    def _exchange(self, method: str, path: str, body: dict | None) -> object:
        """Send one request and return the decoded JSON reply, or raise RequestFailed."""
        connection_class = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = connection_class(self._host, self._port, timeout=self.timeout_s)
        deadline = _Deadline(conn, self.timeout_s)
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        where = f"{method} {self.base_url}{path}"
        try:
            with deadline:
                conn.connect()  # bounded by its own timeout of the same length
                deadline.check()  # a timer that fired before the socket existed had nothing to shut
                conn.request(method, self._prefix + path, body=data, headers=headers)
                response = conn.getresponse()
                status, raw = response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            # refused, reset, dropped, timed out, truncated: all worth another try
            if deadline.expired:  # the timer's shutdown surfaces as whatever the read saw; say why
                exc = TimeoutError(f"no complete reply within {self.timeout_s:g} s (the deadline "
                                   "bounds the whole request)")
            detail = str(exc) or "connection closed without a reply"
            raise RequestFailed(f"{where}: {type(exc).__name__}: {detail}", retryable=True) from None
        finally:
            conn.close()
        if deadline.expired:  # finished reading only because the socket was shut down
            raise RequestFailed(f"{where}: TimeoutError: no complete reply within {self.timeout_s:g} s",
                                retryable=True)
        if status != 200:
            excerpt = raw[:300].decode(errors="replace").strip()
            raise RequestFailed(f"{where}: HTTP {status}: {excerpt}", retryable=status in RETRY_STATUS)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestFailed(f"{where}: reply is not JSON ({exc}): {raw[:120]!r}",
                                retryable=True) from None

    def _request_body(self, prompt: str) -> tuple[str, dict]:
        if self.api == "sglang-generate":
            params = {"max_new_tokens": self.max_tokens, "temperature": 0, "stop": self.stop}
            return APIS[self.api][0], {"text": prompt, "sampling_params": params}
        body: dict = {"max_tokens": self.max_tokens, "temperature": 0, "stop": self.stop}
        if self.model:
            body["model"] = self.model
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return APIS[self.api][0], body

    def _parse(self, reply: object) -> tuple[str, int | None, int | None]:
        """(text, prompt tokens, completion tokens); ValueError names what is missing."""
        if not isinstance(reply, dict):
            raise ValueError(f"expected a JSON object, got {type(reply).__name__}")
        if self.api == "sglang-generate":
            text, usage = reply.get("text"), reply.get("meta_info")
        else:
            choices = reply.get("choices")
            if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
                raise ValueError("no 'choices' list in the reply")
            if self.api == "chat":
                message = choices[0].get("message")
                # a reasoning model may put everything in reasoning_content and leave content null
                text = message.get("content") if isinstance(message, dict) else None
                text = "" if text is None and isinstance(message, dict) else text
            else:
                text = choices[0].get("text")
            usage = reply.get("usage")
        if not isinstance(text, str):
            raise ValueError("the reply has no generated text field")
        usage = usage if isinstance(usage, dict) else {}
        return text, _int_or_none(usage.get("prompt_tokens")), _int_or_none(usage.get("completion_tokens"))

    def complete_once(self, prompt: str) -> Completion:
        path, body = self._request_body(prompt)
        start = time.monotonic()
        reply = self._exchange("POST", path, body)
        try:
            text, prompt_tokens, completion_tokens = self._parse(reply)
        except ValueError as exc:
            raise RequestFailed(f"POST {self.base_url}{path}: unexpected reply shape: {exc}",
                                retryable=True) from None
        return Completion(text, prompt_tokens, completion_tokens, time.monotonic() - start)

    def served_models(self) -> list[str]:
        reply = self._exchange("GET", "/v1/models", None)
        data = reply.get("data") if isinstance(reply, dict) else None
        if not isinstance(data, list):
            raise RequestFailed(f"GET {self.base_url}/v1/models: no 'data' list in the reply",
                                retryable=False)
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


class _Deadline:
    """A wall-clock limit on one connection: when it passes, the socket is shut down, which ends
    any read or write blocked on it at once (a socket timeout only bounds each single read).

    Used as a context manager around the exchange; `expired` says whether it fired."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float):
        self._conn = conn
        self._lock = threading.Lock()
        self._done = False
        self.expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.expired = True
            sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed by the other side
                pass

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()

    def check(self) -> None:
        """TimeoutError if the limit passed while nothing could be shut down (during connect)."""
        if self.expired:
            raise TimeoutError("the deadline passed while connecting")


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 5          # attempts after the first
    backoff_s: float = 1.0    # wait before the first retry; doubles each time
    max_backoff_s: float = 30.0

    def delay(self, attempt: int) -> float:
        """Wait before retry `attempt` (1-based), with jitter so that many clients
        do not come back to a restarting server in lockstep."""
        return self._base(attempt) * random.uniform(0.5, 1.0)

    def _base(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))

    def longest_wait_s(self) -> float:
        return sum(self._base(n) for n in range(1, self.retries + 1))


class RetryNotice:
    """One line, the first time anything is retried: without it a server that does
    not answer looks like a hung command for the half minute the retries take."""

    def __init__(self, what: str, policy: RetryPolicy, say: Callable[[str], None]):
        self._what, self._policy, self._say = what, policy, say
        self._lock = threading.Lock()
        self._said = False

    def __call__(self, error: RequestFailed, attempt: int, delay_s: float) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
        self._say(f"kimi-k3-moe gsm8k: {self._what}: {error}; retrying, up to {self._policy.retries} "
                  f"more attempts over at most {self._policy.longest_wait_s():.3g} s")


def with_retries(attempt: Callable[[], T], policy: RetryPolicy,
                 should_stop: Callable[[], bool] = lambda: False,
                 sleep: Callable[[float], None] = time.sleep,
                 on_retry: Callable[[RequestFailed, int, float], None] | None = None) -> tuple[T, int]:
    """Call `attempt` until it succeeds, fails for good, or the retries run out:
    (its result, attempts made). Raises the last RequestFailed, with `.attempts` set;
    `should_stop` lets the caller abandon waiting; `on_retry(error, attempt, delay)`
    hears of each retry before its wait."""
    for n in range(1, policy.retries + 2):
        try:
            return attempt(), n
        except RequestFailed as exc:
            if not exc.retryable or n > policy.retries or should_stop():
                exc.attempts = n
                raise
            delay = policy.delay(n)
            if on_retry is not None:
                on_retry(exc, n, delay)
            sleep(delay)
    raise AssertionError("unreachable")

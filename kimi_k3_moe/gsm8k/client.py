"""One HTTP client for three APIs: OpenAI completions, OpenAI chat, SGLang /generate, on aiohttp.

Requests run on one asyncio loop in a background thread, so the job's worker
threads (and tests) call a plain function. Each request has aiohttp's total
timeout: a hard wall-clock deadline on the whole attempt (connect, send, headers
and body together), so a server that trickles a byte at a time or stalls
mid-reply cannot stretch it, as a per-read socket timeout would let it. Each
request opens its own connection (`force_close`; a GSM8K question costs seconds
of generation, a TCP handshake is noise), so a dropped or half-read connection
can never poison the next request, and the connector bounds how many are open.
aiohttp is imported when a Server is made (a second on a busy machine), not
with this module: every `kimi-k3-moe` command builds this command's parser.
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import weakref
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
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: beyond it, say "none" (no limit) instead


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


def check_timeout(timeout_s: float | None, option: str = "--timeout") -> float | None:
    """None (no limit), or a number of seconds in (0, MAX_TIMEOUT_S]; else ValueError naming `option`."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"{option} {timeout_s}: give seconds in (0, {MAX_TIMEOUT_S:g}] (a week), or 'none' "
                         "for no limit")
    return float(timeout_s)


def _what_failed(exc: BaseException) -> str:
    """'ConnectionRefusedError: ...': the OS error under aiohttp's wrapper where there is one."""
    cause = getattr(exc, "os_error", None)
    name = type(cause or exc).__name__
    detail = " ".join(str(exc).split()) or "connection closed without a reply"
    return f"{name}: {detail}"


class _Loop:
    """One asyncio loop in a daemon thread, with one aiohttp session, for every request of a Server."""

    def __init__(self, connections: int):
        import aiohttp  # noqa: F401  (here, so that its import time is not charged to a request's deadline)

        self._connections = connections
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session = None  # an aiohttp.ClientSession, made on the loop

    def run(self, make: Callable[[object], object]):
        """Run the coroutine `make(session)` on the loop and wait for its result."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="gsm8k-http", daemon=True)
                self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._call(make), self._loop).result()

    async def _call(self, make):
        import aiohttp

        if self._session is None:  # made on the loop that uses it, as aiohttp requires
            connector = aiohttp.TCPConnector(limit=self._connections, force_close=True)
            self._session = aiohttp.ClientSession(connector=connector)
        return await make(self._session)

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        session, self._session = self._session, None
        if session is not None:
            closing = asyncio.run_coroutine_threadsafe(session.close(), loop)
            if threading.current_thread() is not self._thread:  # the loop's own thread cannot wait on it
                try:
                    closing.result(timeout=5)
                except Exception:  # a loop stuck on a request: the process is ending anyway
                    pass
        loop.call_soon_threadsafe(loop.stop)


class Server:
    """Where and how to ask: base URL, API flavour, model and generation settings.

    `timeout_s`: the deadline of each attempt, None for no limit; `connections`: how many requests
    may be open at once (the job's concurrency). `close()` (or `with Server(...)`) ends its session."""

    def __init__(self, base_url: str, api: str, *, model: str | None = None, max_tokens: int = 256,
                 stop: Sequence[str] = (), timeout_s: float | None = 600.0, api_key: str | None = None,
                 connections: int = 32):
        if api not in APIS:
            raise ValueError(f"--api {api!r}: choose one of {', '.join(APIS)}")
        self.base_url = normalize_base_url(base_url)
        self.api = api
        self.model = model
        self.max_tokens = max_tokens
        self.stop = list(stop)
        self.timeout_s = check_timeout(timeout_s)
        self._api_key = api_key
        self._loop = _Loop(max(1, connections))
        weakref.finalize(self, self._loop.close)  # a Server dropped without close() ends its session too

    def close(self) -> None:
        self._loop.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one attempt -----------------------------------------------------------------------------

    def _exchange(self, method: str, path: str, body: dict | None) -> object:
        """Send one request and return the decoded JSON reply, or raise RequestFailed."""
        import aiohttp

        headers = {"Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        where = f"{method} {self.base_url}{path}"
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)

        async def attempt(session) -> tuple[int, bytes]:
            async with session.request(method, self.base_url + path, json=body, headers=headers,
                                       timeout=timeout) as response:
                return response.status, await response.read()
        try:
            status, raw = self._loop.run(attempt)
        except asyncio.TimeoutError:  # the total deadline, whatever stage it cut
            raise RequestFailed(f"{where}: TimeoutError: no complete reply within {self.timeout_s:g} s (the "
                                "deadline bounds the whole request)", retryable=True) from None
        except (aiohttp.ClientError, OSError) as exc:
            # refused, reset, dropped, truncated: all worth another try
            raise RequestFailed(f"{where}: {_what_failed(exc)}", retryable=True) from None
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

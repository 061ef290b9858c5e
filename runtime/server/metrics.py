"""Server counters and their Prometheus text exposition (format 0.0.4).

The server's own series are ``moe_server_*``; the residency manager's ``moe_expert_*`` series
come verbatim from its snapshot's ``to_prometheus()`` and are appended after them.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.server.queue import QueueStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Paths counted by name; everything else (404s, scanners) is one "other" series so that a
# client cannot grow the label set without bound.
COUNTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/residency",
                 "/health", "/metrics", "/chat/completions", "/completion", "/completions",
                 "/models", "/tokenize", "/detokenize", "/apply-template", "/props", "/slots",
                 "/infill")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class ServerMetrics:
    """Thread-safe counters: requests by path and status, tokens, cancellations."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, int]] = Counter()   # (path, status) -> requests
        self._prompt_tokens = 0
        self._completion_tokens = 0
        self._cancelled = 0              # generations stopped because the client went away
        self._rejected_queue_full = 0
        self._generation_seconds = 0.0   # wall time the worker spent on generations, s

    def observe_request(self, path: str, status: int) -> None:
        label = path if path in COUNTED_PATHS else "other"
        with self._lock:
            self._requests[(label, status)] += 1

    def observe_generation(self, prompt_tokens: int, completion_tokens: int,
                           seconds: float) -> None:
        with self._lock:
            self._prompt_tokens += prompt_tokens
            self._completion_tokens += completion_tokens
            self._generation_seconds += seconds

    def observe_client_gone(self) -> None:
        """A request whose client disconnected before its answer ended (waiting in the
        queue, generating, or streaming)."""
        with self._lock:
            self._cancelled += 1

    def observe_queue_full(self) -> None:
        with self._lock:
            self._rejected_queue_full += 1

    def render(self, queue: QueueStats | None, model_ready: bool,
               residency_text: str | None) -> str:
        """The whole ``/metrics`` page."""
        with self._lock:
            requests = sorted(self._requests.items())
            scalars = (self._prompt_tokens, self._completion_tokens, self._cancelled,
                       self._rejected_queue_full, self._generation_seconds)
        prompt, completion, cancelled, rejected, seconds = scalars
        lines: list[str] = []
        lines += _family("moe_server_requests_total", "counter",
                         "HTTP requests answered, by path and status code.",
                         ((f'path="{_escape(p)}",status="{s}"', n) for (p, s), n in requests))
        lines += _family("moe_server_prompt_tokens_total", "counter",
                         "Prompt tokens processed.", [("", prompt)])
        lines += _family("moe_server_completion_tokens_total", "counter",
                         "Tokens generated.", [("", completion)])
        lines += _family("moe_server_generation_seconds_total", "counter",
                         "Wall-clock seconds spent generating.", [("", round(seconds, 6))])
        lines += _family("moe_server_requests_cancelled_total", "counter",
                         "Requests whose client disconnected before the answer ended "
                         "(in the queue or mid-answer; not errors).",
                         [("", cancelled)])
        lines += _family("moe_server_requests_rejected_total", "counter",
                         "Requests refused with 429 because the queue was full.",
                         [("", rejected)])
        lines += _family("moe_server_model_ready", "gauge",
                         "1 once the model is loaded and requests are served.",
                         [("", int(model_ready))])
        if queue is not None:
            lines += _family("moe_server_requests_running", "gauge",
                             "Requests being generated now.", [("", queue.running)])
            lines += _family("moe_server_requests_waiting", "gauge",
                             "Requests waiting in the queue.", [("", queue.waiting)])
            lines += _family("moe_server_queue_capacity", "gauge",
                             "Most requests that may wait in the queue.",
                             [("", queue.max_waiting)])
        text = "\n".join(lines) + "\n"
        if residency_text:
            text += residency_text if residency_text.endswith("\n") else residency_text + "\n"
        return text


def _family(name: str, kind: str, help_text: str,
            samples: Iterable[tuple[str, float | int]]) -> list[str]:
    out = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        out.append(f"{name}{{{labels}}} {value}" if labels else f"{name} {value}")
    return out


CLIENT_CLOSED = 499     # nginx's "client closed request": the client left before any status


class RequestCounter:
    """ASGI middleware: counts every HTTP request once, by path and status, into
    ``ServerMetrics``.

    A client that disconnects before its answer ended is a cancellation, not a server error:
    it counts under the status already sent, or ``499`` when none was (whatever the app then
    tries to send to nobody), and once in ``moe_server_requests_cancelled_total``.
    Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses and client disconnects pass
    through untouched.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500   # if the app dies before starting a response, that is what the client sees
        started = ended = gone = False

        async def watching_receive() -> Message:
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not ended:
                gone = True
            return message

        async def counting_send(message: Message) -> None:
            nonlocal status, started, ended
            if message["type"] == "http.response.start" and not gone:
                status, started = int(message["status"]), True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                ended = not gone
            await send(message)

        try:
            await self.app(scope, watching_receive, counting_send)
        finally:
            if gone:
                self.metrics.observe_client_gone()
            self.metrics.observe_request(scope.get("path", ""),
                                         status if started or not gone else CLIENT_CLOSED)

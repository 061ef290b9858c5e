"""The connections clients may hold open: a cap on their number and a deadline for each
request head, so that a client that opens connections and sends nothing, or a byte at a time
(slowloris), costs itself and not the server.

uvicorn alone accepts every connection and waits for its request head without end (its
keep-alive timeout starts after a first answer), so 20,000 half-open connections used every
file descriptor: ``/health`` timed out and the event loop logged "Too many open files" on every
accept (49 MB a minute). Its ``limit_concurrency`` would not help: past it, *every* request
is a 503, ``/health`` included. Here:

- At most ``max_connections`` are open (``--max-connections``; never more than the open-file
  limit less ``FD_RESERVE``, which the model, slot files, threads and the log need). A
  connection past the cap closes the oldest connection that sent part of a request head and
  stopped, else the oldest that waits for one (a half-open one, or an idle keep-alive), or
  itself when every other open one is inside a request: a new client gets in, a socket held
  open doing nothing is what goes.
- A request head must be complete within ``header_timeout_s`` (``--header-timeout``) of the
  connection being ready for one (opened, or its last answer sent); sending it a line at a
  time does not extend that. A head is at most ``HEAD_BYTES`` (h11's limit; uvicorn answers
  400 past it).
- The kernel's queue of completed connections is ``ACCEPT_QUEUE`` long, longer than the
  loop's accept burst (serve.py ``BACKLOG``): with a queue of 128, a flood of connects kept it
  full and the kernel dropped the SYN of a new client (a ``/health`` probe), which its TCP sent
  again only a second later; queued, it waits for the loop's next bursts instead (milliseconds).
- The log says when a limit is first hit, then at most once a minute with the count since
  (``Notice``), never once per connection; the event loop's "out of system resource" on
  accept and uvicorn's "Invalid HTTP request received." go through the same notice.

- The event loop is uvloop's where it is installed (a dependency on Linux and macOS; uvicorn's
  ``loop="auto"``): it accepts and closes connections at about half asyncio's CPU, which is
  what keeps ``/health`` under a second while 20,000 half-open connections churn
  (docs/benchmarks/2026-12-07-slowloris.md).

``guarded_server(app, limits, ...)`` is the uvicorn server that keeps them (its protocol:
``guarded_protocol(book)``, uvicorn's h11 protocol with the book kept).
"""
from __future__ import annotations

import logging
import resource
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:       # (asyncio itself costs the CLI's start 30 ms: serve --help reads this)
    import asyncio

log = logging.getLogger("moe_offload.server")

FD_RESERVE = 256             # descriptors kept for everything but held connections (the model,
                             # slot files, the log, a burst of accepts: serve.py BACKLOG)
ACCEPT_QUEUE = 4096          # connections the kernel completes and queues for accept (capped by
                             # net.core.somaxconn); the loop still takes BACKLOG at a time
MIN_CONNECTIONS = 16
HEAD_BYTES = 16 << 10        # bytes of one request head (h11's default, set explicitly)
NOTICE_EVERY_S = 60.0        # a repeated notice: at most one line a minute


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What the server lets clients hold (``serve`` flags in brackets)."""

    max_connections: int = 1024      # open client connections (--max-connections)
    header_timeout_s: float = 20.0   # s from ready to a complete request head (--header-timeout)

    def __post_init__(self) -> None:
        if self.max_connections < MIN_CONNECTIONS:
            raise ValueError(f"max_connections must be >= {MIN_CONNECTIONS}")
        if not self.header_timeout_s > 0:
            raise ValueError("header_timeout_s must be > 0")

    def within_open_files(self, open_files: int) -> ConnectionLimits:
        """These limits with ``max_connections`` lowered to fit ``open_files`` descriptors."""
        fits = max(MIN_CONNECTIONS, open_files - FD_RESERVE)
        return self if self.max_connections <= fits else replace(self, max_connections=fits)


def open_file_limit() -> int:
    """This process's soft RLIMIT_NOFILE (descriptors it may hold)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class Notice:
    """Log lines for limits hit over and over: the first hit of each kind is logged, later
    ones are counted and logged at most once every ``every_s`` seconds with the count."""

    def __init__(self, logger: logging.Logger = log, every_s: float = NOTICE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._every_s, self._clock = logger, every_s, clock
        self._last: dict[str, float] = {}        # kind -> when its last line was written
        self._unsaid: Counter[str] = Counter()   # kind -> hits since then

    def hit(self, kind: str, message: str) -> None:
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._every_s:
            self._unsaid[kind] += 1
            return
        more = self._unsaid.pop(kind, 0)
        self._last[kind] = now
        self._log.warning("%s%s", message, f" ({more} more times since the last notice)"
                          if more else "")


class ConnectionBook:
    """Open connections, and those waiting for a request head (oldest first, each with its
    deadline). Invariant: ``open`` counts connections made and not lost; every key of
    ``_waiting`` is open."""

    def __init__(self, limits: ConnectionLimits, notice: Notice) -> None:
        self.limits, self.notice = limits, notice
        self.open = 0
        self._waiting: dict[Any, asyncio.TimerHandle] = {}   # insertion order: oldest first
        # those of them that sent part of a head and stopped (the first to go: a new
        # connection whose head the loop has not read yet looks idle, and must not be
        # evicted for it under a flood of arrivals)
        self._stalled: dict[Any, None] = {}

    def opened(self, conn: Any) -> None:
        self.open += 1
        self.waits(conn)
        if self.open > self.limits.max_connections:
            # conn itself when it is the only one waiting
            victim = next(iter(self._stalled or self._waiting))
            self.notice.hit("connections", f"{self.limits.max_connections} connections are "
                            "open, this server's limit (--max-connections): each new one "
                            "closes the oldest that has sent no request")
            victim.close_idle()
            self.busy(victim)

    def waits(self, conn: Any, stalled: bool = False) -> None:
        """``conn`` is ready for a request head (``stalled``: it sent part of one): its
        deadline starts now (if not running)."""
        if conn not in self._waiting:
            self._waiting[conn] = conn.loop.call_later(self.limits.header_timeout_s,
                                                       self._expire, conn)
        if stalled:
            self._stalled.setdefault(conn)

    def busy(self, conn: Any) -> None:
        """``conn`` is inside a request (or closed): no deadline, not to be evicted."""
        handle = self._waiting.pop(conn, None)
        if handle is not None:
            handle.cancel()
        self._stalled.pop(conn, None)

    def closed(self, conn: Any) -> None:
        self.open -= 1
        self.busy(conn)

    def _expire(self, conn: Any) -> None:
        self._waiting.pop(conn, None)
        self._stalled.pop(conn, None)
        self.notice.hit("header", f"a connection sent no complete request within "
                        f"{self.limits.header_timeout_s:g} s (--header-timeout): closed")
        conn.close_idle()


def guarded_protocol(book: ConnectionBook) -> type:
    """uvicorn's h11 protocol keeping ``book``: a class for ``uvicorn.Config(http=...)``."""
    import h11  # noqa: PLC0415 - the server's, not the CLI's import time (serve --help)
    from uvicorn.protocols.http.h11_impl import H11Protocol  # noqa: PLC0415

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            book.opened(self)

        def connection_lost(self, exc: Exception | None) -> None:
            book.closed(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._track()

        def _track(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                # no request head yet (or the next one's); part of one if h11 holds bytes
                book.waits(self, stalled=bool(self.conn.trailing_data[0]))
            else:
                book.busy(self)

        def close_idle(self) -> None:
            """Close a connection that is not inside a request (h11 is told in
            ``connection_lost``, as uvicorn does there: telling it here too cost a second
            send and a caught ``LocalProtocolError`` per closed connection)."""
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


class _ToNotice(logging.Filter):
    """uvicorn's per-request warnings, said through the notice instead."""

    MESSAGES = {"Invalid HTTP request received.": "invalid HTTP requests received (a bad or "
                "over-long request head; answered 400 and closed)"}

    def __init__(self, notice: Notice) -> None:
        super().__init__()
        self.notice = notice

    def filter(self, record: logging.LogRecord) -> bool:
        said = self.MESSAGES.get(record.getMessage())
        if said is None:
            return True
        self.notice.hit(record.getMessage(), said)
        return False


def quiet_repeats(loop: asyncio.AbstractEventLoop, notice: Notice) -> None:
    """Send the event loop's accept failures (out of descriptors) and uvicorn's invalid-request
    warnings through ``notice``; other loop errors go on as before."""
    logging.getLogger("uvicorn.error").addFilter(_ToNotice(notice))
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if str(context.get("message", "")).startswith("socket.accept() out of system"):
            notice.hit("accept", f"cannot accept connections: {context.get('exception')} "
                       "(the open-file limit; --max-connections keeps below it)")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)
    loop.set_exception_handler(handler)


def guarded_server(app: Any, limits: ConnectionLimits, *, on_exit: Callable[[], None],
                   **config: Any) -> Any:
    """A ``uvicorn.Server`` for ``app`` (``config``: uvicorn.Config's other settings) whose
    connections keep ``limits``, the cap fitted under this process's open-file limit (said in
    the log when lowered), the loop's repeated errors said through one ``Notice``;
    ``on_exit()`` runs first on SIGINT / SIGTERM."""
    import asyncio  # noqa: PLC0415 - (see the module's imports)

    import uvicorn  # noqa: PLC0415

    fitted = limits.within_open_files(open_file_limit())
    if fitted != limits:
        log.info("--max-connections %d: lowered to %d, the open-file limit (ulimit -n) less "
                 "%d", limits.max_connections, fitted.max_connections, FD_RESERVE)
    notice = Notice()
    protocol = guarded_protocol(ConnectionBook(fitted, notice))

    class Server(uvicorn.Server):
        async def startup(self, sockets: list | None = None) -> None:
            quiet_repeats(asyncio.get_running_loop(), notice)
            await super().startup(sockets)
            for sock in sockets or ():      # asyncio listened with the burst's length
                sock.listen(ACCEPT_QUEUE)

        def handle_exit(self, sig: int, frame: Any) -> None:   # SIGINT / SIGTERM
            on_exit()       # (serve: answers in flight end now, not after the drain timeout)
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, http=protocol, h11_max_incomplete_event_size=HEAD_BYTES,
                                 **config))

"""Serving the alert receiver under a storm: uvicorn's configuration, the protocol in front of
it, and the heap kept out of the garbage collector's way.

A storm is 1,000 copies of one alert at once, each on its own connection, and all of them but
the first are answered from the receiver's memory (``spikeops.deployments.receiver``: ``SingleFlight``
and the fast path). What is left to pay per copy is the HTTP server, and on this 2-core machine
uvicorn's cost of one ASGI request (a scope, a request-response cycle, an event, a task, two
writes), with the receiver answering in raw ASGI, was about 40 µs of Python, several times the
answer itself (bench_receiver.py measures both). So ``StormProtocol`` sits in front of
uvicorn's protocol, on every connection, and does only this: it parses with httptools (the
parser uvicorn uses), and a complete ``POST /alerts/...`` that the fast path answers is
answered at once, in one write, with the server's default headers. Anything else, from the
first byte of the request that is not answered there, is handed to uvicorn's own
``HttpToolsProtocol``, which then serves that connection for the rest of its life, exactly as
it would have: other paths, a new or resolved alert, bad credentials, bad HTTP, a pipelined
request, ``Expect: 100-continue``, ``Connection: close``, HTTP/1.0, a query string or escaped
path, a body over 64 KiB, an error of ours.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

__all__ = ["server_config", "freeze_heap", "StormProtocol"]

#: bytes of one request held before the front gives the connection to uvicorn
MAX_HELD = 64 * 1024
#: the longest a copy waits for the first copy of its body to be begun on the full path
PARK_S = 2.0


def server_config(app: Any, host: str, port: int, **overrides: Any) -> Any:
    """uvicorn as a storm needs it (``spikeops serve`` and the benchmark's receiver both use it):
    - ``StormProtocol`` in front of uvicorn's httptools protocol, on uvloop, uvicorn's C event
      loop (named, so that a missing one is an error rather than a silent fallback to asyncio);
    - a listen backlog of 4,096: 1,000 copies connecting at once must not overflow the accept
      queue (the kernel caps it at ``net.core.somaxconn``);
    - no access log (a line per copy is a storm of its own), no proxy-headers layer (nothing here
      reads the client's address), no ``server`` header (it names the server to strangers);
    - keep-alive for 120 s, longer than Go's default idle timeout (90 s), so Alertmanager finds its
      connections open and the server never closes one the client is about to reuse;
    - 10 s for a graceful shutdown: a client that sent half a request does not hold it forever.
    One worker process, and it must stay one: the memory of started keys (``SingleFlight``) lives
    in this process, and a second worker would start its own run for the same alert."""
    import uvicorn

    options: dict[str, Any] = {"host": host, "port": port, "http": StormProtocol, "loop": "uvloop",
                               "backlog": 4096, "log_level": "warning", "access_log": False,
                               "proxy_headers": False, "server_header": False, "timeout_keep_alive": 120,
                               "timeout_graceful_shutdown": 10}
    return uvicorn.Config(app, **{**options, **overrides})


def freeze_heap() -> None:
    """Take everything alive now (Prefect, FastAPI, the app: several hundred thousand objects) out
    of the garbage collector's reach, before the server listens. A storm allocates fast (each of
    1,000 copies in flight holds a few dozen objects), which triggers a full collection every few
    thousand copies, and without this that collection walks the whole heap: about 300 ms of the
    event loop stalled on this machine, three times the p99 budget. Frozen objects are still freed
    by reference counting; only cycles among them would outlive their use."""
    gc.collect()
    gc.freeze()


class StormProtocol(asyncio.Protocol):
    """The front of every connection (the module docstring says why). Per request it holds the
    raw bytes since the last answer, so that whatever it does not answer is replayed, whole, to
    uvicorn's protocol: it answers only when a data chunk ends exactly at the end of one complete
    request (a chunk that carries the start of a second one goes to uvicorn, both requests
    unanswered), which is how every HTTP/1.1 client that does not pipeline sends."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        import httptools

        if not config.loaded:
            config.load()
        self.config, self.server_state, self.app_state = config, server_state, app_state
        self.loop = _loop or asyncio.get_event_loop()
        fast = getattr(config.loaded_app, "fast_path", None)
        self.fast = None if config.root_path else fast  # under a root path, uvicorn maps the paths
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.idle: asyncio.TimerHandle | None = None
        self.held = bytearray()
        self.parked: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.messages, self.complete, self.refused = 0, False, False
        self.url, self.body = b"", b""
        self.headers: list[tuple[bytes, bytes]] = []

    # asyncio.Protocol

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self.transport = transport
        if self.fast is None:
            self._hand_over()
        else:
            self.server_state.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        if self.idle is not None:
            self.idle.cancel()
        if self.parked is not None:
            self.parked.cancel()
            self.parked = None

    def data_received(self, data: bytes) -> None:
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None
        self.held += data
        if self.parked is not None:  # more while a copy waits (pipelining): all of it to uvicorn
            self._hand_over()
            return
        try:
            self.parser.feed_data(data)
        except Exception:  # bad HTTP, an upgrade, an error in a callback: uvicorn's to answer
            self.refused = True
        if self.refused or self.messages > 1 or len(self.held) > MAX_HELD:
            self._hand_over()
        elif self.complete:
            self._answer()

    def pause_writing(self) -> None:  # a client that does not read its answers: stop reading it
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close between requests, else let uvicorn finish this one."""
        if self.held:
            self._hand_over().shutdown()
        elif self.transport is not None:
            self.transport.close()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self.messages += 1

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"authorization" or name == b"x-spikeops-signature":
            self.headers.append((name, value))
        elif name == b"expect":
            self.refused = True

    def on_headers_complete(self) -> None:
        parser = self.parser
        url = self.url
        if parser.get_method() != b"POST" or not url.startswith(b"/alerts/") or b"?" in url or b"%" in url \
                or parser.get_http_version() != "1.1" or not parser.should_keep_alive() or parser.should_upgrade():
            self.refused = True

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True

    # the two outcomes

    def _answer(self, *, park: bool = True) -> None:
        path = self.url.decode("ascii")
        try:
            rendered = self.fast.answer(path, self.body, self.headers)  # type: ignore[union-attr]
            if rendered is None and park and self.fast.park(path, self.body, self._retry):  # type: ignore[union-attr]
                # another copy of this body is on the full path: answered when it has begun
                self.parked = self.loop.call_later(PARK_S, self._retry)
                return
        except Exception:  # never a 500 of ours here: uvicorn and the app answer it
            rendered = None
        if rendered is None:
            self._hand_over()
            return
        head = [b"HTTP/1.1 202 Accepted\r\n"]
        for name, value in self.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        head.append(rendered.tail)
        self.transport.write(b"".join(head))  # type: ignore[union-attr]
        self.server_state.total_requests += 1
        self.held.clear()
        self._reset()
        self.idle = self.loop.call_later(self.config.timeout_keep_alive, self._close_idle)

    def _retry(self) -> None:
        """A parked copy's second try (its leader has begun or ended, or ``PARK_S`` passed):
        the fast path, or uvicorn's full path; never parked again."""
        if self.parked is None:
            return  # already retried (woken, then the timer; or the other way round)
        self.parked.cancel()
        self.parked = None
        if self.transport is None or self.transport.is_closing():
            return
        self._answer(park=False)

    def _close_idle(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _hand_over(self) -> Any:
        """uvicorn's protocol takes the connection from here, from the first byte not answered."""
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        self.server_state.connections.discard(self)
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None
        if self.parked is not None:
            self.parked.cancel()
            self.parked = None
        protocol = HttpToolsProtocol(config=self.config, server_state=self.server_state, app_state=self.app_state,
                                     _loop=self.loop)
        transport, held = self.transport, bytes(self.held)
        self.transport, self.held = None, bytearray()
        protocol.connection_made(transport)
        transport.set_protocol(protocol)  # type: ignore[union-attr]
        if held:
            protocol.data_received(held)
        return protocol

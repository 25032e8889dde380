"""The receiver's HTTP front (deployments/receiver_http.py) under the real uvicorn, over real
sockets: copies answered by the front, byte for byte as uvicorn and the app would answer them,
and every other request handed to uvicorn with the connection still working after it."""

from __future__ import annotations

import gc
import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from spikeops.deployments.receiver import ReceiverConfig, create_app
from spikeops.deployments.receiver_http import MAX_HELD, StormProtocol, freeze_heap, server_config
from tests.receiver_process import wait_for
from tests.test_e2e_serve import _free

ALERT = {"version": "4", "status": "firing", "receiver": "spikeops", "alerts": [{
    "status": "firing", "startsAt": "2026-11-29T18:03:12Z", "fingerprint": "front-1",
    "labels": {"alertname": "TrainingLossNaN", "job_id": "4412", "cluster": "sim"}}]}
BODY = json.dumps(ALERT).encode()
TOKEN = "s3cret"


@contextmanager
def serving(config: ReceiverConfig | None = None, start_s: float = 0.0,
            **overrides: Any) -> Iterator[tuple[Any, int, list[str]]]:
    """The receiver under uvicorn as ``spikeops serve`` configures it, in a thread; the server,
    its port and the starter's calls (each taking ``start_s``, as Prefect's API does)."""
    import uvicorn

    calls: list[str] = []

    def starter(alert: Any, key: str) -> str:
        calls.append(key)
        time.sleep(start_s)
        return f"run-{len(calls)}"

    app = create_app(starter, config or ReceiverConfig(token=TOKEN))
    port = _free()
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, **overrides))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for("the receiver listening", lambda: server.started, 30)
    try:
        yield server, port, calls
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "uvicorn did not shut down"


def request(body: bytes = BODY, *, path: str = "/alerts/alertmanager", method: str = "POST",
            headers: dict[str, str] | None = None, version: str = "1.1") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: receiver"]
    given = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json", **(headers or {})}
    lines += [f"{name}: {value}" for name, value in given.items() if value is not None]
    if method == "POST" and "Transfer-Encoding" not in given:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body if method == "POST" else b"")


class Connection:
    """A raw HTTP/1.1 client connection that reads answers one at a time."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def answer(self) -> tuple[int, dict[str, str], bytes, bytes]:
        """(status, headers, body, the raw bytes of the answer)."""
        while b"\r\n\r\n" not in self.buffer:
            assert self._fill(), f"closed before an answer: {self.buffer!r}"
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            assert self._fill(), "closed in the middle of an answer"
            rest = self.buffer.partition(b"\r\n\r\n")[2]
        raw = head + b"\r\n\r\n" + rest[:length]
        self.buffer = rest[length:]
        return int(lines[0].split()[1]), headers, rest[:length], raw

    def closed_by_server(self, seconds: float = 10) -> bool:
        self.sock.settimeout(seconds)
        try:
            return self.sock.recv(1) == b""
        except (TimeoutError, ConnectionResetError):
            return False

    def close(self) -> None:
        self.sock.close()


def _protocols(server: Any) -> set[str]:
    return {type(connection).__name__ for connection in server.server_state.connections}


def _started(port: int) -> dict[str, Any]:
    """The first copy: it starts the flow (uvicorn and the full path answer it)."""
    first = Connection(port)
    first.send(request())
    status, _, body, _ = first.answer()
    assert status == 202 and json.loads(body)["accepted"][0]["start"] == "started"
    first.close()
    return json.loads(body)["accepted"][0]


def test_copies_are_answered_by_the_front_as_uvicorn_would_answer_them() -> None:
    with serving() as (server, port, calls):
        first = _started(port)
        copy = Connection(port)
        for _ in range(3):  # on one keep-alive connection
            copy.send(request())
            status, headers, body, raw = copy.answer()
            assert status == 202 and json.loads(body) == {"accepted": [{**first, "start": "remembered"}]}
        assert _protocols(server) == {"StormProtocol"}  # the front answered them: nothing handed over
        copy.send(request(method="GET", path="/healthz"))  # then something else on the same connection
        assert copy.answer()[:3:2] == (200, b'{"status":"ok"}') and _protocols(server) == {"HttpToolsProtocol"}
        # the same copies pipelined: uvicorn serves that connection, and the app's ASGI fast path answers
        pipelined = Connection(port)
        pipelined.send(request() * 2)
        by_uvicorn = [pipelined.answer() for _ in range(2)]
        assert "HttpToolsProtocol" in _protocols(server)
        for status_u, headers_u, body_u, _ in by_uvicorn:
            assert (status_u, body_u) == (status, body)
            assert headers_u.keys() == headers.keys() and headers_u["content-type"] == "application/json"
        assert list(headers) == ["date", "content-type", "content-length"]
        assert raw.startswith(b"HTTP/1.1 202 Accepted\r\ndate: ")
        assert calls == [first["idempotency_key"]] and server.server_state.total_requests >= 6
        copy.close()
        pipelined.close()


def test_a_request_in_pieces_or_chunked_is_answered_once_complete() -> None:
    with serving() as (server, port, calls):
        _started(port)
        connection = Connection(port)
        whole = request()
        chunked = request(b"", headers={"Transfer-Encoding": "chunked"})
        chunked += f"{len(BODY) - 9:x}\r\n".encode() + BODY[:-9] + b"\r\n9\r\n" + BODY[-9:] + b"\r\n0\r\n\r\n"
        for whole in (request(), chunked):
            for piece in (whole[:7], whole[7:60], whole[60:-5], whole[-5:]):
                connection.send(piece)
                time.sleep(0.05)
            status, _, body, _ = connection.answer()
            assert status == 202 and json.loads(body)["accepted"][0]["start"] == "remembered"
        assert _protocols(server) == {"StormProtocol"} and len(calls) == 1


@pytest.mark.parametrize("case", ["healthz", "bad-token", "no-token", "bad-json", "resolved", "new-alert",
                                  "query", "http10", "close", "expect", "large", "garbage"])
def test_everything_else_is_handed_to_uvicorn_and_answered_as_before(case: str) -> None:
    with serving() as (server, port, calls):
        first = _started(port)
        connection = Connection(port)
        resolved = {**ALERT, "alerts": [{**ALERT["alerts"][0], "status": "resolved"}]}
        new = {**ALERT, "alerts": [{**ALERT["alerts"][0], "fingerprint": "front-2"}]}
        large = {**ALERT, "alerts": [{**ALERT["alerts"][0], "annotations": {"pad": "x" * (MAX_HELD + 10)}}]}
        sends, expected = {
            "healthz": (request(method="GET", path="/healthz"), (200, {"status": "ok"})),
            "bad-token": (request(headers={"Authorization": "Bearer wrong"}), (401, {"error": "unauthorised"})),
            "no-token": (request(headers={"Authorization": None}), (401, {"error": "unauthorised"})),
            "bad-json": (request(b"{not json"), (400, None)),
            "resolved": (request(json.dumps(resolved).encode()), (202, None)),
            "new-alert": (request(json.dumps(new).encode()), (202, None)),
            "query": (request(path="/alerts/alertmanager?x=1"), (202, None)),
            "http10": (request(version="1.0"), (202, None)),
            "close": (request(headers={"Connection": "close"}), (202, None)),
            "expect": (request(headers={"Expect": "100-continue"})[:-len(BODY)], (100, None)),
            "large": (request(json.dumps(large).encode()), (202, None)),
            "garbage": (b"NOT HTTP AT ALL\r\n\r\n", (400, None)),
        }[case]
        connection.send(sends)
        if case == "expect":
            assert connection.sock.recv(100).startswith(b"HTTP/1.1 100 Continue")
            connection.send(BODY)
            expected = (202, None)
        status, _, body, _ = connection.answer()
        assert status == expected[0], body
        if expected[1] is not None:
            assert json.loads(body) == expected[1]
        answer = json.loads(body) if status in (200, 202) else None
        if case == "resolved":
            assert answer["accepted"][0]["ignored"] == "resolved"
        elif case == "new-alert":
            assert answer["accepted"][0]["start"] == "started" and len(calls) == 2
        elif status == 202:
            assert answer == {"accepted": [{**first, "start": "remembered"}]}
        assert "StormProtocol" not in _protocols(server) or case in ("http10", "close", "garbage")
        if case in ("http10", "close", "garbage"):
            assert connection.closed_by_server()
        else:  # the connection still works, now uvicorn's, and the app's fast path answers a copy
            connection.send(request())
            status, _, body, _ = connection.answer()
            assert status == 202 and json.loads(body)["accepted"][0]["start"] == "remembered"
        assert len(calls) == (2 if case == "new-alert" else 1)
        connection.close()


def test_hmac_copies_take_the_front_and_a_wrong_signature_does_not() -> None:
    key = "k3y"
    with serving(ReceiverConfig(hmac_key=key)) as (server, port, calls):
        signature = hmac.new(key.encode(), BODY, hashlib.sha256).hexdigest()
        signed = {"Authorization": None, "X-Spikeops-Signature": "sha256=" + signature}
        for start in ("started", "remembered"):
            connection = Connection(port)
            connection.send(request(headers=signed))
            status, _, body, _ = connection.answer()
            assert status == 202 and json.loads(body)["accepted"][0]["start"] == start
        assert _protocols(server) == {"StormProtocol"}  # the second copy: answered by the front
        forged = Connection(port)
        forged.send(request(headers={"Authorization": None, "X-Spikeops-Signature": "sha256=" + "0" * 64}))
        assert forged.answer()[0] == 401 and len(calls) == 1


def test_idle_connections_are_closed_and_shutdown_is_graceful() -> None:
    with serving(timeout_keep_alive=1, timeout_graceful_shutdown=2) as (server, port, _):
        _started(port)
        idle = Connection(port)
        idle.send(request())
        assert idle.answer()[0] == 202
        assert idle.closed_by_server(15)  # the keep-alive timeout, as uvicorn's
        open_one = Connection(port)
        open_one.send(request())
        assert open_one.answer()[0] == 202
        half = Connection(port)
        half.send(request()[:-10])  # a request half sent when the server is asked to stop
        wait_for("the half request held", lambda: any(isinstance(c, StormProtocol) and c.held
                                                       for c in server.server_state.connections), 10)
    # serving() has stopped the server and asserted it did, the half request notwithstanding
    # (uvicorn was handed it, and gave up on it after the graceful timeout); the connection
    # between requests was closed at once
    assert open_one.closed_by_server(5)
    half.close()


def test_server_config_and_the_frozen_heap() -> None:
    app = create_app(lambda alert, key: "run", ReceiverConfig())
    config = server_config(app, "127.0.0.1", 8787)
    assert config.http is StormProtocol and config.loop == "uvloop" and config.backlog >= 2048
    assert config.access_log is False and config.workers in (None, 1) and config.timeout_keep_alive == 120
    assert config.timeout_graceful_shutdown == 10
    assert server_config(app, "127.0.0.1", 1, backlog=10).backlog == 10
    try:
        freeze_heap()
        assert gc.get_freeze_count() > 10_000  # the heap of pytest, FastAPI, the app
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("token", [TOKEN, "wrong"])
def test_a_storm_of_a_new_alert_sends_one_copy_the_full_path(token: str) -> None:
    """All copies of a new alert arrive before the full path has run for any of them: the first
    goes the full path; the others wait at the front until it has begun the key, and are then
    answered there (in flight). With wrong credentials the leader is refused, and so is each
    waiting copy, on the full path."""
    with serving(start_s=0.5) as (server, port, calls):
        connections = [Connection(port) for _ in range(60)]
        wait_for("every connection accepted", lambda: len(server.server_state.connections) >= 60, 10)
        copy = request(headers={"Authorization": f"Bearer {token}"})
        for connection in connections:
            connection.send(copy)
        answers = [connection.answer() for connection in connections]
        handed = sum(1 for c in server.server_state.connections if type(c).__name__ == "HttpToolsProtocol")
        if token == TOKEN:
            assert [a[0] for a in answers] == [202] * 60
            starts = [json.loads(a[2])["accepted"][0]["start"] for a in answers]
            assert starts.count("started") == 1 and set(starts) <= {"started", "in-flight", "remembered"}
            assert len(calls) == 1 and handed == 1, (handed, starts)
        else:
            assert [a[0] for a in answers] == [401] * 60 and calls == []
            assert handed == 60  # each refused by the full path, as before
        for connection in connections:
            connection.close()

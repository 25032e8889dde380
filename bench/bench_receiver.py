"""Benchmark: the alert receiver under a storm of duplicates, against a real Prefect server.

What Alertmanager really sends in a storm is the same alert many times at once (every replica,
every group and repeat interval, every retry). This sends N copies of one alert concurrently
and times each answer:

- a real `prefect server start` (SQLite in a temporary PREFECT_HOME), the incident deployment
  registered on it;
- the real receiver (`deployments.receiver.create_app` with `tasks.start.prefect_starter` and the
  Prefect event emitter, as `spikeops serve` builds it) under uvicorn (httptools, uvloop), in its
  own process (`tests/receiver_process.py`), which counts its calls to the starter, every HTTP
  request it makes to the Prefect API and the events it emits;
- N keep-alive connections opened first (as Alertmanager keeps them), then N requests written
  at once; each latency runs from its request's write to its full answer, read by a plain
  asyncio client in this process (it shares the machine's cores with the receiver and the
  Prefect server, as a colocated Alertmanager would);
- flow runs created: counted on the Prefect server afterwards.

Rows: the floor (a no-op ASGI app that answers 202 at once, under the same uvicorn and client:
what the HTTP stack and the client cost on this machine, whatever the receiver does); a fresh
alert (the first copy starts the flow, the others arrive while it is in flight); the same alert
again (every copy remembered); and the baseline, the receiver before issue 19
(`coalesce=False`: every copy asks Prefect, which deduplicates by the key), at 100 copies, as
the issue measured it. Run by hand: `python bench/bench_receiver.py [--copies 1000] [--repeat 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.receiver_process import prefect_env  # noqa: E402
from tests.test_e2e_serve import BIN, _free, _stop, _wait_http  # noqa: E402

TIMEOUT_S = 30.0


# ---------------------------------------------------------------------------- the storm


def _request(body: bytes) -> bytes:
    return (b"POST /alerts/alertmanager HTTP/1.1\r\nHost: receiver\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return status, await reader.readexactly(length)


async def storm(port: int, alert: dict[str, Any], copies: int) -> dict[str, Any]:
    """``copies`` concurrent POSTs of one alert on pre-opened connections; latencies in ms."""
    connections = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(copies)))
    request = _request(json.dumps(alert).encode())
    sent: list[float] = []
    for _, writer in connections:
        sent.append(time.perf_counter())
        writer.write(request)

    async def one(index: int) -> tuple[int, float, str | None]:
        reader, writer = connections[index]
        try:
            status, body = await asyncio.wait_for(_answer(reader), TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            return 0, float("inf"), None
        finally:
            writer.close()
        latency = (time.perf_counter() - sent[index]) * 1000
        how = None
        if status == 202:
            how = json.loads(body)["accepted"][0].get("start", "(no single-flight)")
        return status, latency, how

    results = await asyncio.gather(*(one(i) for i in range(copies)))
    latencies = sorted(r[1] for r in results)
    answered = [v for v in latencies if v != float("inf")]
    hows: dict[str, int] = {}
    for _, _, how in results:
        if how:
            hows[how] = hows.get(how, 0) + 1
    return {
        "copies": copies, "accepted": sum(1 for r in results if r[0] == 202),
        "unanswered": copies - len(answered),
        "p50": statistics.median(latencies), "p99": latencies[max(0, int(round(0.99 * copies)) - 1)],
        "max": latencies[-1], "hows": hows,
    }


def serve_noop(port: int) -> None:
    """The floor: a no-op ASGI app answering 202 under the same uvicorn (httptools, uvloop)."""
    import uvicorn

    payload = b'{"accepted": [{"start": "no-op"}]}'

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 202, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", backlog=4096,
                                  timeout_keep_alive=120)).run()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.loads(answer.read())


def _flow_runs(api: str) -> int:
    request = urllib.request.Request(f"{api}/flow_runs/count", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return int(json.loads(answer.read()))


def _alert(tag: str) -> dict[str, Any]:
    return {"version": "4", "status": "firing", "receiver": "spikeops", "alerts": [{
        "status": "firing", "startsAt": "2026-11-29T18:03:12Z", "fingerprint": f"bench-{tag}",
        "labels": {"alertname": "TrainingLossNaN", "job_id": "4412", "cluster": "sim", "severity": "page"}}]}


def run(work: Path, copies: int, repeat: int, baseline_copies: int) -> list[dict[str, Any]]:
    prefect_port = _free()
    api = f"http://127.0.0.1:{prefect_port}/api"
    config = work / "spikeops.toml"
    config.write_text(f'[incidents]\ndir = "{work}/incidents"\n'
                      f'[clusters.sim]\ninventory = "{work}/inventory.toml"\nrun_dir = "{work}/run"\n'
                      'scheduler = "local"\n')
    env = prefect_env(work, api)
    logs = open(work / "servers.log", "wb")  # noqa: SIM115
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                               str(prefect_port)], env=env, stdout=logs, stderr=subprocess.STDOUT,
                              start_new_session=True)
    rows = []
    try:
        _wait_http(f"{api}/health", 120, server)
        port = _free()
        floor = subprocess.Popen([sys.executable, __file__, "--noop", str(port)], cwd=ROOT, env=env, stdout=logs,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_http(f"http://127.0.0.1:{port}/healthz", 60, floor)
            for attempt in range(repeat):
                row = _uvloop_run(storm(port, _alert("noop"), copies))
                row.update(case="floor: a no-op ASGI app, same uvicorn", attempt=attempt, starter_calls=0,
                           api_requests=0, events=0, flow_runs=0)
                rows.append(row)
                print(_line(row), flush=True)
        finally:
            _stop(floor)
        for baseline in (False, True):
            port = _free()
            child = subprocess.Popen([sys.executable, "-m", "tests.receiver_process", str(port), str(config),
                                      "--no-record", *(["--no-coalesce"] if baseline else [])], cwd=ROOT,
                                     env=env, stdout=logs, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                _wait_http(f"http://127.0.0.1:{port}/healthz", 120, child)
                for attempt in range(repeat):
                    tag = f"{'base' if baseline else 'sf'}-{attempt}"
                    cases = [("baseline: every copy asks Prefect", _alert(tag), baseline_copies)] if baseline else [
                        ("single-flight, a fresh alert", _alert(tag), copies),
                        ("single-flight, the same alert again", _alert(tag), copies)]
                    for name, alert, count in cases:
                        runs_before = _flow_runs(api)
                        stats_before = _get(f"http://127.0.0.1:{port}/test/record")
                        row = _uvloop_run(storm(port, alert, count))
                        time.sleep(1.0)  # let late answers' Prefect calls land before counting
                        stats = _get(f"http://127.0.0.1:{port}/test/record")
                        row.update(case=name, attempt=attempt,
                                   starter_calls=stats["starter_calls"] - stats_before["starter_calls"],
                                   api_requests=stats["api_requests"] - stats_before["api_requests"],
                                   events=stats["events"] - stats_before["events"],
                                   flow_runs=_flow_runs(api) - runs_before)
                        rows.append(row)
                        print(_line(row), flush=True)
            finally:
                _stop(child)
    finally:
        _stop(server)
        logs.close()
    return rows


def _uvloop_run(coroutine: Any) -> Any:
    """The client on uvloop too: the default loop's own cost per answer would be measured."""
    import uvloop

    return uvloop.run(coroutine)


def _ms(value: float) -> str:
    return "—" if value == float("inf") else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _line(row: dict[str, Any]) -> str:
    hows = ", ".join(f"{k} {v}" for k, v in sorted(row["hows"].items()))
    return (f"| {row['case']} | {row['copies']} | {row['accepted']} | {row['unanswered']} | {_ms(row['p50'])} | "
            f"{_ms(row['p99'])} | {_ms(row['max'])} | {row['starter_calls']} | {row['api_requests']} | "
            f"{row['events']} | {row['flow_runs']} | {hows} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=1000, help="concurrent copies of one alert (default 1000)")
    parser.add_argument("--baseline-copies", type=int, default=100,
                        help="copies for the baseline without single-flight (default 100, as in issue 19)")
    parser.add_argument("--repeat", type=int, default=3, help="storms of each kind (default 3)")
    parser.add_argument("--noop", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.noop:
        serve_noop(args.noop)
        return 0
    print("| storm | copies | 202 | unanswered (30 s) | p50 ms | p99 ms | max ms | starter calls | "
          "Prefect API requests | events | flow runs created | answered as |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    with tempfile.TemporaryDirectory(prefix="spikeops-bench-receiver-") as tmp:
        run(Path(tmp), args.copies, args.repeat, args.baseline_copies)
    return 0


if __name__ == "__main__":
    sys.exit(main())

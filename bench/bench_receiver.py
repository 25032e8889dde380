"""Benchmark: the alert receiver under a storm of duplicates, against a real Prefect server.

What Alertmanager really sends in a storm is the same alert many times at once (every replica,
every group and repeat interval, every retry). This sends N copies of one alert at once and
times each answer:

- a real `prefect server start` (SQLite in a temporary PREFECT_HOME), the incident deployment
  registered on it;
- the real receiver (`spikeops.deployments.receiver.create_app` with `spikeops.tasks.start.prefect_starter` and
  the Prefect event emitter, served as `spikeops serve` serves it: `receiver_http.server_config`,
  the frozen heap) in its own process (`tests/receiver_process.py`), which counts its calls to the
  starter, every HTTP request it makes to the Prefect API and the events it emits;
- flow runs created: counted on the Prefect server afterwards;
- the server's CPU per copy: its threads' time on a CPU (/proc/PID/task/*/schedstat, user and
  kernel) during the storm, divided by the copies. On one event loop, copies x CPU per copy is
  the least time the last copy can wait.

Clients, all on this machine (it has 2 cores, which the client shares with the server, as a
colocated Alertmanager would):
- `c`: `bench/storm.c` (built here with cc): N keep-alive connections opened first and left to
  be accepted (0.5 s), then the N requests written as fast as a loop goes; each latency runs from
  its request's write to the last byte of its answer. It costs a write and a read per copy, so
  what it measures is the server. `c-new`: the same with new connections, all connects at once,
  each latency from its connect (handshake and accept included).
- `python`: the same storm from an asyncio client on uvloop (the first pass's client): it spends
  about as much CPU per copy as the server, on the same two cores.
- `wrk` (Debian's): sustained load instead of one storm, 1,000 connections each sending the
  copy again as soon as it is answered for `--wrk-seconds`; latency = 1,000 / throughput.

Servers (rows):
- floor, raw protocol: httptools and uvloop answering a fixed 202 from an asyncio protocol, no
  ASGI: what Python, the event loop and the kernel cost per copy on this machine;
- floor, no-op ASGI app under uvicorn's own httptools protocol: what uvicorn's ASGI costs;
- the receiver, a fresh alert (the first copy starts the flow, the others arrive while it is in
  flight), the same alert again (every copy remembered), and remembered on new connections;
- `spikeops serve` itself, where the receiver shares its process with Prefect's runner (the
  flow run of the first copy has ended before the storm; the CPU is the whole process's);
- the receiver under uvicorn's own protocol (`--http httptools`, no front: the raw ASGI fast path
  in front of FastAPI answers the copies);
- the baseline, the receiver before issue 19 (`coalesce=False`: every copy asks Prefect, which
  deduplicates by the key), at 100 copies, as the issue measured it.

The machine is shared: `--max-load` waits (up to `--load-wait` s) before each storm until the
1-minute load average is under it, and each row says the load it ran at.
Run by hand: `python bench/bench_receiver.py [--copies 1000] [--repeat 3] [--clients c,python,wrk]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.receiver_process import prefect_env  # noqa: E402
from tests.test_e2e_serve import BIN, _free, _stop, _wait_http  # noqa: E402

TIMEOUT_S = 30.0
SETTLE_S = 0.5  # after the connections are open, before the storm: the server accepts them


# ---------------------------------------------------------------------------- measuring


def cpu_ns(pid: int) -> int:
    """Time on a CPU (user and kernel) of all the threads of ``pid``, in ns."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_for_quiet(max_load: float, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while load() >= max_load and time.monotonic() < deadline:
        time.sleep(5)


def _summary(latencies_us: list[float], statuses: list[int], hows: list[str | None]) -> dict[str, Any]:
    copies = len(latencies_us)
    ordered = sorted(latencies_us)
    answered = [v for v in ordered if v != float("inf")]
    counts: dict[str, int] = {}
    for how in hows:
        if how:
            counts[how] = counts.get(how, 0) + 1
    return {"copies": copies, "accepted": sum(1 for s in statuses if s == 202), "unanswered": copies - len(answered),
            "p50": statistics.median(ordered) / 1000, "p99": ordered[max(0, int(round(0.99 * copies)) - 1)] / 1000,
            "max": ordered[-1] / 1000, "hows": counts}


# ---------------------------------------------------------------------------- the clients


def build_storm(work: Path) -> Path | None:
    """bench/storm.c, compiled; None (and said) without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("no C compiler (apt-get install gcc): the c client is skipped", file=sys.stderr)
        return None
    binary = work / "storm"
    subprocess.run([cc, "-O2", "-o", str(binary), str(ROOT / "bench" / "storm.c")], check=True)
    return binary


def _request(body: bytes) -> bytes:
    return (b"POST /alerts/alertmanager HTTP/1.1\r\nHost: receiver\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def storm_c(binary: Path, work: Path, port: int, alert: dict[str, Any], copies: int, pid: int,
            new_connections: bool = False) -> dict[str, Any]:
    request = work / "request.http"
    request.write_bytes(_request(json.dumps(alert).encode()))
    args = [str(binary), "-c", str(copies), "-t", str(int(TIMEOUT_S * 1000))]
    args += ["-n"] if new_connections else ["-g"]
    client = subprocess.Popen([*args, str(port), str(request)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    if not new_connections:
        line = client.stderr.readline().strip()  # type: ignore[union-attr]
        if line != "ready":
            client.kill()
            raise RuntimeError(f"storm client: {line or client.stderr.read()}")  # type: ignore[union-attr]
        time.sleep(SETTLE_S)
    before = cpu_ns(pid)
    if not new_connections:
        client.stdin.write("go\n")  # type: ignore[union-attr]
        client.stdin.flush()  # type: ignore[union-attr]
    out, err = client.communicate()
    cpu = cpu_ns(pid) - before
    if client.returncode:
        raise RuntimeError(f"storm client exited {client.returncode}: {err.strip()}")
    rows = [line.split() for line in out.splitlines()]
    latencies = [float("inf") if row[1] == "-1" else float(row[1]) for row in rows]
    row = _summary(latencies, [int(r[0]) for r in rows], [None if r[2] == "-" else r[2] for r in rows])
    row["cpu_us"] = cpu / 1000 / copies
    return row


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return status, await reader.readexactly(length)


async def _storm_python(port: int, alert: dict[str, Any], copies: int, pid: int) -> dict[str, Any]:
    connections = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(copies)))
    await asyncio.sleep(SETTLE_S)
    request = _request(json.dumps(alert).encode())
    before = cpu_ns(pid)
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
        latency = (time.perf_counter() - sent[index]) * 1e6
        how = json.loads(body)["accepted"][0].get("start", "(no single-flight)") if status == 202 else None
        return status, latency, how

    results = await asyncio.gather(*(one(i) for i in range(copies)))
    cpu = cpu_ns(pid) - before
    for _, writer in connections:
        writer.close()
    row = _summary([r[1] for r in results], [r[0] for r in results], [r[2] for r in results])
    row["cpu_us"] = cpu / 1000 / copies
    return row


def storm_python(port: int, alert: dict[str, Any], copies: int, pid: int) -> dict[str, Any]:
    import uvloop  # the client on uvloop too: the default loop's own cost per answer would be measured

    return uvloop.run(_storm_python(port, alert, copies, pid))


def sustained_wrk(work: Path, port: int, alert: dict[str, Any], connections: int, seconds: int,
                  pid: int) -> dict[str, Any]:
    body = work / "body.json"
    body.write_bytes(json.dumps(alert).encode())
    before = cpu_ns(pid)
    done = subprocess.run(["wrk", "-t", "1", "-c", str(connections), "-d", f"{seconds}s", "--timeout", f"{int(TIMEOUT_S)}s",
                           "-s", str(ROOT / "bench" / "storm.lua"), f"http://127.0.0.1:{port}/alerts/alertmanager",
                           "--", str(body)], capture_output=True, text=True, timeout=seconds + 120)
    cpu = cpu_ns(pid) - before
    summary = next((json.loads(line) for line in reversed(done.stdout.splitlines()) if line.startswith("{")), None)
    if done.returncode or summary is None:
        raise RuntimeError(f"wrk exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    requests = summary["requests"]
    return {"copies": requests, "accepted": requests - summary["errors"]["status"],
            "unanswered": summary["errors"]["timeout"] + summary["errors"]["read"],
            "errors": sum(summary["errors"].values()), "rps": requests / (summary["duration_us"] / 1e6),
            "p50": summary["p50_us"] / 1000, "p99": summary["p99_us"] / 1000, "max": summary["max_us"] / 1000,
            "hows": {}, "cpu_us": cpu / 1000 / max(1, requests)}


# ---------------------------------------------------------------------------- the floors


def serve_floor(kind: str, port: int) -> None:
    """``raw``: an asyncio protocol on uvloop, httptools parsing, one write of a fixed 202.
    ``asgi``: a no-op ASGI app under uvicorn's own httptools protocol, same uvicorn settings."""
    from spikeops.deployments.receiver_http import freeze_heap, server_config

    payload = (b'{"accepted": [{"job": "4412", "status": "firing", "flow_run": "00000000-0000-0000-0000-000000000000",'
               b' "idempotency_key": "alert-00000000000000000000000000000000", "start": "floor"}]}')
    if kind == "raw":
        import httptools
        import uvloop

        answer = (b"HTTP/1.1 202 Accepted\r\ncontent-type: application/json\r\ncontent-length: "
                  + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        health = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

        class Floor(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                self.transport, self.parser, self.url = transport, httptools.HttpRequestParser(self), b""

            def data_received(self, data: bytes) -> None:
                self.parser.feed_data(data)

            def on_url(self, url: bytes) -> None:
                self.url = url

            def on_message_complete(self) -> None:
                self.transport.write(health if self.url == b"/healthz" else answer)

        async def main() -> None:
            server = await asyncio.get_running_loop().create_server(Floor, "127.0.0.1", port, backlog=4096)
            await server.serve_forever()

        freeze_heap()
        uvloop.run(main())
        return
    import uvicorn

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 202, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    server = uvicorn.Server(server_config(app, "127.0.0.1", port, http="httptools"))
    freeze_heap()
    server.run()


# ---------------------------------------------------------------------------- the run


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return json.loads(answer.read())


def _post(port: int, alert: dict[str, Any]) -> Any:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/alerts/alertmanager", data=json.dumps(alert).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def _nothing() -> dict[str, int]:
    """A floor's counters: it calls nothing."""
    return {"starter_calls": 0, "api_requests": 0, "events": 0, "flow_runs": 0}


def _wait_ended(api: str, run: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = (_get(f"{api}/flow_runs/{run}").get("state") or {}).get("type")
        if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return
        time.sleep(1)
    print(f"flow run {run} still not ended after {seconds:.0f} s; storming anyway", file=sys.stderr)


def _flow_runs(api: str) -> int:
    request = urllib.request.Request(f"{api}/flow_runs/count", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return int(json.loads(answer.read()))


def _alert(tag: str) -> dict[str, Any]:
    return {"version": "4", "status": "firing", "receiver": "spikeops", "alerts": [{
        "status": "firing", "startsAt": "2026-11-29T18:03:12Z", "fingerprint": f"bench-{tag}",
        "labels": {"alertname": "TrainingLossNaN", "job_id": "4412", "cluster": "sim", "severity": "page"}}]}


class Bench:
    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        self.work, self.args = work, args
        self.clients = args.clients.split(",")
        self.storm = build_storm(work) if {"c", "c-new"} & set(self.clients) else None
        if "wrk" in self.clients and shutil.which("wrk") is None:
            print("no wrk (apt-get install wrk): the wrk client is skipped", file=sys.stderr)
            self.clients.remove("wrk")
        self.logs = open(work / "servers.log", "wb")  # noqa: SIM115
        self.rows: list[dict[str, Any]] = []
        self.tag = 0

    def start(self, argv: list[str], env: dict[str, str], port: int) -> subprocess.Popen:
        child = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.logs, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        _wait_http(f"http://127.0.0.1:{port}/healthz", 120, child)
        return child

    def one(self, case: str, client: str, port: int, pid: int, alert: dict[str, Any], copies: int,
            counts: Callable[[], dict[str, int]] | None = None) -> None:
        wait_for_quiet(self.args.max_load, self.args.load_wait)
        at_load = load()
        before = counts() if counts else {}
        if client == "wrk":
            row = sustained_wrk(self.work, port, alert, copies, self.args.wrk_seconds, pid)
        elif client == "python":
            row = storm_python(port, alert, copies, pid)
        else:
            assert self.storm is not None
            row = storm_c(self.storm, self.work, port, alert, copies, pid, new_connections=client == "c-new")
        after = {}
        if counts:
            time.sleep(1.0)  # let late answers' Prefect calls land before counting
            after = counts()
        row.update(case=case, client=client, load=at_load,
                   **{key: after[key] - before[key] if key in after else None
                      for key in ("starter_calls", "api_requests", "events", "flow_runs")})
        self.rows.append(row)
        print(_line(row), flush=True)

    def run(self) -> None:
        args, work = self.args, self.work
        prefect_port = _free()
        api = f"http://127.0.0.1:{prefect_port}/api"
        config = work / "spikeops.toml"
        config.write_text(f'[incidents]\ndir = "{work}/incidents"\n'
                          f'[clusters.sim]\ninventory = "{work}/inventory.toml"\nrun_dir = "{work}/run"\n'
                          f'scheduler = "local"\nscheduler_state_dir = "{work}/sched"\n')
        # what spikeops serve checks before it starts; the flow run itself fails at its preflight
        (work / "inventory.toml").write_text('[cluster]\nname = "sim"\nnodes = "node-1"\n[hosts]\n"node-1" = "127.0.0.1"\n')
        for folder in ("incidents", "run", "sched"):
            (work / folder).mkdir()
        env = prefect_env(work, api)
        server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                   str(prefect_port)], env=env, stdout=self.logs, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        storms = [c for c in self.clients if c in ("c", "python")]
        try:
            _wait_http(f"{api}/health", 120, server)
            floors = {"raw": "floor: raw protocol (httptools, uvloop), no ASGI",
                      "asgi": "floor: no-op ASGI app, uvicorn's own protocol"}
            for kind, name in floors.items():
                if kind not in args.floors.split(","):
                    continue
                port = _free()
                floor = self.start([sys.executable, __file__, "--floor", kind, str(port)], env, port)
                try:
                    for attempt in range(args.repeat):
                        for client in storms + (["wrk"] if "wrk" in self.clients and attempt == 0 else []):
                            self.one(name, client, port, floor.pid, _alert("floor"), args.copies, _nothing)
                finally:
                    _stop(floor)
            for variant in args.variants.split(","):
                port = _free()
                if variant == "serve":
                    child = self.start([str(BIN / "spikeops"), "serve", "--config", str(config), "--addr",
                                        f"127.0.0.1:{port}"], env, port)
                else:
                    extra = {"front": [], "plain": ["--http", "httptools"], "baseline": ["--no-coalesce"]}[variant]
                    child = self.start([sys.executable, "-m", "tests.receiver_process", str(port), str(config),
                                        "--no-record", *extra], env, port)

                def counts(port: int = port, variant: str = variant) -> dict[str, int]:
                    if variant == "serve":  # no counters in the real thing: the runs it created
                        return {"flow_runs": _flow_runs(api)}
                    record = _get(f"http://127.0.0.1:{port}/test/record")
                    return {"starter_calls": record["starter_calls"], "api_requests": record["api_requests"],
                            "events": record["events"], "flow_runs": _flow_runs(api)}

                try:
                    for attempt in range(args.repeat):
                        self.variant(variant, port, child.pid, counts, storms, attempt, api)
                finally:
                    _stop(child)
        finally:
            _stop(server)
            self.logs.close()

    def variant(self, variant: str, port: int, pid: int, counts: Callable[[], dict[str, int]],
                storms: list[str], attempt: int, api: str) -> None:
        args = self.args
        if variant == "serve":
            # spikeops serve: the receiver shares its process with the runner, which runs the flow
            # the first copy starts (here it fails at its preflight: no inventory). Once that run
            # has ended, the storm of copies: what a storm costs while the runner only polls.
            self.tag += 1
            alert = _alert(f"serve-{self.tag}")
            run = _post(port, alert)["accepted"][0]["flow_run"]
            _wait_ended(api, run, 180)
            for client in storms:
                self.one("spikeops serve (the runner in the same process): the same alert again", client, port, pid,
                         alert, args.copies, counts)
            return
        if variant == "baseline":
            self.tag += 1
            self.one("baseline: the receiver before issue 19, every copy asks Prefect", storms[0], port, pid,
                     _alert(f"base-{self.tag}"), args.baseline_copies, counts)
            return
        name = "the receiver" if variant == "front" else "the receiver under uvicorn's own protocol (no front)"
        for client in storms:
            self.tag += 1
            alert = _alert(f"{variant}-{self.tag}")
            if variant == "front":
                self.one(f"{name}: a fresh alert", client, port, pid, alert, args.copies, counts)
            else:  # its first copy alone, then the storm of copies
                _post(port, alert)
                time.sleep(1.0)  # its Prefect calls, before the storm counts its own
            self.one(f"{name}: the same alert again", client, port, pid, alert, args.copies, counts)
        if variant == "front" and "c-new" in self.clients:
            self.one(f"{name}: the same alert again, on new connections", "c-new", port, pid, alert, args.copies,
                     counts)
        if "wrk" in self.clients and attempt == 0:
            self.one(f"{name}: the same alert, sustained for {args.wrk_seconds} s", "wrk", port, pid, alert,
                     args.copies, counts)


def _ms(value: float) -> str:
    return "—" if value == float("inf") else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _line(row: dict[str, Any]) -> str:
    hows = ", ".join(f"{k} {v}" for k, v in sorted(row["hows"].items()))
    rate = f" ({row['rps']:.0f}/s)" if "rps" in row else ""
    return (f"| {row['case']} | {row['client']} | {row['load']:.1f} | {row['copies']}{rate} | {row['accepted']} | "
            f"{row['unanswered']} | {_ms(row['p50'])} | {_ms(row['p99'])} | {_ms(row['max'])} | {row['cpu_us']:.0f} | "
            f"{_n(row['starter_calls'])} ({_n(row['api_requests'])}) | {_n(row['events'])} | {_n(row['flow_runs'])} | "
            f"{hows} |")


def _n(value: int | None) -> str:
    return "—" if value is None else str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=1000, help="concurrent copies of one alert (default 1000)")
    parser.add_argument("--baseline-copies", type=int, default=100,
                        help="copies for the baseline without single-flight (default 100, as in issue 19)")
    parser.add_argument("--repeat", type=int, default=3, help="storms of each kind and client (default 3)")
    parser.add_argument("--clients", default="c,c-new,python,wrk",
                        help="of c, c-new, python, wrk (default all): see the module docstring")
    parser.add_argument("--variants", default="front,serve,plain,baseline",
                        help="receivers to storm, of front (the receiver), serve (spikeops serve itself), plain "
                             "(no front), baseline (before issue 19); default all")
    parser.add_argument("--floors", default="raw,asgi", help="floors to storm, of raw, asgi (default both; '' none)")
    parser.add_argument("--wrk-seconds", type=int, default=10, help="length of a sustained wrk run (default 10)")
    parser.add_argument("--max-load", type=float, default=4.0,
                        help="wait before each storm until the 1-minute load average is under this (default 4)")
    parser.add_argument("--load-wait", type=float, default=300, help="but no longer than this, in s (default 300)")
    parser.add_argument("--floor", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the servers it started
    if args.floor:
        serve_floor(args.floor[0], int(args.floor[1]))
        return 0
    print(f"# {os.cpu_count()} CPUs; load average now {load():.1f}; the load column is the 1-minute average at "
          "the start of each row")
    print("| storm | client | load | copies | 202 | unanswered (30 s) | p50 ms | p99 ms | max ms | server CPU µs/copy | "
          "starter calls (Prefect API requests) | events | flow runs created | answered as |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    with tempfile.TemporaryDirectory(prefix="spikeops-bench-receiver-") as tmp:
        Bench(Path(tmp), args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

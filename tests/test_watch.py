"""``spikeops watch``: the detector fires exactly once per incident and never on healthy
curves; the sources follow real files (a writer thread, partial lines, truncation, rotation),
a Megatron log and a local Prometheus HTTP API; the CLI answers bad input with one line."""

from __future__ import annotations

import argparse
import io
import json
import math
import threading
import time
from dataclasses import replace
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spikeops.config import load_config
from spikeops.errors import InputError, SpikeopsError
from spikeops.probes.training_log import LineReader, parse
from spikeops.sim import CAUSES, build_bundle
from spikeops.watch import Detector, WatchConfig, alert_payload, post_to_receiver, watch
from spikeops.watch.cli import add_parser, run
from spikeops.watch.sources import SourceStats, follow_log, follow_metrics, poll_prometheus
from tests.watch_curves import Curve, healthy, jsonl, megatron_lines


def _incidents(records: list[dict[str, Any]], config: WatchConfig | None = None) -> list[tuple[str, int]]:
    detector = Detector(config)
    for record in records:
        detector.feed(record)
    return [(anomaly.kind, anomaly.step) for anomaly in detector.incidents]


# --------------------------------------------------------------------------- healthy runs


@pytest.mark.parametrize("seed,fp16,schedule", [
    (11, True, "cosine"), (12, True, "linear"), (13, False, "cosine"), (14, False, "linear"),
    (15, True, "cosine"), (16, True, "linear"), (17, False, "cosine"), (18, True, "cosine"),
])
def test_healthy_curves_never_fire(seed: int, fp16: bool, schedule: str) -> None:
    curve = healthy(seed, n=5000, fp16=fp16, schedule=schedule)
    if fp16:  # the curve really breathes: overflow steps (inf grad norm) and regrowth
        assert curve.loss_scale is not None
        assert (np.diff(curve.loss_scale) < 0).sum() >= 3 and (np.diff(curve.loss_scale[100:]) > 0).any()
        assert np.isinf(curve.grad_norm).any()
    assert curve.loss[:50].mean() > 1.5 * curve.loss[-500:].mean()  # warmup: the loss falls fast
    assert _incidents(curve.records()) == []


def test_healthy_run_resumed_and_re_logged_does_not_fire() -> None:
    curve = healthy(21, n=3000)
    records = curve.records(0, 2000)
    # The job died at step 1999 and resumed from its checkpoint at 1500: 1501.. re-logged,
    # with other noise, then the run carries on.
    rng = np.random.default_rng(22)
    resumed = [{**row, "loss": row["loss"] * (1 + rng.normal(0, 0.01))} for row in curve.records(1501, 3000)]
    detector = Detector()
    for record in records + resumed:
        assert detector.feed(record) is None
    assert detector.counts["restarts"] == 1 and detector.incidents == []


def test_garbage_missing_fields_and_duplicates_are_tolerated() -> None:
    records = healthy(23, n=1500).records()
    noisy: list[Any] = []
    for index, record in enumerate(records):
        if index % 97 == 0:
            noisy += [{"step": "abc", "loss": 1e9}, {"loss": math.nan}, None, "not a mapping",
                      {"step": record["step"] + 0.5, "loss": math.nan}]
        if index % 89 == 0:
            record = {**record, "loss": "garbage", "grad_norm": [1, 2], "loss_scale": {"x": 1}}
        if index % 83 == 0:
            record = {key: value for key, value in record.items() if key in ("step", "time")}
        noisy.append(record)
        if index % 71 == 0:
            noisy.append(dict(record))  # the same step logged twice
    detector = Detector()
    for record in noisy:
        detector.feed(record)
    assert detector.incidents == []
    assert detector.counts["ignored"] == 5 * len(range(0, 1500, 97))
    assert detector.counts["duplicates"] == len(range(0, 1500, 71))


# --------------------------------------------------------------------------- each kind, once


@pytest.mark.parametrize("nan", [math.nan, "nan", math.inf, "-inf"])
def test_nan_that_persists_fires_once(nan: Any) -> None:
    curve = healthy(31, n=2500)
    rows = curve.records()
    for index in range(1200, 1250):
        rows[index]["loss"] = nan
        rows[index]["grad_norm"] = nan
    assert _incidents(rows) == [("nan", 1200)]


def test_nan_in_the_first_steps_fires() -> None:
    rows = healthy(32, n=400).records()
    rows[5]["loss"] = math.nan
    assert _incidents(rows) == [("nan", 5)]


def test_single_loss_spike_fires_once() -> None:
    rows = healthy(33, n=2500).records()
    rows[1700]["loss"] *= 3
    assert _incidents(rows) == [("loss_spike", 1700)]


def test_spike_lasting_several_steps_with_its_grad_jump_is_one_incident() -> None:
    rows = healthy(34, n=2500, fp16=False).records()
    rows[1699]["grad_norm"] *= 40  # the precursor
    for index in range(1700, 1712):
        rows[index]["loss"] *= 2.5
        rows[index]["grad_norm"] *= 10
        rows[index]["throughput"] *= 0.4
    incidents = Detector()
    for record in rows:
        incidents.feed(record)
    assert [(a.kind, a.step) for a in incidents.incidents] == [("grad_spike", 1699)]
    assert incidents.incidents[0].score > 6 and "grad norm" in incidents.incidents[0].detail


def test_grad_norm_spike_fires_once() -> None:
    rows = healthy(35, n=2500).records()
    index = next(i for i in range(1500, 2500) if math.isfinite(rows[i]["grad_norm"]))
    rows[index]["grad_norm"] *= 30
    assert _incidents(rows) == [("grad_spike", index)]


def test_loss_scale_collapse_fires_once() -> None:
    curve = healthy(36, n=3000)
    assert curve.loss_scale is not None
    scale = curve.loss_scale.copy()
    before = scale[1799]
    scale[1800:1816] = before / 2.0 ** np.arange(1, 17)  # sixteen overflows in a row
    scale[1816:] = scale[1816:] / 2.0 ** 16  # then it breathes down there
    grad = curve.grad_norm.copy()
    grad[1800:1816] = np.inf
    broken = Curve(curve.step, curve.loss, curve.lr, grad, scale, curve.throughput, curve.seconds)
    config = WatchConfig()
    peak = scale[config.warmup_steps:1800].max()  # the highest scale the detector has seen
    expected = next(i for i in range(1800, 1816) if scale[i] * config.loss_scale_factor <= peak)
    incidents = Detector(config)
    for record in broken.records():
        incidents.feed(record)
    assert [(a.kind, a.step) for a in incidents.incidents] == [("loss_scale_collapse", expected)]
    assert incidents.incidents[0].score >= config.loss_scale_factor


def test_loss_scale_stuck_at_its_minimum_with_inf_grads_is_a_nan() -> None:
    rows = healthy(37, n=2500, fp16=False).records()
    for index, row in enumerate(rows):
        row["loss_scale"] = 1.0
        if index >= 2000:
            row["grad_norm"] = math.inf
    assert _incidents(rows) == [("nan", 2002)]


def test_sustained_throughput_drop_fires_once() -> None:
    rows = healthy(38, n=3000).records()
    for row in rows[2100:]:
        row["throughput"] *= 0.55
    assert _incidents(rows) == [("throughput_drop", 2100 + WatchConfig().throughput_steps - 1)]


def test_a_few_slow_steps_do_not_fire() -> None:
    rows = healthy(39, n=3000).records()
    for row in rows[2000:2006]:  # a data loader stall, shorter than throughput_steps
        row["throughput"] *= 0.2
    assert _incidents(rows) == []


def test_two_incidents_far_apart_fire_twice() -> None:
    rows = healthy(40, n=4000).records()
    rows[1500]["loss"] *= 3
    for row in rows[3200:3230]:
        row["loss"] = math.nan
    assert _incidents(rows) == [("loss_spike", 1500), ("nan", 3200)]


def test_no_new_incident_before_the_cooldown_or_while_unhealthy() -> None:
    rows = healthy(41, n=4000).records()
    rows[1500]["loss"] *= 3
    rows[1560]["loss"] *= 3  # 60 records later: cooldown_steps is 200
    for row in rows[2500:3500]:  # NaN for 1000 steps, then a spike just after it clears
        row["loss"] = math.nan
    rows[3505]["loss"] *= 3
    assert _incidents(rows) == [("loss_spike", 1500), ("nan", 2500)]
    seconds = WatchConfig(cooldown_steps=1, cooldown_s=3600.0)  # the time part counts too
    assert _incidents(rows[:2000], seconds) == [("loss_spike", 1500)]
    assert _incidents(rows[:2000], WatchConfig(cooldown_steps=1, cooldown_s=0.0)) == [
        ("loss_spike", 1500), ("loss_spike", 1560)]


# --------------------------------------------------------------------------- stalls


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_stalled_job_fires_once_after_its_threshold_and_a_checkpoint_pause_does_not() -> None:
    """Steps of 6 s: silence is a stall beyond max(10 x 6 s, 300 s) + one record interval;
    a 4-minute checkpoint save is not one; the stall is one incident until steps come again."""
    rows = healthy(70, n=200).records()
    start = time.time() - 10_000
    clock = _Clock(start)
    detector = Detector(clock=clock)
    for i, row in enumerate(rows):
        row["time"] = start + 6.0 * i
        if i == 120:
            start += 240.0  # a four-minute checkpoint save before step 120
            row["time"] = start + 6.0 * i
        clock.now = row["time"] + 1
        assert detector.feed(row) is None
        assert detector.tick(clock.now + (200 if i == 119 else 0)) is None
    last = rows[-1]["time"]
    assert detector.tick(last + 305.0) is None  # 300 s + 6 s not yet passed
    anomaly = detector.tick(last + 310.0)
    assert anomaly is not None and anomaly.kind == "stalled" and anomaly.step == rows[-1]["step"]
    assert 309.0 < anomaly.value < 311.0 and anomaly.rule == {"stall_factor": "10", "stall_min_s": "300"}
    assert "no step after" in anomaly.detail
    assert detector.tick(last + 900.0) is None  # one incident
    payload = alert_payload(anomaly, "4412", "sim")
    assert payload["alertname"] == "TrainingStalled" and payload["stall_factor"] == "10"
    # steps come again and stay healthy: the incident closes, a new stall is a new incident
    more = healthy(71, n=400).records()
    t0 = last + 1000.0
    for i, row in enumerate(more):
        row["step"] = rows[-1]["step"] + 1 + i
        row["time"] = t0 + 6.0 * i
        detector.feed(row)
    again = detector.tick(more[-1]["time"] + 400.0)
    assert again is not None and again.kind == "stalled" and len(detector.incidents) == 2


def test_stall_thresholds_scale_with_slow_steps_and_sparse_logging() -> None:
    """A job logging every 100 steps of 10 s is silent 1,000 s between healthy lines: a stall
    only after 10 x 10 s... at least 300 s, plus those 1,000 s."""
    detector = Detector(WatchConfig(stall_factor=10, stall_min_s=300), clock=_Clock(0.0))
    for i in range(12):
        detector.feed({"step": 100 * i, "time": 1000.0 * i, "loss": 2.0})
    last = 11_000.0
    assert detector.tick(last + 1200.0) is None
    assert detector.tick(last + 1301.0).kind == "stalled"
    # the configured rule: a shorter minimum
    quick = Detector(WatchConfig(stall_factor=3, stall_min_s=5), clock=_Clock(0.0))
    for i in range(10):
        quick.feed({"step": i, "time": 0.1 * i, "loss": 2.0})
    assert quick.tick(0.9 + 5.0) is None and quick.tick(0.9 + 5.2).kind == "stalled"
    # a single record says nothing about the step time: no stall judged
    lone = Detector(clock=_Clock(0.0))
    lone.feed({"step": 1, "time": 0.0, "loss": 2.0})
    assert lone.tick(1e6) is None


def test_records_without_time_use_the_clock_and_a_restart_starts_over() -> None:
    clock = _Clock(100.0)
    detector = Detector(WatchConfig(stall_min_s=30), clock=clock)
    for i in range(30):
        clock.now = 100.0 + i
        detector.feed({"step": i, "loss": 2.0})
    clock.now = 129.0 + 31.5
    assert detector.tick() is not None
    resumed = Detector(WatchConfig(stall_min_s=30), clock=clock)
    for step in (5, 6, 7, 3, 4):  # a resumed job re-logs older steps: the old pace is forgotten
        clock.now += 1
        resumed.feed({"step": step, "loss": 2.0})
    assert resumed.stall(clock.now + 10) is None


def test_watch_ticks_on_idle_polls_and_on_repeated_prometheus_values(tmp_path: Path) -> None:
    """The loop asks for a stall when the source has nothing new (a None from the source) or
    when the record repeats the last step (a gauge that stopped)."""
    clock = _Clock(0.0)
    detector = Detector(WatchConfig(stall_factor=3, stall_min_s=5), clock=clock)
    records: list[dict[str, Any] | None] = [{"step": i, "time": float(i), "loss": 2.0} for i in range(10)]
    records += [None, {"step": 9, "time": 20.0, "loss": 2.0}]

    def source():
        for record in records:
            clock.now = 9.0 + (3.0 if record is None else 20.0)
            yield record

    fired = watch(source(), detector, lambda anomaly: None)
    assert [(a.kind, a.step) for a in fired] == [("stalled", 9)]  # from the repeated step, not the early poll


def test_following_a_file_that_stops_growing_fires_a_stall(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    now = time.time()
    path.write_text(jsonl([{"step": i, "time": now - 3.0 + 0.1 * i, "loss": 2.0} for i in range(10)]))
    fired = watch(follow_metrics(path, from_start=True, poll_s=0.05, timeout=20, idle=True),
                  Detector(WatchConfig(stall_factor=3, stall_min_s=4)), lambda anomaly: None, max_incidents=1)
    assert [(a.kind, a.step) for a in fired] == [("stalled", 9)]
    # --once never waits, so never calls a file's end a stall
    assert watch(follow_metrics(path, once=True, idle=False), Detector(WatchConfig(stall_min_s=1)),
                 lambda anomaly: None) == []


def test_thresholds_come_from_the_config() -> None:
    rows = healthy(42, n=2500).records()
    rows[1700]["loss"] *= 1.3
    assert _incidents(rows) == [("loss_spike", 1700)]
    assert _incidents(rows, WatchConfig(loss_rel=0.5)) == []
    assert _incidents(rows, WatchConfig(warmup_steps=2000)) == []


# --------------------------------------------------------------------------- config


def test_watch_table_is_validated(tmp_path: Path) -> None:
    path = tmp_path / "spikeops.toml"
    path.write_text('[watch]\nloss_z = 8\ngrad_rel = 3.5\ncooldown_steps = 50\n'
                    '[watch.prometheus]\nloss = \'training_loss{job_id="4412"}\'\n')
    config = WatchConfig.from_table(load_config(path).watch)
    assert (config.loss_z, config.grad_rel, config.cooldown_steps) == (8.0, 3.5, 50)
    assert config.prometheus == {"loss": 'training_loss{job_id="4412"}'}
    assert WatchConfig.from_table({}) == WatchConfig()
    for table, message in (({"loss_zz": 1}, "unknown key 'loss_zz'"), ({"window": 2.5}, "whole number"),
                           ({"loss_z": "6"}, "must be a number"), ({"cooldown_steps": True}, "whole number"),
                           ({"throughput_drop": 1.5}, "between 0 and 1"), ({"prometheus": {"los": "x"}}, "'los'"),
                           ({"prometheus": {"loss": ""}}, "PromQL"), ({"min_history": 0}, "at least 1")):
        with pytest.raises(InputError, match=message) as caught:
            WatchConfig.from_table(table)
        assert "\n" not in str(caught.value)


def test_alert_payload_is_the_generic_receiver_json() -> None:
    from spikeops.alerts import idempotency_key, parse_alerts

    rows = healthy(43, n=400).records()
    rows[300]["loss"] = math.nan
    detector = Detector()
    anomaly = next(a for a in map(detector.feed, rows) if a is not None)
    payload = alert_payload(anomaly, "4412", "sim")
    alert = parse_alerts("generic", json.dumps(payload).encode())[0]
    assert (alert.job, alert.cluster, alert.name, alert.status) == ("4412", "sim", "TrainingLossNaN", "firing")
    assert alert.labels["kind"] == "nan" and alert.labels["step"] == "300" and alert.starts_at == anomaly.time
    # The same incident seen again (a restarted watcher) has the same key; another step does not.
    again = next(a for a in map(Detector().feed, rows) if a is not None)
    assert idempotency_key(parse_alerts("generic", json.dumps(alert_payload(again, "4412", "sim")).encode())[0]) \
        == idempotency_key(alert)
    other = alert_payload(replace(anomaly, step=301), "4412", "sim")
    assert other["fingerprint"] != payload["fingerprint"]


# --------------------------------------------------------------------------- following files


def _collect(iterator: Iterator[dict[str, Any]], want: int, seconds: float = 20.0) -> list[dict[str, Any]]:
    got = []
    deadline = time.monotonic() + seconds
    for record in iterator:
        got.append(record)
        if len(got) >= want or time.monotonic() > deadline:
            break
    return got


def test_follow_metrics_partial_lines_truncation_rotation(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 9.0}\n')  # there before we start: not replayed
    rows = healthy(44, n=60).records()
    first, second, third = rows[:20], rows[20:30], rows[30:40]
    stats = SourceStats()
    done = threading.Event()
    stage = {"n": 0}

    def writer() -> None:
        text = jsonl(first[:10]) + "this is not json\n" + jsonl(first[10:])
        with path.open("a") as handle:
            for start in range(0, len(text), 37):  # lines cut mid-way, the reader polls between
                handle.write(text[start:start + 37])
                handle.flush()
                time.sleep(0.003)
        while stage["n"] < len(first) and not done.is_set():
            time.sleep(0.01)
        path.write_text(jsonl(second)[:-1])  # truncated in place, then rewritten shorter
        time.sleep(0.1)
        with path.open("a") as handle:
            handle.write("\n")
        while stage["n"] < len(first) + len(second) and not done.is_set():
            time.sleep(0.01)
        path.rename(tmp_path / "metrics.jsonl.1")  # rotated
        path.write_text(jsonl(third))

    thread = threading.Thread(target=writer)
    source = follow_metrics(path, poll_s=0.01, timeout=30, stats=stats)
    thread.start()
    got = []
    try:
        for record in source:
            got.append(record)
            stage["n"] = len(got)
            if len(got) == 40:
                break
    finally:
        done.set()
        thread.join()
    assert [r["step"] for r in got] == [r["step"] for r in rows[:40]]
    assert got[5]["loss"] == rows[5]["loss"]
    assert stats.bad_lines == 1 and stats.reopened == 2


def test_follow_metrics_from_start_once_and_stop(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = healthy(45, n=30).records()
    path.write_text(jsonl(rows)[:-1])  # an unterminated last line in a finished file
    assert [r["step"] for r in follow_metrics(path, once=True)] == list(range(30))
    with pytest.raises(InputError, match="no such file"):
        list(follow_metrics(tmp_path / "absent.jsonl", once=True))
    # Following (not --once) waits for the file and ends when stop() says so.
    stopping = threading.Event()
    threading.Timer(0.3, stopping.set).start()
    assert list(follow_metrics(tmp_path / "later.jsonl", poll_s=0.01, stop=stopping.is_set)) == []


def test_line_reader_matches_the_whole_file_parser() -> None:
    curve = healthy(46, n=200)
    lines = megatron_lines(curve)
    reader = LineReader()
    streamed = [record for line in lines for record in reader.feed(line)] + reader.flush()
    whole = parse("\n".join(lines)).records
    assert [(r.step, r.loss, r.grad_norm, r.skipped) for r in streamed] == \
        [(r.step, r.loss, r.grad_norm, r.skipped) for r in whole]
    assert reader.flush() == []  # released once


def test_follow_megatron_log_fires_on_nan(tmp_path: Path) -> None:
    curve = healthy(47, n=1500)
    lines = megatron_lines(curve)
    nan_at = 1200
    for index in range(nan_at, 1260):
        lines[index] = lines[index].replace(f"lm loss: {curve.loss[index]:.6E}", "lm loss: NAN").replace(
            "number of nan iterations:   0", "number of nan iterations:   1")
    path = tmp_path / "train.log"
    path.write_text("training ...\n")

    def writer() -> None:
        with path.open("a") as handle:
            for start in range(0, len(lines), 100):
                handle.write("".join(line + "\n" for line in lines[start:start + 100]))
                handle.flush()
                time.sleep(0.01)

    thread = threading.Thread(target=writer)
    thread.start()
    fired: list[Any] = []
    try:
        watch(follow_log(path, poll_s=0.01, timeout=20), Detector(), fired.append, max_incidents=1)
    finally:
        thread.join()
    assert [(a.kind, a.step) for a in fired] == [("nan", nan_at)]
    # The whole log replayed: the same one incident and nothing else.
    assert [(a.kind, a.step) for a in watch(follow_log(path, once=True), Detector(), lambda a: None)] == \
        [("nan", nan_at)]


# --------------------------------------------------------------------------- Prometheus


class _JsonHandler(BaseHTTPRequestHandler):
    def _send(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def _served(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` on 127.0.0.1 (a free port) while the block runs; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _Prometheus(_JsonHandler):
    """Prometheus' instant-query JSON API over a list of records; the step query advances."""

    records: list[dict[str, Any]] = []
    position = -1
    mode = "ok"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        parsed = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(parsed.query).get("query", [""])[0]
        server = type(self)
        if parsed.path != "/api/v1/query" or server.mode == "bad":
            self._send(400, {"status": "error", "errorType": "bad_data", "error": "parse error at char 3"})
            return
        name = query.split("{")[0].removeprefix("training_")
        if name == "step":
            server.position = min(server.position + 1, len(server.records) - 1)
        record = server.records[server.position]
        value = record.get(name)
        series = [] if value is None else [{"metric": {"__name__": f"training_{name}", "job_id": "4412"},
                                             "value": [1764406800.5 + server.position, _text(value)]}]
        if server.mode == "two":
            series = series * 2
        self._send(200, {"status": "success", "data": {"resultType": "vector", "result": series}})


def _text(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


@pytest.fixture
def prometheus() -> Iterator[type[_Prometheus]]:
    handler = type("Handler", (_Prometheus,), {"records": [], "position": -1, "mode": "ok"})
    with _served(handler) as url:
        handler.url = url  # type: ignore[attr-defined]
        yield handler


QUERIES = {"step": 'training_step{job_id="4412"}', "loss": 'training_loss{job_id="4412"}',
           "grad_norm": 'training_grad_norm{job_id="4412"}', "loss_scale": 'training_loss_scale{job_id="4412"}'}


def test_prometheus_source_fires_on_nan(prometheus: Any) -> None:
    rows = healthy(48, n=120).records()
    for row in rows[80:]:
        row["loss"] = math.nan
    prometheus.records = rows
    fired = watch(poll_prometheus(prometheus.url, QUERIES, poll_s=0.001, timeout=30), Detector(),
                  lambda a: None, max_incidents=1)
    assert [(a.kind, a.step) for a in fired] == [("nan", 80)]
    assert fired[0].time is not None and fired[0].time.startswith("2025-11-29")


def test_prometheus_without_a_step_query_skips_unchanged_polls(prometheus: Any) -> None:
    rows = healthy(49, n=5).records()
    prometheus.records = rows
    prometheus.position = 2
    queries = {"loss": "training_loss", "grad_norm": "training_grad_norm"}
    records = list(poll_prometheus(prometheus.url, queries, poll_s=0.001, timeout=0.3))
    assert [r["step"] for r in records] == [1]  # every poll saw the same scrape
    assert records[0]["loss"] == rows[2]["loss"]


def test_prometheus_errors_are_one_line(prometheus: Any) -> None:
    prometheus.records = healthy(50, n=5).records()
    prometheus.mode = "bad"
    with pytest.raises(InputError, match="HTTP 400: parse error at char 3"):
        list(poll_prometheus(prometheus.url, QUERIES, once=True))
    prometheus.mode = "two"
    with pytest.raises(InputError, match="returns 2 series"):
        list(poll_prometheus(prometheus.url, QUERIES, once=True))
    with pytest.raises(InputError, match="unreachable"):
        list(poll_prometheus("http://127.0.0.1:9", QUERIES, once=True, request_timeout=2))
    with pytest.raises(InputError, match="http"):
        list(poll_prometheus("ftp://x", QUERIES, once=True))


# --------------------------------------------------------------------------- CLI


def _cli(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="spikeops")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["watch", *argv])
    out, err = io.StringIO(), io.StringIO()
    return run(args, out, err), out.getvalue(), err.getvalue()


@pytest.fixture
def no_ambient_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPIKEOPS_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)


def test_cli_prints_one_line_per_incident(tmp_path: Path, no_ambient_config: None) -> None:
    rows = healthy(51, n=4000).records()
    rows[1500]["loss"] *= 3
    for row in rows[3000:3040]:
        row["loss"] = "nan"
    path = tmp_path / "metrics.jsonl"
    path.write_text(jsonl(rows) + "garbage\n")
    status, out, err = _cli("--metrics", str(path), "--once")
    assert status == 0
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("step 1500 ") and ": loss_spike: " in lines[0]
    assert lines[1].startswith("step 3000 ") and ": nan: " in lines[1]
    assert "4000 record(s)" in err and "2 incident(s)" in err and "1 unreadable" in err
    status, out, _ = _cli("--metrics", str(path), "--once", "--max-incidents", "1")
    assert status == 0 and len(out.splitlines()) == 1


@pytest.mark.parametrize("argv,config,message", [
    (["--metrics", "{tmp}/absent.jsonl", "--once"], None, "no such file"),
    (["--metrics", "{tmp}/m.jsonl", "--once", "--config", "{tmp}/s.toml"], "[watch]\nloss_zz = 1\n", "loss_zz"),
    (["--metrics", "{tmp}/m.jsonl", "--once", "--config", "{tmp}/s.toml"], "[watch]\nwindow = 'x'\n", "window"),
    (["--metrics", "{tmp}/m.jsonl", "--fire", "receiver"], None, "needs --job"),
    (["--metrics", "{tmp}/m.jsonl", "--max-incidents", "0"], None, "at least 1"),
    (["--metrics", "{tmp}/m.jsonl", "--fire", "receiver", "--job", "4412", "--receiver", "nope"], None, "http"),
    (["--prometheus", "http://127.0.0.1:9", "--once"], None, "no prometheus queries"),
    (["--prometheus", "http://127.0.0.1:9", "--query", "loss"], None, "FIELD=PROMQL"),
    (["--prometheus", "http://127.0.0.1:9", "--query", "speed=x"], None, "unknown field 'speed'"),
    (["--metrics", "{tmp}", "--once"], None, "directory"),
])
def test_cli_bad_input_is_one_line_and_status_2(tmp_path: Path, no_ambient_config: None, argv: list[str],
                                                config: str | None, message: str) -> None:
    (tmp_path / "m.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    if config is not None:
        (tmp_path / "s.toml").write_text(config)
    status, out, err = _cli(*[part.format(tmp=tmp_path) for part in argv])
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("spikeops watch: ") and message in err


def test_cli_help_names_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="spikeops")
    add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["watch", "--help"])
    assert exited.value.code == 0
    help_text = capsys.readouterr().out
    for option in ("--metrics", "--log", "--prometheus", "--job", "--cluster", "--config", "--fire", "--receiver",
                   "--from-start", "--once", "--max-incidents", "--timeout"):
        assert option in help_text


# --------------------------------------------------------------------------- the simulator


def _expected_kinds(truth: Any) -> set[str]:
    """What the watcher should start an incident as, by the simulator's ground truth."""
    if truth.symptom == "instant_nan":  # the NaN, or a precursor that led into it
        return {"nan", "loss_scale_collapse", "grad_spike", "loss_spike"}
    if truth.symptom in ("single_spike", "spike_no_recovery"):
        return {"loss_spike", "grad_spike", "loss_scale_collapse"}
    if truth.cause == "thermal_throttle":  # the seed: throughput drops, the loss does not jump
        return {"throughput_drop"}
    return set()  # a false alarm, or a creeping rise (the diagnosis' call, not a page)


@pytest.mark.parametrize("cause", CAUSES)
def test_agrees_with_the_simulators_ground_truth(tmp_path: Path, cause: str) -> None:
    truth = build_bundle(tmp_path / "b", cause, seed=5, nodes=8)
    metrics, log = tmp_path / "b" / "metrics.jsonl", tmp_path / "b" / "train.log"
    source = follow_metrics(metrics, once=True) if metrics.exists() else follow_log(log, once=True)
    fired = watch(source, Detector(), lambda anomaly: None)
    kinds = _expected_kinds(truth)
    assert len(fired) == (1 if kinds else 0), fired
    if kinds:
        assert fired[0].kind in kinds
        if truth.spike_step is not None:  # at the spike, or at a precursor before it
            assert (truth.onset_step or truth.spike_step) - 50 <= fired[0].step <= truth.spike_step


def test_post_to_receiver_retries_a_busy_receiver_then_gives_up() -> None:
    answers = [(503, {"error": "could not start the incident flow"}), (202, {"accepted": [{"flow_run": "r1"}]})]
    seen: list[dict[str, Any]] = []

    class Receiver(_JsonHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            status, body = answers.pop(0) if answers else (503, {"error": "still busy"})
            self._send(status, body, {"Retry-After": "7"})

    waits: list[float] = []
    with _served(Receiver) as base:
        url = f"{base}/alerts/generic"
        assert post_to_receiver(url, {"job": "4412"}, sleep=waits.append) == {"accepted": [{"flow_run": "r1"}]}
        assert waits == [7.0] and seen == [{"job": "4412"}] * 2
        with pytest.raises(SpikeopsError, match="after 3 attempts .*HTTP 503: still busy"):
            post_to_receiver(url, {"job": "4412"}, sleep=waits.append)

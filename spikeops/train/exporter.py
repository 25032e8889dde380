"""A job's step metrics on a Prometheus ``/metrics`` endpoint, for the alerting rules in
``infra/monitoring/prometheus-rules.yml``.

Why an exporter in the job (pull) rather than a Pushgateway or node_exporter's textfile
collector (docs/monitoring.md has the longer argument):

- Prometheus's own ``up`` and staleness then say when the job is gone: a dead job's series
  go stale within one scrape and its alerts resolve, where a Pushgateway keeps serving the last
  pushed NaN until someone deletes it, and pages about a job that no longer exists;
- nothing else has to run: no Pushgateway to keep up (and to lose), no node_exporter with a
  textfile directory on every node, no file rewritten every step;
- it costs the loop nothing: ``observe`` only keeps a reference to the step's record (and
  counts a non-finite loss); the gauges are built when Prometheus scrapes, in the exporter's
  own thread (prometheus-client's HTTP server).

What it exports, with the ``job_id`` and ``cluster`` labels spikeops maps to the incident flow:
``training_step``, ``training_loss``, ``training_lr``, ``training_grad_norm``,
``training_loss_scale``, ``training_tokens_per_second`` (gauges of the last step; a field the
job never logs has no series), ``training_nonfinite_loss_total`` (a counter of the steps
whose loss was NaN or infinite, so a NaN between two scrapes is still seen), and for the
stall rule ``training_last_step_timestamp_seconds`` (when the job logged its last step: the
moment ``observe`` saw it, on the job's clock, which is the one that matters on a live job and
is not fooled by a record's own ``time`` being from another clock or another run),
``training_step_seconds`` (seconds per step between the last two records that advanced) and
``training_record_interval_seconds`` (seconds between those records). A hung job's exporter thread still answers scrapes: its step stops, its
timestamp ages, and the rule fires. A scrape sees one
step in each interval: a spike that lasts less than a scrape interval is invisible to
Prometheus (the watcher, ``spikeops watch``, reads every step).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["PrometheusExporter", "GAUGES", "NONFINITE", "PROGRESS"]

#: metrics.jsonl field -> (metric name, help). The names the alerting rules use.
GAUGES: dict[str, tuple[str, str]] = {
    "step": ("training_step", "the last step the job logged"),
    "loss": ("training_loss", "the loss of the last step (NaN when it was NaN)"),
    "lr": ("training_lr", "the learning rate of the last step"),
    "grad_norm": ("training_grad_norm", "the gradient norm of the last step"),
    "loss_scale": ("training_loss_scale", "the fp16 dynamic loss scale of the last step"),
    "throughput": ("training_tokens_per_second", "tokens per second of the last step"),
}
NONFINITE = ("training_nonfinite_loss", "steps whose loss was NaN or infinite")
#: The stall rule's gauges: name -> help.
PROGRESS: dict[str, str] = {
    "training_last_step_timestamp_seconds": "Unix time the last step was logged",
    "training_step_seconds": "seconds per step between the last two records that advanced the step",
    "training_record_interval_seconds": "seconds between the last two records that advanced the step",
}


def _split(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"exporter address {addr!r}: HOST:PORT (PORT 0 picks a free one)")
    return host.strip("[]") or "0.0.0.0", int(port)


def _value(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class _Collector:
    """prometheus-client's custom-collector protocol: the families, built at scrape time."""

    def __init__(self, exporter: PrometheusExporter) -> None:
        self.exporter = exporter

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = list(self.exporter.labels)
        values = list(self.exporter.labels.values())
        record, nonfinite = self.exporter.snapshot()
        for field, (name, help_text) in GAUGES.items():
            value = _value(record.get(field))
            if value is None:
                continue
            family = GaugeMetricFamily(name, help_text, labels=labels)
            family.add_metric(values, value)
            yield family
        for name, value in self.exporter.progress().items():
            family = GaugeMetricFamily(name, PROGRESS[name], labels=labels)
            family.add_metric(values, value)
            yield family
        counter = CounterMetricFamily(NONFINITE[0], NONFINITE[1], labels=labels)
        counter.add_metric(values, float(nonfinite))
        yield counter


class PrometheusExporter:
    """Serve the last step's metrics on ``http://ADDR/metrics`` (rank 0 of a job)::

        exporter = PrometheusExporter("0.0.0.0:9464", job_id=os.environ["SLURM_JOB_ID"], cluster="prod")
        log = MetricsLogger(run_dir, rank=rank, exporter=exporter if rank == 0 else None)

    or ``exporter.observe({"step": s, "loss": l, ...})`` with any metrics.jsonl-shaped record.
    ``addr`` with port 0 takes a free port (``address`` says which). ``close`` stops serving,
    and Prometheus then marks the series stale: the job's alerts resolve.
    """

    def __init__(self, addr: str = "0.0.0.0:9464", *, job_id: str, cluster: str | None = None,
                 labels: Mapping[str, str] | None = None, serve: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        from prometheus_client import CollectorRegistry

        if not job_id:
            raise ValueError("job_id is required: alerts carry it to the incident flow")
        self.labels: dict[str, str] = {"job_id": str(job_id)}
        if cluster:
            self.labels["cluster"] = str(cluster)
        self.labels.update({str(k): str(v) for k, v in (labels or {}).items()})
        self._record: Mapping[str, Any] = {}
        self._nonfinite = 0
        #: (seconds, step) of the last record that advanced the step, and the two intervals.
        self._clock = clock
        self._last: tuple[float, float] | None = None
        self._intervals: tuple[float, float] | None = None
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))  # type: ignore[arg-type]
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None
        if serve:
            self.start(addr)

    def start(self, addr: str) -> tuple[str, int]:
        """Listen on ``addr`` (HOST:PORT); the address bound."""
        from prometheus_client import start_http_server

        host, port = _split(addr)
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound = self._server.server_address
        self.address = (str(bound[0]), int(bound[1]))
        return self.address

    def observe(self, record: Mapping[str, Any]) -> None:
        """One step's record (metrics.jsonl fields). Keeps a reference: do not mutate it after."""
        loss = _value(record.get("loss"))
        if loss is not None and not math.isfinite(loss):
            with self._lock:
                self._nonfinite += 1
        step = _value(record.get("step"))
        if step is not None:
            moment = self._clock()
            with self._lock:
                if self._last is not None and step > self._last[1] and moment > self._last[0]:
                    self._intervals = ((moment - self._last[0]) / (step - self._last[1]), moment - self._last[0])
                if self._last is None or step != self._last[1]:
                    self._last = (moment, step)
        self._record = record

    def progress(self) -> dict[str, float]:
        """The stall rule's gauges (empty before the first step)."""
        with self._lock:
            out: dict[str, float] = {}
            if self._last is not None:
                out["training_last_step_timestamp_seconds"] = self._last[0]
            if self._intervals is not None:
                out["training_step_seconds"], out["training_record_interval_seconds"] = self._intervals
            return out

    def snapshot(self) -> tuple[Mapping[str, Any], int]:
        with self._lock:
            return self._record, self._nonfinite

    def text(self) -> str:
        """What a scrape returns now (the exposition format)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            if self._thread is not None:
                self._thread.join(5)

    def __enter__(self) -> PrometheusExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

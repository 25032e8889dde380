"""spikeops.train.PrometheusExporter: what Prometheus scrapes from a job."""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spikeops.train import MetricsLogger, PrometheusExporter


def _scrape(exporter: PrometheusExporter) -> dict[str, tuple[dict[str, str], float]]:
    host, port = exporter.address  # type: ignore[misc]
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {sample.name: (sample.labels, sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_the_logger_feeds_the_exporter(tmp_path: Path) -> None:
    exporter = PrometheusExporter("127.0.0.1:0", job_id="4412", cluster="prod")
    with MetricsLogger(tmp_path, exporter=exporter, flush_every=1) as log:
        log.step(10, loss=2.5, lr=3e-4, grad_norm=1.2, loss_scale=65536.0, tokens=4096, time_=100.0)
        log.step(11, loss=2.4, lr=3e-4, grad_norm=1.1, loss_scale=65536.0, tokens=4096, time_=101.0)
        seen = _scrape(exporter)
        assert seen["training_step"] == ({"job_id": "4412", "cluster": "prod"}, 11.0)
        assert seen["training_loss"][1] == 2.4 and seen["training_loss_scale"][1] == 65536.0
        assert seen["training_tokens_per_second"][1] == 4096.0  # one step of 4096 tokens in 1 s
        assert seen["training_nonfinite_loss_total"][1] == 0.0
        log.step(12, loss=float("nan"), lr=3e-4, grad_norm=float("nan"), tokens=4096, time_=102.0)
        log.step(13, loss=float("inf"), lr=3e-4, tokens=4096, time_=103.0)
        log.step(14, loss=2.3, lr=3e-4, tokens=4096, time_=104.0)
        seen = _scrape(exporter)
        # the last step is finite again; the counter still says two were not (a NaN between scrapes)
        assert seen["training_loss"][1] == 2.3 and seen["training_nonfinite_loss_total"][1] == 2.0
        log.step(15, loss=float("nan"), lr=3e-4, tokens=4096, time_=105.0)
        assert math.isnan(_scrape(exporter)["training_loss"][1])
        assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 6  # the file is still written
    with pytest.raises((urllib.error.URLError, OSError)):  # closing the logger closed the endpoint
        _scrape(exporter)


def test_fields_never_logged_have_no_series_and_bad_input_is_refused() -> None:
    with PrometheusExporter("127.0.0.1:0", job_id="7", labels={"team": "llm"}) as exporter:
        assert "training_step" not in _scrape(exporter)  # nothing logged yet: no gauges, a zero counter
        exporter.observe({"step": 1, "loss": 3.0, "loss_scale": None, "lr": "not a number"})
        seen = _scrape(exporter)
        assert seen["training_loss"] == ({"job_id": "7", "team": "llm"}, 3.0)
        assert "training_loss_scale" not in seen and "training_lr" not in seen and "training_grad_norm" not in seen
    with pytest.raises(ValueError, match="job_id"):
        PrometheusExporter("127.0.0.1:0", job_id="")
    with pytest.raises(ValueError, match="HOST:PORT"):
        PrometheusExporter("127.0.0.1", job_id="7")
    unserved = PrometheusExporter(job_id="8", serve=False)
    unserved.observe({"step": 3, "loss": 1.0})
    assert 'training_step{job_id="8"} 3.0' in unserved.text() and unserved.address is None


def test_the_stall_gauges_say_when_the_last_step_came_and_how_long_steps_took() -> None:
    """What TrainingStalled reads: a job logging every 10 steps of 2 s (records 20 s apart),
    timed by the job's clock when it logs (a record's own ``time`` may be another clock's)."""
    now = [1000.0]
    exporter = PrometheusExporter(job_id="9", serve=False, clock=lambda: now[0])
    assert "training_last_step_timestamp_seconds" not in exporter.text()  # nothing yet
    exporter.observe({"step": 100, "time": "2020-01-01T00:00:00Z", "loss": 2.0})
    assert "training_last_step_timestamp_seconds" in exporter.text() and "training_step_seconds" not in exporter.text()
    now[0] = 1020.0
    exporter.observe({"step": 110, "loss": 2.0})
    now[0] = 1030.0
    exporter.observe({"step": 110, "loss": 2.0})  # the same step again: no progress
    now[0] = 1040.0
    exporter.observe({"step": 120, "loss": 2.0})
    families = {family.name: family.samples[0].value for family in text_string_to_metric_families(exporter.text())}
    assert families["training_last_step_timestamp_seconds"] == 1040.0
    assert families["training_step_seconds"] == 2.0 and families["training_record_interval_seconds"] == 20.0

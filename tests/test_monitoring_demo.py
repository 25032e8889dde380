"""`spikeops demo --monitoring prometheus`: the demo with the real Prometheus and Alertmanager
instead of the watcher, as a newcomer runs it (a subprocess, everything stopped at the end),
and its one-line error where they are not installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.test_demo import BIN, _leftovers, _line


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SLACK_"))}
    return {**env, **extra}


def test_the_alert_comes_from_prometheus_through_alertmanager(tmp_path: Path) -> None:
    directory = tmp_path / "demo"
    done = subprocess.run([str(BIN / "spikeops"), "demo", "--monitoring", "prometheus", "--dir", str(directory)],
                          capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "watcher:" not in out  # the real chain noticed it, not the watcher
    fired = _line(out, "alertmanager -> receiver:")
    assert "TrainingLossNaN firing for job" in fired
    assert "gpu_xid" in _line(out, "DIAGNOSIS:")
    assert (directory / "monitoring" / "prometheus.yml").is_file()
    assert _leftovers(directory) == []  # Prometheus and Alertmanager stopped with the rest


def test_not_installed_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run([str(BIN / "spikeops"), "demo", "--monitoring", "prometheus", "--dir", str(tmp_path / "d")],
                          capture_output=True, text=True, timeout=60,
                          env=_env(SPIKEOPS_PROMETHEUS=str(tmp_path / "no-prometheus")))
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--monitoring prometheus" in lines[0] and "apt-get install prometheus" in lines[0]
    assert not (tmp_path / "d").exists()  # refused before anything was built

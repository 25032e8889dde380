"""A training job for the monitoring chain's test: spikeops.train's logger and Prometheus
exporter on a loop of steps, whose loss goes NaN while the file ``DIR/nan`` exists (and is
finite again once it is removed). Run as ``python -m tests.monitored_job --job 5001 --dir D``;
it writes the exporter's HOST:PORT to ``D/exporter`` once it listens, and runs until killed.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

from spikeops.train import MetricsLogger, PrometheusExporter


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True)
    parser.add_argument("--cluster", default="sim")
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--step-s", type=float, default=0.1)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    exporter = PrometheusExporter("127.0.0.1:0", job_id=args.job, cluster=args.cluster)
    host, port = exporter.address  # type: ignore[misc]
    (args.dir / "exporter.tmp").write_text(f"{host}:{port}")
    (args.dir / "exporter.tmp").replace(args.dir / "exporter")
    rng = random.Random(args.job)
    with MetricsLogger(args.dir, exporter=exporter, flush_every=10) as log:
        step = 0
        while True:
            step += 1
            loss = 2.0 + 8.0 * math.exp(-step / 200) + rng.gauss(0, 0.02)
            if (args.dir / "nan").exists():
                loss = float("nan")
            log.step(step, loss=loss, lr=3e-4, grad_norm=1.0 + rng.random(), loss_scale=65536.0, tokens=1_048_576)
            time.sleep(args.step_s)


if __name__ == "__main__":
    sys.exit(main())

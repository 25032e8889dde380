"""What the ledger adds to an incident: opening (and migrating) it, reading a lineage, writing
an entry, reserving a resume; on SQLite and, when Debian's PostgreSQL is installed, on a
private PostgreSQL as the scale-out layout runs it.

    .venv/bin/python bench/bench_ledger.py [--incidents 2000]

The ledger is filled with ``--incidents`` incidents in lineages of 5 first, so reads and the
budget's count run against a ledger that has history. Times are medians of 50 (ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spikeops.ledger.store import Ledger, stamp  # noqa: E402


def _entry(index: int, lineage: str) -> dict:
    incident = f"inc-bench-{index}"
    opened = stamp(datetime.now(UTC))
    return {"incident": {"incident_id": incident, "cluster": "bench", "job_id": str(10_000 + index), "lineage": lineage,
                         "opened": opened, "symptom": "instant_nan", "cause": "gpu_xid", "spike_step": 1345,
                         "culprit_nodes": ["gpu-001"], "gpus": 512, "t_alert": opened},
            "jobs": [{"cluster": "bench", "job_id": str(10_000 + index), "lineage": lineage}],
            "node_events": [{"cluster": "bench", "node": "gpu-001", "time": opened, "kind": "convict",
                             "incident_id": incident, "cause": "gpu_xid"}]}


def _median_ms(action, runs: int = 50) -> float:
    times = []
    for index in range(runs):
        start = time.perf_counter()
        action(index)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure(url: str, incidents: int, label: str) -> None:
    code = f"import time; t=time.perf_counter(); from spikeops.ledger.store import Ledger; Ledger({url!r}); " \
           "print(time.perf_counter()-t)"
    cold = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                env=os.environ).stdout)
    with Ledger(url) as ledger:
        start = time.perf_counter()
        for index in range(incidents):
            ledger.apply(_entry(index, f"L{index // 5}"))
        fill = (time.perf_counter() - start) / incidents * 1000
        write = _median_ms(lambda i: ledger.apply(_entry(incidents + i, "Lhot")))
        read = _median_ms(lambda i: (ledger.job("bench", "10003"), ledger.lineage_incidents("bench", "L0"),
                                     ledger.resumes_of("bench", "L0")))
        reserve = _median_ms(lambda i: ledger.reserve_resume(cluster="bench", lineage=f"R{i}", incident_id=f"r{i}",
                                                             job_id="1", limit=2, window_s=86400))
        listed = _median_ms(lambda i: ledger.incidents(), runs=5)
    print(f"{label}: open+migrate in a new process {cold * 1000:.0f} ms; entry {write:.1f} ms "
          f"(fill {fill:.1f} ms each); lineage read {read:.1f} ms; budget reservation {reserve:.1f} ms; "
          f"list of {incidents + 50} incidents {listed:.0f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--incidents", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="spikeops-bench-ledger-") as tmp:
        measure(f"sqlite:///{tmp}/ledger.db", args.incidents, "SQLite")
        from spikeops.deployments import postgres

        if postgres.bin_dir() is None:
            print("PostgreSQL: not installed (apt-get install postgresql)")
            return 0
        os.chmod(tmp, 0o711)
        server = postgres.init(Path(tmp) / "pg")
        try:
            postgres.start(server, Path(tmp) / "pg.log")
            os.environ["PGPASSFILE"] = str(Path(tmp) / "ledger-pgpass")
            measure(postgres.create_ledger(server, Path(tmp) / "ledger-pgpass"), args.incidents, "PostgreSQL")
        finally:
            postgres.stop(server.data, server.bin)
    return 0


if __name__ == "__main__":
    sys.exit(main())

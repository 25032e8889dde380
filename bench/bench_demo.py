"""Benchmark: `spikeops demo` for every scenario, as a newcomer runs it.

Each scenario runs `spikeops demo --scenario NAME` as a subprocess (its own cluster, job,
watcher, ephemeral Prefect server), timed from start to exit (everything stopped). The
printed diagnosis is checked against the simulator's ground truth for the same seed and
node count (`spikeops.sim.build_bundle`): the cause and the exact culprit set.
Target (issue 10): under 60 s on this 2-core machine.
Run by hand: `python bench/bench_demo.py [--scenario NAME ...] [--nodes 8] [--scheduler auto]`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spikeops.demo import SCENARIOS, default_seed  # noqa: E402
from spikeops.inventory import fold_nodes  # noqa: E402
from spikeops.sim import build_bundle  # noqa: E402

BIN = Path(sys.executable).parent


def _field(stdout: str, prefix: str) -> str:
    """The last printed line that starts with ``prefix``, without it."""
    found = ""
    for line in stdout.splitlines():
        text = line.split("] ", 1)[-1].strip()
        if text.startswith(prefix):
            found = text[len(prefix):].strip()
    return found


def one(scenario: str, nodes: int, scheduler: str, work: Path) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SLACK_"))}
    started = time.monotonic()
    done = subprocess.run([str(BIN / "spikeops"), "demo", "--scenario", scenario, "--nodes", str(nodes),
                           "--scheduler", scheduler, "--dir", str(work / scenario)],
                          capture_output=True, text=True, env=env, timeout=600)
    seconds = time.monotonic() - started
    expected = build_bundle(work / f"{scenario}-expected", scenario, seed=default_seed(scenario), nodes=nodes)
    diagnosis = _field(done.stdout, "DIAGNOSIS:")
    cause = diagnosis.split(" ", 1)[0] if diagnosis else "-"
    culprits = _field(done.stdout, "culprit nodes:")
    want = fold_nodes(expected.culprit_nodes) if expected.culprit_nodes else "none"
    fired = _field(done.stdout, "watcher:")
    return {"scenario": scenario, "exit": done.returncode, "seconds": seconds, "cause": cause,
            "cause_ok": cause == expected.cause, "culprits_ok": culprits == want,
            "fired": re.split(r"[ :]", fired, maxsplit=1)[0] if fired else "-",
            "scheduler": "slurm" if "real Slurm" in done.stdout else "local"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", nargs="*", default=list(SCENARIOS))
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--scheduler", default="auto", choices=("auto", "slurm", "local"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-demo-") as work:
        for scenario in args.scenario:
            row = one(scenario, args.nodes, args.scheduler, Path(work))
            rows.append(row)
            print(f"{scenario}: {row['seconds']:.1f} s, {row['cause']}, cause ok {row['cause_ok']}, "
                  f"culprits ok {row['culprits_ok']}, exit {row['exit']}", file=sys.stderr)
    print(f"| scenario | scheduler | watcher fired on | diagnosis | cause and culprits right | seconds |")
    print("| --- | --- | --- | --- | --- | ---: |")
    for row in rows:
        right = "yes" if row["cause_ok"] and row["culprits_ok"] and row["exit"] == 0 else "NO"
        fired = "(no anomaly: alert)" if row["fired"] == "no" else row["fired"]
        print(f"| {row['scenario']} | {row['scheduler']} | {fired} | {row['cause']} | {right} | {row['seconds']:.1f} |")
    times = sorted(float(row["seconds"]) for row in rows)
    print(f"\n{sum(1 for r in rows if r['cause_ok'] and r['culprits_ok'])}/{len(rows)} right; "
          f"median {times[len(times) // 2]:.1f} s, max {times[-1]:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

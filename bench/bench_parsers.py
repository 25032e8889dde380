#!/usr/bin/env python3
"""Parser throughput and memory on large logs, against named baselines. Run by hand.

What it answers: can spikeops read the evidence of a real incident (a node's multi-GB
kernel log, a long training log) fast enough to be in the first minutes of an incident, in
bounded memory? Inputs are generated deterministically (realistic line shapes copied from the
real fixtures, with rare Xid lines and a NaN step), so every run reads the same bytes.

Baselines:
- ``grep``: ``grep -E 'NVRM: Xid|SXid'`` (kernel log) and ``grep -E 'iteration'`` (training
  log): what an engineer types first. It only finds lines; it extracts nothing.
- ``python-naive``: read the whole file into memory and run one regex per line: what a
  quick script does, and what spikeops must not do on a 2 GB file (memory grows with size).

Each command runs in a fresh process so peak RSS (ru_maxrss) is its own. Results are printed
as a Markdown table for the README.

Usage: python bench/bench_parsers.py [--mb 200] [--runs 3] [--keep]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

NOISE = [
    "kern  :info  : {t} perf: interrupt took too long (2503 > 2500), lowering kernel.perf_event_max_sample_rate to 79750",
    "kern  :info  : {t} IPv6: ADDRCONF(NETDEV_CHANGE): ib0: link becomes ready",
    "kern  :warn  : {t} nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context, skipping further processing",
    "kern  :info  : {t} mlx5_core 0000:0c:00.0: mlx5_fw_tracer_handle_traces:756:(pid 0): FWTracer: Events were lost",
    "kern  :notice: {t} audit: type=1400 audit(1732900000.123:4567): apparmor=\"DENIED\" operation=\"open\" profile=\"snap\"",
]
XID = ("kern  :warn  : {t} NVRM: Xid (PCI:0000:{bus}:00): 79, pid='<unknown>', name=<unknown>, "
       "GPU has fallen off the bus.")


def _stamp(second: int) -> str:
    day, rest = divmod(second, 86400)
    hour, rest = divmod(rest, 3600)
    minute, sec = divmod(rest, 60)
    return f"2026-11-{1 + day % 28:02d}T{hour:02d}:{minute:02d}:{sec:02d},{(second * 7919) % 1000000:06d}+00:00"


def make_kernel_log(path: Path, megabytes: int) -> None:
    rng = random.Random(79)
    target = megabytes * 1024 * 1024
    written = 0
    second = 0
    with open(path, "w") as out:
        while written < target:
            second += 1
            if rng.random() < 0.0005:
                line = XID.format(t=_stamp(second), bus=rng.choice(["19", "3b", "5d", "9b"]))
            else:
                line = rng.choice(NOISE).format(t=_stamp(second))
            out.write(line + "\n")
            written += len(line) + 1


def make_training_log(path: Path, megabytes: int) -> None:
    rng = random.Random(17)
    target = megabytes * 1024 * 1024
    written = 0
    step = 0
    template = (" iteration {s:>8}/ 1000000 | consumed samples: {c:>12} | elapsed time per iteration (ms): {ms:.1f} | "
                "learning rate: 3.000E-04 | global batch size:  2048 | lm loss: {loss:.6E} | loss scale: 65536.0 | "
                "grad norm: {g:.3f} | num zeros: 0.0 | number of skipped iterations:   0 | number of nan iterations:   0 |")
    timer = ("time (ms) | forward-compute: 265.42 | backward-compute: 462.83 | backward-params-all-reduce: 22.00 | "
             "optimizer: 82.95 | batch-generator: 2.87")
    with open(path, "w") as out:
        while written < target:
            step += 1
            line = template.format(s=step, c=step * 2048, ms=1600 + rng.random() * 20,
                                   loss=2.3 + rng.gauss(0, 0.02), g=0.9 + rng.gauss(0, 0.05))
            out.write(line + "\n" + timer + "\n")
            written += len(line) + len(timer) + 2


SPIKEOPS = """
import sys
from spikeops.reading import read_evidence
r = read_evidence(sys.argv[1], sys.argv[2])
res = r.result
n = len(getattr(res, 'xids', None) or getattr(res, 'records', None) or [])
print(n)
"""

NAIVE_KERNEL = r"""
import re, sys
pattern = re.compile(r"NVRM: Xid \(PCI:([0-9a-f:]+)\): (\d+), (.*)")
text = open(sys.argv[1], encoding='utf-8', errors='replace').read()
print(sum(1 for line in text.splitlines() if pattern.search(line)))
"""

NAIVE_TRAINING = r"""
import re, sys
pattern = re.compile(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+)")
text = open(sys.argv[1], encoding='utf-8', errors='replace').read()
print(sum(1 for line in text.splitlines() if pattern.search(line)))
"""


def run_case(name: str, path: Path, kind: str, grep_pattern: str, naive: str, runs: int) -> list[str]:
    size_mb = path.stat().st_size / 1024 / 1024
    rows = []
    commands = {
        "spikeops (streaming parse)": [PYTHON, "-c", SPIKEOPS, str(path), kind],
        "baseline: grep -E": ["grep", "-cE", grep_pattern, str(path)],
        "baseline: python-naive (read all, regex)": [PYTHON, "-c", naive, str(path)],
    }
    for label, command in commands.items():
        best = None
        for _ in range(runs):
            # A fresh interpreter per measurement so ru_maxrss reflects one command only.
            wrapper = [PYTHON, "-c",
                       "import resource,subprocess,sys,time;s=time.perf_counter();"
                       "p=subprocess.run(sys.argv[1:],capture_output=True,text=True);"
                       "e=time.perf_counter()-s;"
                       "print(e, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.stdout.strip())",
                       *command]
            out = subprocess.run(wrapper, capture_output=True, text=True, check=True).stdout.split()
            seconds, rss_kib, found = float(out[0]), int(out[1]), out[2] if len(out) > 2 else "?"
            if best is None or seconds < best[0]:
                best = (seconds, rss_kib, found)
        seconds, rss_kib, found = best
        rows.append(f"| {name} ({size_mb:.0f} MB) | {label} | {seconds:.2f} | {size_mb / seconds:.0f} | "
                    f"{rss_kib / 1024:.0f} | {found} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=200, help="size of each generated log in MiB (default 200)")
    parser.add_argument("--runs", type=int, default=3, help="runs per command; the best is reported (default 3)")
    parser.add_argument("--keep", action="store_true", help="keep the generated inputs in bench/.data")
    args = parser.parse_args()
    data = ROOT / "bench" / ".data" if args.keep else Path(tempfile.mkdtemp(prefix="spikeops-bench-"))
    data.mkdir(parents=True, exist_ok=True)
    kernel, training = data / f"kernel-{args.mb}mb.log", data / f"train-{args.mb}mb.log"
    if not kernel.exists():
        print(f"generating {kernel} ...", file=sys.stderr)
        make_kernel_log(kernel, args.mb)
    if not training.exists():
        print(f"generating {training} ...", file=sys.stderr)
        make_training_log(training, args.mb)
    print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; best of {args.runs} runs\n")
    print("| input | reader | seconds | MB/s | peak RSS MiB | found |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in run_case("kernel log, Xid 79 at 1/2000 lines", kernel, "kernel-log", "NVRM: Xid|SXid", NAIVE_KERNEL, args.runs):
        print(row)
    for row in run_case("Megatron training log", training, "training-log", "iteration", NAIVE_TRAINING, args.runs):
        print(row)
    if not args.keep:
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()

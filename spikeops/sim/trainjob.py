"""A simulated training job for the demo: replays a scenario's metrics as a live run would.

The demo needs a job that a scheduler starts and stops, whose metrics grow step by step
(so the watcher sees the divergence as it happens), and whose files are what
``spikeops.train`` writes. Training a model that really diverges on demand would take
minutes; replaying a simulated incident (``spikeops.sim.build_bundle``) takes seconds and
reaches every cause. So this process:

- copies the scenario's job description (incident.json, with its checkpoints mapped to the
  real checkpoint directories the demo laid out) and ``reference/`` into the run directory;
- writes the steps before the incident window at once (the run's history), then the rest
  at ``rate`` steps a second, each step's lines of metrics.jsonl, ranks.jsonl and
  batches.jsonl together, flushed whole (a reader never sees half a step);
- a scenario whose job logs only text (train.log, no metrics.jsonl) has its log replayed the
  same way, its last lines paced;
- then keeps "training" without progress until the scheduler stops it. SIGUSR1 (a
  checkpoint-and-exit request, as ``scancel --signal=USR1 --batch`` sends) and SIGTERM end it
  cleanly; ``hold`` seconds end it anyway, so a forgotten demo job cannot run forever.

With ``--metrics-addr HOST:PORT`` the job also serves each replayed step on a Prometheus
``/metrics`` endpoint (``spikeops.train.PrometheusExporter``, labelled with the scheduler's job
id and ``--cluster``), as a real job instrumented with spikeops.train would: what
``spikeops demo --monitoring prometheus`` scrapes.

Started again with ``SPIKEOPS_RESUME_FROM`` set (the incident flow's resume), it records what
it was asked to do (``resumed.json``: checkpoint, remediation, nodes) and waits, healthy.

``seed_baselines(store, scenario)`` fills a baseline store (``spikeops.baselines``) with the
scenario's pre-incident captures, stamped at the job's start: what the scheduled refresh would
hold when the incident begins.

``lay_checkpoints(root, scenario)`` makes the scenario's checkpoints real: one directory per
entry with a file and a MANIFEST.json; an entry the scenario marks unverified is damaged
after its manifest was written, so verification fails on it for real.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from spikeops.checkpoints import write_manifest
from spikeops.timeparse import parse_any

__all__ = ["lay_checkpoints", "seed_baselines", "replay", "main", "STREAMS"]

#: The files a spikeops.train job writes, replayed step by step.
STREAMS = ("metrics.jsonl", "ranks.jsonl", "batches.jsonl")


def lay_checkpoints(root: str | Path, scenario: str | Path) -> dict[int, Path]:
    """Real checkpoint directories for the scenario's checkpoints.json; returns step -> path."""
    root = Path(root)
    entries = json.loads((Path(scenario) / "checkpoints.json").read_text())
    laid = {}
    for entry in entries:
        folder = root / f"global_step{entry['step']}"
        shard = folder / "mp_rank_00" / "model_optim_rng.pt"
        shard.parent.mkdir(parents=True, exist_ok=True)
        shard.write_bytes(b"w" * 4096 + str(entry["step"]).encode())
        write_manifest(folder, step=int(entry["step"]))
        if entry.get("verified") is False:  # damaged after it was written, as the scenario says
            shard.write_bytes(b"w" * 1024)
        laid[int(entry["step"])] = folder
    return laid


def seed_baselines(store: str | Path, scenario: str | Path) -> list[str]:
    """The scenario's ``nodes/*/baseline/`` as a baseline store; the nodes seeded."""
    from spikeops.baselines import BASELINE_FILE

    scenario, store = Path(scenario), Path(store)
    incident = json.loads((scenario / "incident.json").read_text())
    started = parse_any((incident.get("job") or {}).get("started")) or parse_any(
        (incident.get("window") or {}).get("start"))
    if started is None:
        return []
    captured = (started - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
    seeded = []
    for folder in sorted((scenario / "nodes").glob("*/baseline")):
        node = folder.parent.name
        target = store / node
        target.mkdir(parents=True, exist_ok=True)
        probes = {}
        for source in sorted(folder.glob("*.txt")):
            shutil.copyfile(source, target / source.name)
            probes[source.name] = {"probe": source.stem, "captured": captured}
        (target / BASELINE_FILE).write_text(json.dumps(
            {"node": node, "captured": captured, "source": "spikeops demo (scenario baseline)", "probes": probes},
            indent=1) + "\n")
        seeded.append(node)
    return seeded


def _steps(path: Path) -> dict[int, list[str]]:
    """Each step's lines, in file order (lines without a step stay with the step before)."""
    out: dict[int, list[str]] = {}
    current = None
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            current = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            pass
        if current is not None:
            out.setdefault(current, []).append(line)
    return out


def _job_description(scenario: Path, checkpoints: dict[int, Path]) -> dict[str, Any]:
    incident = json.loads((scenario / "incident.json").read_text())
    resumed = (incident.get("job") or {}).get("resumed_from")
    if isinstance(resumed, dict) and resumed.get("step") in checkpoints:
        resumed["path"] = str(checkpoints[int(resumed["step"])])
    return incident


def _window_start(incident: dict[str, Any]) -> float | None:
    moment = parse_any((incident.get("window") or {}).get("start"))
    return moment.timestamp() if isinstance(moment, datetime) else None


def _time_of(line: str) -> float | None:
    try:
        value = json.loads(line).get("time")
    except (ValueError, AttributeError):
        return None
    moment = parse_any(value)
    return moment.timestamp() if isinstance(moment, datetime) else None


class _Stop(Exception):
    pass


def replay(scenario: str | Path, run_dir: str | Path, *, rate: float = 60.0, checkpoint_root: str | Path | None = None,
           hold: float = 600.0, exporter: Any = None) -> int:
    """Replay the scenario into ``run_dir``; returns the last step written. ``exporter``
    (a ``PrometheusExporter``) observes each step's metrics record as it is written."""
    scenario, run = Path(scenario), Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    checkpoints = {}
    if checkpoint_root is not None:
        from spikeops.checkpoints import find_checkpoints

        checkpoints = {c.step: c.path for c in find_checkpoints(checkpoint_root) if c.step is not None}
    incident = _job_description(scenario, checkpoints)
    (run / "incident.json").write_text(json.dumps(incident, indent=1) + "\n")
    if (scenario / "reference").is_dir():
        shutil.copytree(scenario / "reference", run / "reference", dirs_exist_ok=True)
    if not (scenario / "metrics.jsonl").is_file() and (scenario / "train.log").is_file():
        _replay_log(scenario / "train.log", run / "train.log", rate)
        for name in STREAMS:  # the per-rank files, whole: the log is what grows
            if (scenario / name).is_file():
                shutil.copyfile(scenario / name, run / name)
        print("replayed the training log; waiting to be stopped", flush=True)
        _wait(hold)
        return -1
    streams = {name: _steps(scenario / name) for name in STREAMS}
    order = sorted(streams["metrics.jsonl"])
    start = _window_start(incident)
    history = [s for s in order if start is not None and (_time_of(streams["metrics.jsonl"][s][0]) or 0) < start]
    handles = {name: (run / name).open("a") for name in STREAMS}
    last = -1
    try:
        for index, step in enumerate(order):
            for name, handle in handles.items():
                lines = streams[name].get(step)
                if lines:
                    handle.write("\n".join(lines) + "\n")
            if exporter is not None:
                for line in streams["metrics.jsonl"].get(step, ()):
                    try:
                        exporter.observe(json.loads(line))  # NaN tokens read as NaN
                    except ValueError:
                        pass
            last = step
            if step in history and index + 1 < len(history):
                continue
            for handle in handles.values():
                handle.flush()
            time.sleep(1.0 / rate)
    finally:
        for handle in handles.values():
            handle.close()
    print(f"replayed up to step {last}; waiting to be stopped", flush=True)
    _wait(hold)
    return last


def _replay_log(source: Path, target: Path, rate: float, paced_seconds: float = 6.0) -> None:
    """A job that logs only text (Megatron, DeepSpeed): its history at once, then its last
    lines at ``rate`` lines a second, so a follower sees the end arrive."""
    lines = source.read_text(errors="replace").splitlines(keepends=True)
    paced = min(len(lines), int(rate * paced_seconds))
    with target.open("a") as handle:
        handle.writelines(lines[: len(lines) - paced])
        handle.flush()
        for line in lines[len(lines) - paced:]:
            handle.write(line)
            handle.flush()
            time.sleep(1.0 / rate)


def _wait(hold: float) -> None:
    deadline = time.monotonic() + hold
    try:
        while time.monotonic() < deadline:
            time.sleep(0.2)
    except _Stop:
        print("stop requested: exiting", flush=True)


def _on_signal(number: int, _frame: Any) -> None:
    raise _Stop(number)


def _resumed(run_dir: Path, hold: float) -> int:
    from spikeops.train import ResumeRequest

    request = ResumeRequest.from_env()
    parts = [request.describe()] if request.remediated else []
    if os.environ.get("NCCL_DEBUG"):
        parts.append(f"NCCL_DEBUG={os.environ['NCCL_DEBUG']}")
    remediation = "; ".join(parts) or "none (a plain resume)"
    record = {"checkpoint": request.checkpoint, "remediation": remediation,
              "nodes": os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SPIKEOPS_JOB_NODES"),
              "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("SPIKEOPS_LOCAL_JOB"), "pid": os.getpid()}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "resumed.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"resumed from {request.checkpoint} ({remediation})", flush=True)
    _wait(hold)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spikeops.sim.trainjob",
                                     description="Replay a simulated incident's metrics as a live training job.")
    parser.add_argument("--scenario", required=True, type=Path, help="the scenario bundle (spikeops.sim.build_bundle)")
    parser.add_argument("--run-dir", required=True, type=Path, help="where the job writes its spikeops.train files")
    parser.add_argument("--checkpoint-root", type=Path, default=None, help="the real checkpoint directories")
    parser.add_argument("--rate", type=float, default=60.0, help="steps a second inside the incident window")
    parser.add_argument("--hold", type=float, default=600.0, help="seconds to wait to be stopped, at most")
    parser.add_argument("--metrics-addr", metavar="HOST:PORT", default=None,
                        help="also serve the step metrics for Prometheus there (spikeops.train.PrometheusExporter)")
    parser.add_argument("--cluster", default=None, help="the exporter's cluster label")
    args = parser.parse_args(argv)
    for number in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(number, _on_signal)
    try:
        if os.environ.get("SPIKEOPS_RESUME_FROM"):
            return _resumed(args.run_dir, args.hold)
        exporter = None
        if args.metrics_addr:
            from spikeops.train import PrometheusExporter

            job = os.environ.get("SLURM_JOB_ID") or os.environ.get("SPIKEOPS_LOCAL_JOB") or "demo"
            exporter = PrometheusExporter(args.metrics_addr, job_id=job, cluster=args.cluster)
        replay(args.scenario, args.run_dir, rate=args.rate, checkpoint_root=args.checkpoint_root, hold=args.hold,
               exporter=exporter)
    except _Stop:
        print("stop requested: exiting", flush=True)
    except (OSError, ValueError) as exc:
        print(f"trainjob: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

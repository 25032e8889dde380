"""Run several multi-process train_tiny jobs from one interpreter, for the replay tests.

    python tests/train_runs.py JOBS.json RESULTS.json

JOBS.json: a list of {"argv": [...], "env": {...}} or {"snapshot": DIR}. Each job is examples/train_tiny.py's
``main(argv)`` with ``env`` on top of this process's environment (every SPIKEOPS_ variable of
the previous job removed first), exactly as a scheduler would start the command with that
environment: the launcher (``--nodes``) reads the variables, forks one process per node, and
the ranks read them again. What is saved is the interpreter start and the torch import per
job (seconds each on a shared 2-core machine, more than a tiny run itself); the ranks are
still real processes talking gloo. RESULTS.json: per job the exit code, the one-line error,
and the wall seconds; per snapshot, every file under DIR but its replay/ folder, with its
size and modification time (what a replay must leave alone).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny.py"


def _example():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("train_tiny_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def snapshot(directory: Path) -> dict[str, list[int]]:
    return {str(p.relative_to(directory)): [p.stat().st_size, p.stat().st_mtime_ns] for p in directory.rglob("*")
            if p.is_file() and "replay" not in p.relative_to(directory).parts}


def run(jobs: list[dict], example) -> list[dict]:  # type: ignore[no-untyped-def, type-arg]
    results = []
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEOPS_")}
    for job in jobs:
        if "snapshot" in job:
            results.append({"files": snapshot(Path(job["snapshot"]))})
            continue
        os.environ.clear()
        os.environ.update(base)
        os.environ.update(job.get("env", {}))
        started = time.monotonic()
        code, error = 0, None
        try:
            example.main(job["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
            error = None if isinstance(exc.code, int) or exc.code is None else str(exc.code)
        results.append({"code": code, "error": error, "seconds": round(time.monotonic() - started, 3)})
    return results


if __name__ == "__main__":
    jobs = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(jobs, _example())))

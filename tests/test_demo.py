"""`spikeops demo` as a newcomer runs it: a subprocess that builds the world, lets the watcher
fire the incident flow on an ephemeral Prefect server, prints the story and stops
everything. Three scenarios: a hardware fault, a data fault and a false alarm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spikeops.demo import default_seed
from spikeops.sim import build_bundle
from spikeops.sim.processes import proc_read, scan

BIN = Path(sys.executable).parent


def _leftovers(directory: Path) -> list[int]:
    """Processes that still mention the demo directory (sshd, jobs, the Prefect server)."""
    mark = str(directory).encode()
    return sorted(scan(lambda pid: mark in proc_read(pid, "cmdline") + proc_read(pid, "environ")))


def _demo(tmp_path: Path, scenario: str, *extra: str, cache: Path | None = None,
          name: str = "demo") -> tuple[str, Path]:
    directory = tmp_path / name
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "SLACK_"))}
    if cache is not None:
        env["XDG_CACHE_HOME"] = str(cache)
    done = subprocess.run([str(BIN / "spikeops"), "demo", "--scenario", scenario, "--dir", str(directory), *extra],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, directory


def _expected(tmp_path: Path, scenario: str):
    return build_bundle(tmp_path / "expected", scenario, seed=default_seed(scenario), nodes=8)


def _line(stdout: str, prefix: str) -> str:
    return next(line for line in stdout.splitlines() if line.split("] ", 1)[-1].startswith(prefix))


def test_hardware_demo_drains_the_culprit_and_resumes(tmp_path: Path) -> None:
    stdout, directory = _demo(tmp_path, "gpu_xid")
    expected = _expected(tmp_path, "gpu_xid")
    assert "watcher: nan at step" in stdout
    diagnosis = _line(stdout, "DIAGNOSIS:")
    assert "gpu_xid (hardware layer" in diagnosis and "instant_nan" in diagnosis
    culprit = expected.culprit_nodes[0]
    assert _line(stdout, "  culprit nodes:").endswith(culprit)
    done = _line(stdout, "DONE:")
    assert f"drain {culprit}: drained" in done and "resubmitted" in done
    resumed = _line(stdout, "  resumed run:")
    assert "global_step" in resumed and culprit not in resumed.split(" on ", 1)[1]
    bundle = directory / "incidents" / "inc-demo-gpu-xid"
    for name in ("report.md", "report.html", "plot.png", "outbox.jsonl"):
        assert f"{name}" in stdout and (bundle / name).is_file()
    slack = (bundle / "outbox.jsonl").read_text().splitlines()
    printed = [line for line in stdout.splitlines() if line.split("] ", 1)[-1].startswith("slack")]
    assert len(printed) == len(slack) >= 6  # every message, as it was written
    assert json.loads((bundle / "diagnosis.json").read_text())["culprit_nodes"] == [culprit]
    assert _leftovers(directory) == []


def test_data_demo_names_the_sample_and_drains_nothing(tmp_path: Path) -> None:
    stdout, directory = _demo(tmp_path, "overlong_sample", "--scheduler", "local")
    expected = _expected(tmp_path, "overlong_sample")
    diagnosis = _line(stdout, "DIAGNOSIS:")
    assert "overlong_sample (data layer" in diagnosis and expected.symptom in diagnosis
    assert _line(stdout, "  culprit nodes:").endswith("none")
    assert "drain" not in _line(stdout, "DONE:")
    if expected.symptom == "instant_nan":  # stopped, then resumed with the batch skipped
        assert "skipping step(s)" in _line(stdout, "  resumed run:")
    assert _leftovers(directory) == []


def test_false_alarm_demo_changes_nothing(tmp_path: Path) -> None:
    stdout, directory = _demo(tmp_path, "false_alarm", "--scheduler", "local")
    assert "watcher: no NaN, spike, loss-scale collapse or throughput drop" in stdout
    assert "false_alarm (none layer" in _line(stdout, "DIAGNOSIS:")
    assert _line(stdout, "DONE:").endswith("nothing changed on the cluster")
    assert _leftovers(directory) == []


def test_demo_bad_input_is_one_line(tmp_path: Path) -> None:
    from spikeops.cli import main

    for argv in (["demo", "--scenario", "no_such"], ["demo", "--nodes", "1"], ["demo", "--stop", str(tmp_path)]):
        done = subprocess.run([str(BIN / "spikeops"), *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (argv, done.stderr)
    import io

    out = io.StringIO()
    assert main(["demo", "--list"], out=out) == 0
    listed = [line.split()[0] for line in out.getvalue().splitlines()]
    from spikeops.demo.run import REPLAY_SCENARIOS
    from spikeops.vocabulary import LAYER_OF

    # every cause of the spec is a scenario (silent data corruption through the replay gate's three)
    assert sorted(listed) == sorted([*LAYER_OF, *REPLAY_SCENARIOS])


def test_sdc_demo_replays_the_spike_and_drains_only_the_corrupting_node(tmp_path: Path) -> None:
    """A real 3-process job on the real Slurm when installed: the replay gate convicts the node
    whose GPU flips bits, and the thread and the printout say what the replay cost."""
    stdout, directory = _demo(tmp_path, "sdc_persistent")
    job = _line(stdout, "job: examples/train_tiny.py")
    bad = job.split("the fault: ", 1)[1].split("'s GPU", 1)[0]
    assert "silent_data_corruption (hardware layer" in _line(stdout, "DIAGNOSIS:")
    assert _line(stdout, "  culprit nodes:").endswith(bad)
    verdict = _line(stdout, "slack: Replay verdict: *sdc*")
    assert "steps replayed twice" in (directory / "incidents" / "inc-demo-sdc-persistent" / "outbox.jsonl").read_text()
    assert verdict
    done = _line(stdout, "DONE:")
    assert f"drain {bad}: drained" in done and done.count("drain ") == 1 and "resubmitted" in done
    assert _leftovers(directory) == []


def test_later_demos_start_prefect_from_the_cached_migrated_database(tmp_path: Path) -> None:
    """The first demo keeps its freshly migrated database as a template; the next starts from
    it; a template that is not a database is dropped and made again, and the demo still runs."""
    import sqlite3

    cache = tmp_path / "cache"
    first, _ = _demo(tmp_path, "false_alarm", "--scheduler", "local", "--nodes", "2", cache=cache, name="d1")
    assert "from the cached migrated one" not in first
    (template,) = (cache / "spikeops").glob("prefect-demo-*.db")
    with sqlite3.connect(template) as db:
        tables = {row[0] for row in db.execute("select name from sqlite_master where type = 'table'")}
    assert {"flow_run", "alembic_version"} <= tables
    second, _ = _demo(tmp_path, "false_alarm", "--scheduler", "local", "--nodes", "2", cache=cache, name="d2")
    assert "from the cached migrated one" in second
    template.write_bytes(b"not a database")
    third, _ = _demo(tmp_path, "false_alarm", "--scheduler", "local", "--nodes", "2", cache=cache, name="d3")
    assert "from the cached migrated one" not in third and "DIAGNOSIS: false_alarm" in third
    with sqlite3.connect(template) as db:  # made again from the third demo's fresh database
        assert db.execute("select count(*) from alembic_version").fetchone()[0] == 1


def test_hang_demo_names_the_rank_from_the_flight_recorder_and_resumes(tmp_path: Path) -> None:
    """A job that stops with no NaN and no spike: the watcher calls it stalled, the flow keeps it
    running while it collects the flight recorder, names the rank that never joined the
    collective and its node, drains nothing and resumes."""
    from spikeops.sim.cluster import scratch

    with scratch("spikeops-demo-hang-") as root:  # not tmp_path: the nodes' login user must reach it
        stdout, directory = _demo(root, "collective_hang", "--scheduler", "local", "--nodes", "4")
        assert _leftovers(directory) == []
    expected = build_bundle(tmp_path / "expected", "collective_hang", seed=default_seed("collective_hang"), nodes=4)
    assert "watcher: stalled at step" in stdout
    assert "collective_hang (communication layer" in _line(stdout, "DIAGNOSIS:")
    assert _line(stdout, "  culprit nodes:").endswith("none")
    why = _line(stdout, "  why:")
    assert f"rank(s) {expected.culprit_ranks[0]} on " in why and "never entered it" in why
    assert "drain" not in _line(stdout, "DONE:") and "resubmitted" in _line(stdout, "DONE:")
    assert "stopping the job" in stdout  # after the collection, not before

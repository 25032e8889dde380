"""Served runs are forked from a process that already imported the flow (spikeops.deployments.warm_start)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = textwrap.dedent("""
    import json, sys
    from spikeops.deployments import warm_start

    def child(queue):
        # what the run's process holds before it imports anything itself
        queue.put({"flow": "spikeops.flows.incident_response" in sys.modules, "prefect": "prefect.flow_engine" in sys.modules,
                   "diagnosis": "spikeops.diagnosis.engine" in sys.modules})

    if __name__ == "__main__":
        enable = sys.argv[1] == "warm"
        if enable:
            assert warm_start.enable()
        from prefect import flow_engine
        ctx = flow_engine.multiprocessing.get_context("spawn")  # what Prefect's runner asks for
        queue = ctx.Queue()
        process = ctx.Process(target=child, args=(queue,))
        process.start()
        got = queue.get(timeout=120)
        process.join(60)
        print(json.dumps({"method": ctx.get_start_method(), "enabled": warm_start.enabled(), **got}))
""")


def _run(tmp_path: Path, mode: str) -> dict[str, object]:
    import json

    script = tmp_path / "probe_warm.py"
    script.write_text(_PROBE)
    done = subprocess.run([sys.executable, str(script), mode], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path),
                               "PREFECT_HOME": str(tmp_path / "prefect")})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_run_process_starts_with_the_flow_already_imported(tmp_path: Path) -> None:
    got = _run(tmp_path, "warm")
    assert got == {"method": "forkserver", "enabled": True, "flow": True, "prefect": True,
                   "diagnosis": True}


def test_without_it_the_runner_spawns_a_bare_interpreter(tmp_path: Path) -> None:
    got = _run(tmp_path, "cold")
    assert got == {"method": "spawn", "enabled": False, "flow": False, "prefect": False,
                   "diagnosis": False}


def test_the_warm_worker_starts_only_spikeops_flows_named_by_module() -> None:
    """``spikeops worker`` forks a run warm only for our own flows by module; anything else (a
    file path, another package's flow, a module that does not load) takes Prefect's own path."""
    from spikeops.deployments.warm_worker import our_flow
    from spikeops.flows.incident_response import incident_response

    assert our_flow("spikeops.flows.incident_response.incident_response") is incident_response
    assert our_flow("spikeops.flows.incident_response:incident_response") is incident_response
    for other in ("flows/incident_response.py:incident_response", "mypkg.flows.train.train", "",
                  None, "spikeops.flows.no_such_module.flow", "spikeops.flows.incident_response.IncidentParams"):
        assert our_flow(other) is None, other

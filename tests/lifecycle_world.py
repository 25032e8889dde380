"""The world the node-lifecycle tests run in: real sshd nodes answering from a simulated GPU
incident whose culprit is convicted by the real diagnosis (an Xid the simulator chose, found by
its answer, never hard-coded), the ledger of the test (``own_ledger``), a spikeops.toml for the
cluster, and helpers to run ``spikeops`` and read a node's record."""

from __future__ import annotations

import io
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spikeops.cli import main
from spikeops.sim import build_bundle
from spikeops.sim import cluster as simcluster

SEEDS = range(40)
NODES = 4


def find_incident(cause: str, wanted: Callable[[Any], bool]) -> tuple[int, Any]:
    """The first seed whose simulated incident on NODES nodes is ``wanted`` (built as
    ``spikeops.sim.cluster.up`` builds it)."""
    with tempfile.TemporaryDirectory(prefix="lifecycle-find-") as scratch:
        for seed in SEEDS:
            answer = build_bundle(Path(scratch) / str(seed), cause, seed=seed, nodes=NODES, distractors=False)
            if wanted(answer):
                return seed, answer
    raise AssertionError(f"no {cause} incident among seeds {SEEDS} is the one wanted")


def reset_class_xid(answer: Any) -> bool:
    return any(f"Xid {code} " in answer.notes for code in (79, 48, 94, 95))


@dataclass
class World:
    cluster: simcluster.Cluster
    work: Path
    config: Path
    culprit: str
    incident: str
    answer: Any

    @property
    def healthy(self) -> list[str]:
        return [n for n in self.cluster.nodes if n != self.culprit]

    def cli(self, *argv: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = main([*argv, "--config", str(self.config)], out=out, err=err)
        return code, out.getvalue(), err.getvalue()

    def history(self, node: str) -> dict[str, Any]:
        code, out, err = self.cli("nodes", "history", node, "--json")
        assert code == 0, err
        return json.loads(out)

    def kinds(self, node: str) -> list[tuple[str, str]]:
        return [(e["kind"], e["result"]) for e in self.history(node)["events"]]

    def tool(self, node: str, tool: str, mode: str | None) -> None:
        from spikeops.sim.nodelife import set_tool

        set_tool(self.cluster.directory, node, tool, mode)

    def convict(self, incident: str | None = None, node: str | None = None) -> str:
        """The simulated incident diagnosed and entered in the ledger as the flow would at its
        end (a copy of the scenario's bundle under the incidents directory, ``incident`` its id),
        convicted now. Returns the incident id."""
        from spikeops.diagnosis import diagnose
        from spikeops.ledger.entry import entry_from_bundle
        from spikeops.ledger.store import Ledger, stamp

        bundle = self.work / "incidents" / (incident or self.incident)
        if not bundle.exists():
            shutil.copytree(self.cluster.scenario_bundle, bundle)
            doc = json.loads((bundle / "incident.json").read_text())
            doc["incident_id"] = incident or self.incident
            (bundle / "incident.json").write_text(json.dumps(doc))
            (bundle / "diagnosis.json").write_text(json.dumps(diagnose(bundle).to_json()))
        entry = entry_from_bundle(bundle, {"cluster": "sim", "t_diagnosed": stamp(datetime.now(UTC))})
        if node is not None:  # the same evidence against another node (a second conviction)
            entry["incident"]["culprit_nodes"] = [node]
            for event in entry["node_events"]:
                event["node"] = node
        with Ledger() as ledger:
            ledger.apply(entry)
        return entry["incident"]["incident_id"]


@contextmanager
def lifecycle_world(first_address: str, *, scheduler_lines: str, extra: str = "",
                    cause: str = "gpu_xid", wanted: Callable[[Any], bool] = reset_class_xid) -> Iterator[World]:
    """The sim cluster of an incident ``wanted``, and spikeops.toml's ``[clusters.sim]`` with
    ``scheduler_lines`` (which scheduler) and ``extra`` (the lifecycle's keys)."""
    seed, answer = find_incident(cause, wanted)
    port = simcluster.free_port((first_address,))
    with simcluster.scratch("spikeops-lifecycle-") as scratch, \
            simcluster.running(scratch / "cluster", nodes=NODES, port=port, first_address=first_address,
                               scenario=cause, seed=seed) as cluster:
        work = scratch / "work"
        work.mkdir()
        config = work / "spikeops.toml"
        config.write_text(
            f'[incidents]\ndir = "{work}/incidents"\n'
            f'[clusters.sim]\ninventory = "{cluster.inventory}"\nrun_dir = "{cluster.scenario_bundle}"\n'
            f'{scheduler_lines}\ncontrol_command = ["healthy-run"]\ncontrol_timeout_s = 30\n'
            f'validation_timeouts = {{ "dcgmi-diag" = 60, "all-reduce" = 60 }}\n{extra}\n')
        incident = json.loads((cluster.scenario_bundle / "incident.json").read_text())["incident_id"]
        yield World(cluster, work, config, answer.culprit_nodes[0], incident, answer)


def reboot_program(world: World, path: Path) -> Path:
    """A program that reboots a node of the sim cluster as a RebootProgram does: the node's
    answers start again (a new kernel log) and its GPUs are back (a healthy node's nvidia-smi)."""
    path.write_text(f"#!/bin/sh\nexec {sys.executable} -m spikeops.sim.nodelife reboot --dir {world.cluster.directory} "
                    f"\"$1\" --smi-from {world.healthy[0]}\n")
    path.chmod(0o755)
    return path

"""Collection shards on Dask: a real ``distributed`` scheduler and two worker processes on
loopback run the shard tasks (prefect-dask's DaskTaskRunner), and the bundle they write is
the thread-backed one, byte for byte; ``collect_runner`` in spikeops.toml chooses it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from spikeops.config import load_config, resolve_incident
from spikeops.errors import InputError
from spikeops.sim import cluster as simcluster
from tests.scaleout import dask_cluster

pytest.importorskip("prefect_dask")

#: What differs between two collections of the same nodes: when each probe ran and how long it took.
TIMING = {"started", "seconds", "finished"}
#: Nodes of the repeated-collection test, and how long one collection of them may take here.
NODES = 192
COLLECTION_LIMIT_S = 90


def _untimed(value: object) -> object:
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k not in TIMING}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_dask_collection_equals_the_thread_collection_byte_for_byte(tmp_path: Path, prefect_server: None) -> None:
    from distributed import Client
    from prefect import flow

    from spikeops.tasks.collect import collect_evidence

    port = simcluster.free_port(("127.0.16.11",))
    with simcluster.running(tmp_path / "c", nodes=9, port=port, first_address="127.0.16.11", scenario="gpu_xid",
                            seed=3, faults={"#7": "refuse"}) as cluster, \
            dask_cluster(tmp_path / "dask", workers=2, threads=2) as address:

        @flow
        def collect(bundle: str, dask_scheduler: str | None) -> list[tuple[str, str]]:
            result = collect_evidence(cluster.inventory, cluster.job, bundle, shard_size=2,
                                      dask_scheduler=dask_scheduler)
            return [(r.node, r.outcome) for r in result.nodes]

        threads = collect(str(tmp_path / "threads"), None)
        dask = collect(str(tmp_path / "dask-bundle"), address)
        with Client(address) as client:
            executed = client.run(lambda dask_worker: dask_worker.state.executed_count)
    assert dask == threads and len(threads) == 9
    assert sum(outcome == "unreachable" for _, outcome in dask) == 1  # the refused node, recorded the same way
    # five shards of at most two nodes, spread over both worker processes
    assert sorted(executed.values()) != [0, 5] and sum(executed.values()) == 5, executed
    assert sum(name.endswith("kernel.log") for name in _files(tmp_path / "threads" / "nodes")) == 8
    _assert_same_evidence(tmp_path / "threads", tmp_path / "dask-bundle")


def _assert_same_evidence(one_bundle: Path, other_bundle: Path) -> None:
    """What the shards wrote: every node's evidence, byte for byte (probes.json without its
    clock), and the record of the collection as a whole, but for where each bundle is."""
    one, other = _files(one_bundle / "nodes"), _files(other_bundle / "nodes")
    assert sorted(one) == sorted(other)
    for name, data in one.items():
        if name.endswith("probes.json"):
            assert _untimed(json.loads(data)) == _untimed(json.loads(other[name])), name
        else:
            assert data == other[name], name
    records = [_untimed(json.loads((bundle / "collection.json").read_text())) for bundle in (one_bundle, other_bundle)]
    assert [r.pop("bundle") for r in records] == [str(one_bundle), str(other_bundle)]
    assert records[0] == records[1]


def test_consecutive_dask_collections_on_the_same_workers_all_finish(tmp_path: Path, prefect_server: None) -> None:
    """The benchmark's second 1,024-node collection on a reused worker hung (issue 20): on
    Python 3.11 the worker's statistical profiler (``sys._current_frames()``) can deadlock
    with the threads a shard starts and ends (CPython gh-106883; tasks/dask_worker.py). It
    is a race: here two shards of 96 nodes, 64 at once each, run with the profiler sampling
    every millisecond rather than every 10, so that three collections on the same two worker
    processes meet it as a thousand nodes did. Each must finish, with the thread-backed
    evidence byte for byte, and the profiler must be off on both workers."""
    import os
    import threading

    from distributed import Client
    from prefect import flow

    from spikeops.tasks.collect import collect_evidence

    port = simcluster.free_port(("127.16.21.11",))
    environment = dict(os.environ, DASK_DISTRIBUTED__WORKER__PROFILE__INTERVAL="1ms")
    with simcluster.running(tmp_path / "c", nodes=NODES, port=port, first_address="127.16.21.11") as cluster, \
            dask_cluster(tmp_path / "dask", workers=2, threads=1, env=environment) as address, \
            Client(address) as client:
        # handshakes of 128 nodes at once on 2 cores can take over 5 s, and a probe (eight since
        # the job-state probes) over 10: this test is about a hung worker, not the probes' bounds
        inventory = Path(cluster.inventory)
        inventory.write_text(inventory.read_text().replace("connect_timeout = 5", "connect_timeout = 30")
                             .replace("command_timeout = 10", "command_timeout = 30"))

        @flow
        def collect(bundle: str, dask_scheduler: str | None) -> list[str]:
            result = collect_evidence(cluster.inventory, cluster.job, bundle, shard_size=NODES // 2,
                                      dask_scheduler=dask_scheduler)
            return [r.outcome if r.outcome == "ok" else f"{r.outcome}: {r.detail}" for r in result.nodes]

        def within(seconds: float, bundle: Path, dask_scheduler: str | None) -> list[str]:
            done: list[list[str]] = []
            # a daemon thread: a deadlocked worker must fail the test, not hang it
            runner = threading.Thread(target=lambda: done.append(collect(str(bundle), dask_scheduler)), daemon=True)
            runner.start()
            runner.join(seconds)
            assert done, f"the collection into {bundle.name} did not finish in {seconds:.0f} s (a worker hung?)"
            return done[0]

        assert within(COLLECTION_LIMIT_S, tmp_path / "threads", None) == ["ok"] * NODES
        pids = client.run(os.getpid)
        for index in range(3):
            before = client.run(lambda dask_worker: dask_worker.state.executed_count)
            outcomes = within(COLLECTION_LIMIT_S, tmp_path / f"dask-{index}", address)
            executed = client.run(lambda dask_worker: dask_worker.state.executed_count)
            assert outcomes == ["ok"] * NODES, (index, [o for o in outcomes if o != "ok"])
            assert sum(executed.values()) - sum(before.values()) == 2, (index, before, executed)  # its two shards
            _assert_same_evidence(tmp_path / "threads", tmp_path / f"dask-{index}")
        assert client.run(os.getpid) == pids  # the same two worker processes all along
        profiling = client.run(lambda dask_worker: dask_worker.periodic_callbacks["profile"].is_running())
    assert list(profiling.values()) == [sys.version_info >= (3, 12)] * 2


def test_an_unreachable_dask_scheduler_falls_back_to_threads(tmp_path: Path, prefect_server: None) -> None:
    from prefect import flow

    from spikeops.tasks.collect import collect_evidence
    from tests.scaleout import _free_port

    port = simcluster.free_port(("127.0.16.31",))
    with simcluster.running(tmp_path / "c", nodes=2, port=port, first_address="127.0.16.31") as cluster:

        @flow
        def collect(bundle: str) -> list[str]:
            result = collect_evidence(cluster.inventory, cluster.job, bundle,
                                      dask_scheduler=f"tcp://127.0.0.1:{_free_port()}")
            return [r.outcome for r in result.nodes]

        assert collect(str(tmp_path / "b")) == ["ok", "ok"]  # the evidence, collected by the flow's threads


CONFIG = """
[clusters.sim]
inventory = "/etc/spikeops/sim.toml"
run_dir = "/runs/{{job}}"
{extra}
"""


def test_collect_runner_is_chosen_and_checked_in_spikeops_toml(tmp_path: Path) -> None:
    path = tmp_path / "spikeops.toml"
    path.write_text(CONFIG.format(extra=""))
    assert resolve_incident(load_config(path), "7", "sim", {}).dask_scheduler is None  # default: threads
    path.write_text(CONFIG.format(extra='collect_runner = "dask"\ndask_scheduler = "tcp://10.1.0.5:8786"'))
    config = load_config(path)
    assert config.clusters["sim"].collect_runner == "dask"
    assert resolve_incident(config, "7", "sim", {}).dask_scheduler == "tcp://10.1.0.5:8786"
    path.write_text(CONFIG.format(extra='dask_scheduler = "tcp://10.1.0.5:8786"'))  # kept, not used
    assert resolve_incident(load_config(path), "7", "sim", {}).dask_scheduler is None
    for extra, words in (('collect_runner = "ray"', "collect_runner"),
                         ('collect_runner = "dask"', "needs dask_scheduler"),
                         ('collect_runner = "dask"\ndask_scheduler = "10.1.0.5; rm -rf /"', "dask_scheduler")):
        path.write_text(CONFIG.format(extra=extra))
        with pytest.raises(InputError) as error:
            load_config(path)
        assert words in str(error.value) and "[clusters.sim]" in str(error.value) and "\n" not in str(error.value)

"""The Prefect wrapper: collection as a few shard tasks inside a flow, against real sshd
and a real (temporary) Prefect server; per-node results become a table artifact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spikeops.sim import cluster as simcluster

prefect = pytest.importorskip("prefect")


def test_sharded_collection_in_a_flow(tmp_path: Path, prefect_server: None) -> None:
    from prefect import flow
    from spikeops.inventory import load_inventory
    from spikeops.tasks.collect import collect_evidence

    port = simcluster.free_port(("127.0.10.11",))
    with simcluster.running(tmp_path / "c", nodes=5, port=port, first_address="127.0.10.11",
                            faults={"#4": "refuse"}) as cluster:

        @flow
        def incident(bundle: str):
            result = collect_evidence(cluster.inventory, cluster.job, bundle, shard_size=2,
                                      artifact_key="collection-test")
            return result

        @flow
        def read_artifact():
            from prefect.client.orchestration import get_client

            with get_client(sync_client=True) as client:
                return client.read_latest_artifacts()

        result = incident(str(tmp_path / "bundle"))
        artifacts = read_artifact()
    outcomes = {r.node: r.outcome for r in result.nodes}
    refused = next(iter(cluster.faults))
    assert outcomes[refused] == "unreachable"
    assert sorted(n for n, o in outcomes.items() if o == "ok") == sorted(n for n in cluster.nodes if n != refused)
    assert [r.node for r in result.nodes] == load_inventory(cluster.inventory).nodes  # shards back in order
    record = json.loads((tmp_path / "bundle" / "collection.json").read_text())
    assert record["summary"]["unreachable"] == refused
    table = next(a for a in artifacts if a.key == "collection-test")
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert {row["node"]: row["outcome"] for row in rows} == outcomes

"""Evidence collection over SSH (``spikeops collect``): plan, connect, run, write.

- ``plan``: which commands run on a node, from the registered remote probes and the inventory;
- ``ssh``: strict connections (known_hosts only) and the naming of every failure;
- ``runner``: one node's probes as concurrent channels, with per-probe timeouts and caps;
- ``collector``: the fan-out over nodes into a bundle, and the summary.
"""

from __future__ import annotations

from spikeops.collect.collector import CollectResult, NodeResult, collect, collect_nodes

__all__ = ["CollectResult", "NodeResult", "collect", "collect_nodes"]

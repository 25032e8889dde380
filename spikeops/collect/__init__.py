"""Evidence collection over SSH (``spikeops collect``): plan, connect, run, write.

- ``plan``: which commands run on a node, from the registered remote probes and the inventory;
- ``ssh``: strict connections (known_hosts only) and the naming of every failure;
- ``single``: one node's probes in one SSH session, through a POSIX-sh runner on the node
  (``node_runner.sh``) that sends each probe's output, exit status and stderr (the default);
- ``openssh``: that session through OpenSSH's ``ssh`` instead of paramiko (``[ssh] client``);
- ``runner``: one node's probes as a session (channel) each, with per-probe timeouts and caps,
  and the accounting both modes share;
- ``collector``: the fan-out over nodes into a bundle, and the summary.
"""

from __future__ import annotations

from spikeops.collect.collector import CollectResult, NodeResult, collect, collect_nodes

__all__ = ["CollectResult", "NodeResult", "collect", "collect_nodes"]

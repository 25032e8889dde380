"""Planning a replay: where the "other nodes" replay runs, and what the job is told.

The replay on other nodes only says something about a node if every rank moves off the node
it ran on. Spare nodes are best: the suspect hosts nothing in the second replay. Without
enough spares the job's own nodes are permuted (a derangement: no node keeps its ranks), and
the verdict reads a node that follows the anomaly across the placements
(``spikeops.replay.verdict``). A one-node job with no spare cannot be replayed elsewhere,
and the plan says so instead of pretending.

A job learns that it is a replay from its environment, like every remediation
(``spikeops.train.ResumeRequest.from_env``):

- ``SPIKEOPS_REPLAY``: the run's name (``same-nodes``, ``other-nodes``), which also names
  the bundle folder ``replay/RUN/``;
- ``SPIKEOPS_REPLAY_UNTIL``: the last step to replay (the spike step);
- ``SPIKEOPS_REPLAY_OUT``: the directory that receives ``replay.jsonl`` (and ``replay.json``);
- ``SPIKEOPS_RESUME_FROM``: the checkpoint to replay from (the newest verified one before
  the onset);
- ``SPIKEOPS_RANK_NODES``: optional, the node of each rank in rank order (``a:b:c``), for a
  job that derives its rank from its node (one task per node under ``srun``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from spikeops.remediation import check_env
from spikeops.train.remedies import (
    ENV_RANK_NODES,
    ENV_REPLAY,
    ENV_REPLAY_OUT,
    ENV_REPLAY_UNTIL,
    ENV_RESUME_FROM,
    RUN_NAME,
)

__all__ = ["ENV_REPLAY", "ENV_REPLAY_UNTIL", "ENV_REPLAY_OUT", "ENV_RANK_NODES", "RUN_SAME", "RUN_OTHER",
           "RUN_NAME", "Placement", "plan_other_nodes", "rank_nodes_value", "replay_env"]

RUN_SAME = "same-nodes"
RUN_OTHER = "other-nodes"


@dataclass
class Placement:
    """Where the other-nodes replay puts each rank."""

    kind: str  # "spares", "mixed" (spares and the job's own nodes), "permuted", "impossible"
    ranks: dict[int, str] = field(default_factory=dict)
    #: original node -> the node its ranks go to
    node_map: dict[str, str] = field(default_factory=dict)
    reason: str = ""

    @property
    def possible(self) -> bool:
        return self.kind != "impossible"

    @property
    def nodes(self) -> list[str]:
        """The nodes the replay needs, in the order of their first rank."""
        seen: dict[str, None] = {}
        for _, node in sorted(self.ranks.items()):
            seen.setdefault(node, None)
        return list(seen)


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(str(n) for n in names if str(n)))


def plan_other_nodes(job_nodes: Iterable[str], spares: Iterable[str], ranks: Mapping[int, str] | None = None
                     ) -> Placement:
    """The other-nodes placement: each original node's ranks go to a spare while spares
    last, the remaining nodes' ranks to another of the job's nodes (none keeps its own).
    ``ranks``: rank -> node of the original run (default: rank i on the i-th node)."""
    nodes = _unique(job_nodes)
    free = [s for s in _unique(spares) if s not in set(nodes)]
    original = {int(r): str(n) for r, n in (ranks or {}).items()} or dict(enumerate(nodes))
    strangers = sorted({n for n in original.values() if n not in nodes})
    if not nodes:
        return Placement("impossible", reason="the job has no nodes to replay")
    if strangers:
        return Placement("impossible", reason=f"ranks run on {', '.join(strangers)}, not a node of the job")
    moved = min(len(free), len(nodes))
    node_map = {node: free[i] for i, node in enumerate(nodes[:moved])}
    rest = nodes[moved:]
    if len(rest) == 1:
        if not moved:
            return Placement("impossible", reason=f"a one-node job ({nodes[0]}) and no spare node: the replay "
                                                  f"cannot run anywhere else")
        node_map[rest[0]] = nodes[0]  # its node went to a spare, so it is free
    elif rest:
        for i, node in enumerate(rest):
            node_map[node] = rest[(i + 1) % len(rest)]
    kind = "spares" if not rest else "permuted" if not moved else "mixed"
    placed = {rank: node_map[node] for rank, node in sorted(original.items())}
    reason = {"spares": f"every node's ranks on a spare ({', '.join(free[:moved])})",
              "mixed": f"{moved} node(s) on spares, the rest permuted among the job's nodes",
              "permuted": "no spare node: the job's own nodes permuted, every rank on a node it did not run on"}[kind]
    return Placement(kind, placed, node_map, reason)


def rank_nodes_value(ranks: Mapping[int, str]) -> str:
    """``SPIKEOPS_RANK_NODES``: the node of rank 0, 1, ... joined with ``:``; ValueError when
    the ranks are not 0..N-1 or a node name cannot be passed in the environment."""
    ordered = sorted(ranks)
    if ordered != list(range(len(ordered))):
        raise ValueError(f"ranks must be 0..{len(ordered) - 1}, got {ordered[:8]}")
    value = ":".join(ranks[r] for r in ordered)
    check_env({ENV_RANK_NODES: value})
    return value


def replay_env(run: str, until: int, out: str, checkpoint: str, ranks: Mapping[int, str] | None = None
               ) -> dict[str, str]:
    """The variables that make the job a replay (checked like every remediation variable)."""
    if not RUN_NAME.match(run):
        raise ValueError(f"replay run name {run!r}: letters, digits, '_', '.', '-' only")
    if int(until) < 1:
        raise ValueError(f"replay until step {until}: not a step")
    env = {ENV_REPLAY: run, ENV_REPLAY_UNTIL: str(int(until)), ENV_REPLAY_OUT: str(out),
           ENV_RESUME_FROM: str(checkpoint)}
    if ranks:
        env[ENV_RANK_NODES] = rank_nodes_value(ranks)
    return check_env(env)

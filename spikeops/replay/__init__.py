"""The replay gate's core: tell bad data from a silently corrupting GPU by re-running the spike.

- ``read_replay``/``parse_replay``: ``replay/RUN/replay.jsonl``, truncation and garbage as gaps;
- ``compare_replays``: the verdict of a same-nodes and an other-nodes replay against the
  original run (``reproduced``, ``sdc``, ``transient``, ``inconclusive``), with evidence lines;
- ``sdc_finding``: the verdict as the diagnosis's ``silent_data_corruption`` finding;
- ``plan_other_nodes``/``replay_env``: where the other replay runs, what the job is told.

The job's side (recording a replay) is ``spikeops.train.ReplayRecorder``; docs/replay.md has
the whole picture. Pure: no torch, no Prefect.
"""

from __future__ import annotations

from spikeops.replay.bundle import bundle_verdict, has_replays, original_losses, rank_map
from spikeops.replay.plan import (
    ENV_RANK_NODES,
    ENV_REPLAY,
    ENV_REPLAY_OUT,
    ENV_REPLAY_UNTIL,
    RUN_OTHER,
    RUN_SAME,
    Placement,
    plan_other_nodes,
    rank_nodes_value,
    replay_env,
)
from spikeops.replay.records import REPLAY_FILE, ReplayRecord, ReplayRun, parse_replay, read_replay
from spikeops.replay.verdict import (
    CAUSE,
    VERDICTS,
    Evidence,
    ReplayVerdict,
    Reproduction,
    compare_replays,
    sdc_finding,
)

__all__ = [
    "read_replay", "parse_replay", "ReplayRun", "ReplayRecord", "REPLAY_FILE",
    "compare_replays", "ReplayVerdict", "Reproduction", "Evidence", "sdc_finding", "VERDICTS", "CAUSE",
    "plan_other_nodes", "Placement", "replay_env", "rank_nodes_value",
    "ENV_REPLAY", "ENV_REPLAY_UNTIL", "ENV_REPLAY_OUT", "ENV_RANK_NODES", "RUN_SAME", "RUN_OTHER",
    "bundle_verdict", "has_replays", "original_losses", "rank_map",
]

"""The replay gate on real computation: examples/train_tiny.py as a 3-process gloo job on CPU
(one process per simulated node), a GPU that silently corrupts one node's matmuls, the
replays the job writes, and the verdict ``spikeops.replay`` draws from them.

Three incidents, each an original run then a replay on the original nodes and one on spare
nodes, from the step-20 checkpoint through the spike step:

- a persistent bit flip on n2 from step 23: the replays disagree and n2, only n2, is named
  (a permuted placement, without spares, names it too);
- an overlong sample at step 23 and no flip: both replays reproduce the spike bit for bit,
  the hardware is acquitted;
- a one-off flip at step 23: neither replay meets it again, a transient.

The jobs of one incident run from one interpreter (tests/train_runs.py: the launcher forks
the ranks, so torch is imported once per incident rather than once per rank and job); one
test starts the ranks as ``srun`` would, as fresh processes that take their rank from
SLURM_PROCID or SPIKEOPS_RANK_NODES.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from spikeops.probes.training_log import parse_metrics_jsonl  # noqa: E402
from spikeops.replay import (  # noqa: E402
    RUN_OTHER,
    RUN_SAME,
    compare_replays,
    plan_other_nodes,
    read_replay,
    replay_env,
    sdc_finding,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_tiny.py"
NODES = ["n1", "n2", "n3"]
SPARES = ["s1", "s2", "s3"]
BAD_NODE, BAD_RANK = "n2", 1
SPIKE, STEPS, CKPT_EVERY = 23, 24, 10
ORIGINAL_RANKS = dict(enumerate(NODES))
RUN_PERMUTED = "other-nodes-permuted"


def _args(out: Path, *extra: str) -> list[str]:
    return ["--out", str(out), "--nodes", ",".join(NODES), "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY),
            *extra]


def _replay(out: Path, run: str, ranks: dict[int, str], extra: list[str]) -> dict[str, Any]:
    env = replay_env(run, SPIKE, str(out / "replay" / run), str(out / "ckpt" / "step-20"), ranks)
    return {"argv": _args(out, *extra), "env": env}


def _drive(jobs: list[dict[str, Any]], work: Path) -> list[dict[str, Any]]:
    (work / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "train_runs.py"), str(work / "jobs.json"),
                           str(work / "results.json")], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((work / "results.json").read_text())


class Incident:
    def __init__(self, out: Path, results: list[dict[str, Any]]) -> None:
        self.out, self.results = out, [r for r in results if "files" not in r]
        before, after = (r["files"] for r in results if "files" in r)
        self.untouched = bool(before) and before == after
        self.metrics = parse_metrics_jsonl((out / "metrics.jsonl").read_text())
        self.losses = {r.step: r.loss for r in self.metrics.records}
        self.incident = json.loads((out / "incident.json").read_text())

    def replay(self, run: str) -> Any:
        return read_replay(self.out / "replay" / run)

    def meta(self, run: str) -> dict[str, Any]:
        return json.loads((self.out / "replay" / run / "replay.json").read_text())

    def verdict(self, other: str = RUN_OTHER) -> Any:
        return compare_replays(self.metrics, self.incident["job"]["ranks"], self.replay(RUN_SAME), self.replay(other),
                               SPIKE)


def _incident(tmp_path_factory: pytest.TempPathFactory, name: str, extra: list[str], *,
              permuted: bool = False, more: list[dict[str, Any]] | None = None) -> Incident:
    work = tmp_path_factory.mktemp(name)
    out = work / "run"
    spares = plan_other_nodes(NODES, SPARES, ORIGINAL_RANKS)
    assert spares.kind == "spares"
    jobs = [{"argv": _args(out, *extra), "env": {}}, {"snapshot": str(out)},
            _replay(out, RUN_SAME, ORIGINAL_RANKS, extra), _replay(out, RUN_OTHER, spares.ranks, extra)]
    if permuted:
        plan = plan_other_nodes(NODES, [], ORIGINAL_RANKS)
        assert plan.kind == "permuted" and all(plan.ranks[r] != ORIGINAL_RANKS[r] for r in ORIGINAL_RANKS)
        jobs.append(_replay(out, RUN_PERMUTED, plan.ranks, extra))
    jobs += [*(more or []), {"snapshot": str(out)}]
    return Incident(out, _drive(jobs, work))


@pytest.fixture(scope="module")
def flip(tmp_path_factory: pytest.TempPathFactory) -> Incident:
    extra = ["--inject-flip", BAD_NODE, "--flip-from", str(SPIKE)]
    bad_request = {"argv": _args(tmp_path_factory.mktemp("refused") / "run", *extra),
                   "env": {"SPIKEOPS_REPLAY": RUN_SAME}}  # no SPIKEOPS_REPLAY_UNTIL
    return _incident(tmp_path_factory, "flip", extra, permuted=True, more=[bad_request])


@pytest.fixture(scope="module")
def overlong(tmp_path_factory: pytest.TempPathFactory) -> Incident:
    return _incident(tmp_path_factory, "overlong", ["--inject-overlong", str(SPIKE), "--inject-rank", "2"])


@pytest.fixture(scope="module")
def transient(tmp_path_factory: pytest.TempPathFactory) -> Incident:
    return _incident(tmp_path_factory, "transient", ["--inject-flip", BAD_NODE, "--flip-from", str(SPIKE),
                                                     "--flip-once"])


def _normal_level(incident: Incident) -> float:
    return max(incident.losses[s] for s in range(SPIKE - 10, SPIKE))


# ---------------------------------------------------------------------------- silent data corruption
def test_the_flip_makes_the_original_run_spike_on_its_node_only(flip: Incident) -> None:
    assert all(r["code"] == 0 for r in flip.results[:4]), flip.results
    job = flip.incident["job"]
    assert job["ranks"] == {str(r): n for r, n in ORIGINAL_RANKS.items()} and job["nodes"] == NODES
    spike = flip.losses[SPIKE]
    assert not math.isfinite(spike) or spike > 1e6 * _normal_level(flip)  # x*2^128 in a matmul
    rows = [json.loads(line) for line in (flip.out / "ranks.jsonl").read_text().splitlines()]
    at_spike = {row["rank"]: row["loss"] for row in rows if row["step"] == SPIKE}
    assert at_spike[BAD_RANK] > 1e6 or math.isnan(at_spike[BAD_RANK])
    assert all(loss < 10 for rank, loss in at_spike.items() if rank != BAD_RANK)  # the other ranks computed right
    assert all(math.isfinite(flip.losses[s]) and flip.losses[s] < 10 for s in range(1, SPIKE))


def test_replays_restore_the_run_exactly_and_touch_nothing_of_it(flip: Incident) -> None:
    assert flip.untouched, "a replay wrote into the original run's files"
    assert not (flip.out / "ckpt" / "step-30").exists()
    for run in (RUN_SAME, RUN_OTHER):
        meta = flip.meta(run)
        assert (meta["first_step"], meta["last_step"], meta["steps"]) == (21, SPIKE, SPIKE - 20)
        assert meta["checkpoint"]["step"] == 20 and meta["deterministic"]["use_deterministic_algorithms"] is True
        # the data order the original run recorded in batches.jsonl, step by step and rank by rank
        assert all(f["ok"] and f["matched"] == SPIKE - 20 for f in meta["fingerprints"].values()), meta["fingerprints"]
        replay = flip.replay(run)
        assert not replay.gaps and len(replay.records) == 3 * len(NODES)
        for step in range(21, SPIKE):  # before the flip, the very same numbers as the original run
            mean = sum(r.loss for r in replay.at(step).values()) / len(NODES)
            assert mean == pytest.approx(flip.losses[step], rel=1e-6, abs=0)
    assert flip.meta(RUN_SAME)["ranks"] == {str(r): n for r, n in ORIGINAL_RANKS.items()}
    assert flip.meta(RUN_OTHER)["ranks"] == {"0": "s1", "1": "s2", "2": "s3"}
    assert [tuple(f) for f in flip.meta(RUN_SAME)["flips"]] == [(SPIKE, BAD_RANK, BAD_NODE)]
    assert flip.meta(RUN_OTHER)["flips"] == []


def test_the_verdict_names_exactly_the_corrupting_node(flip: Incident) -> None:
    verdict = flip.verdict()
    assert verdict.verdict == "sdc", verdict.summary
    assert verdict.culprit_nodes == [BAD_NODE] and verdict.culprit_ranks == [BAD_RANK]
    assert verdict.first_divergence == SPIKE
    assert verdict.same_nodes.reproduces and verdict.other_nodes.reproduces is False
    same, other = flip.replay(RUN_SAME), flip.replay(RUN_OTHER)
    # only the flipping rank's own gradients differ at the first differing step
    assert [r for r in range(3) if same.records[(SPIKE, r)].local_grad_digest !=
            other.records[(SPIKE, r)].local_grad_digest] == [BAD_RANK]
    assert len({same.records[(SPIKE, r)].reduced_grad_digest for r in range(3)}) == 1  # the all-reduce agrees
    finding = sdc_finding(verdict)
    assert finding is not None and finding["cause"] == "silent_data_corruption" and finding["nodes"] == [BAD_NODE]
    for item in finding["evidence"]:
        lines = (flip.out / item["file"]).read_text().splitlines()
        assert lines[item["line"] - 1] == item["text"]
    assert {item["file"] for item in finding["evidence"]} == {"replay/same-nodes/replay.jsonl",
                                                              "replay/other-nodes/replay.jsonl"}


def test_without_spares_the_permuted_replay_still_names_only_the_node(flip: Incident) -> None:
    permuted = flip.replay(RUN_PERMUTED)
    moved_to_bad = [r for r, n in permuted.placement().items() if n == BAD_NODE]
    assert moved_to_bad and moved_to_bad != [BAD_RANK]  # another rank ran on n2 there
    verdict = flip.verdict(RUN_PERMUTED)
    assert verdict.verdict == "sdc", verdict.summary
    assert verdict.culprit_nodes == [BAD_NODE] and verdict.other_nodes.reproduces  # the fault followed n2


def test_a_malformed_replay_request_never_trains(flip: Incident) -> None:
    refused = flip.results[-1]
    assert refused["code"] != 0 and "SPIKEOPS_REPLAY_UNTIL" in (refused["error"] or "")


def test_a_replay_cut_short_is_inconclusive(flip: Incident, tmp_path: Path) -> None:
    text = (flip.out / "replay" / RUN_OTHER / "replay.jsonl").read_text()
    cut = tmp_path / RUN_OTHER / "replay.jsonl"
    cut.parent.mkdir()
    cut.write_text(text[: int(len(text) * 0.8)])  # killed mid-write
    verdict = compare_replays(flip.metrics, flip.incident["job"]["ranks"], flip.replay(RUN_SAME), read_replay(cut),
                              SPIKE)
    assert verdict.verdict == "inconclusive" and verdict.culprit_nodes == [] and sdc_finding(verdict) is None
    assert "incomplete" in verdict.reason


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_ranks_started_like_srun_replay_bit_identically(flip: Incident) -> None:
    """Fresh processes, one per node, as ``srun`` starts them: SLURM_PROCID numbered in
    another order than the placement, SPIKEOPS_RANK_NODES decides each rank from its node.
    Two replays on the same placement: the same bits, record for record."""
    out = flip.out
    env = replay_env("same-nodes-srun", SPIKE, str(out / "replay" / "same-nodes-srun"), str(out / "ckpt" / "step-20"),
                     ORIGINAL_RANKS)
    port = _free_port()
    argv = [sys.executable, str(EXAMPLE), "--out", str(out), "--distributed", "--steps", str(STEPS), "--ckpt-every",
            str(CKPT_EVERY), "--inject-flip", BAD_NODE, "--flip-from", str(SPIKE)]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SPIKEOPS_", "SLURM", "RANK", "WORLD_SIZE"))}
    processes = []
    for task, node in enumerate(reversed(NODES)):
        task_env = {**base, **env, "SLURM_PROCID": str(task), "SLURM_NTASKS": str(len(NODES)),
                    "SLURMD_NODENAME": node, "SLURM_JOB_ID": "4242", "MASTER_PORT": str(port)}
        processes.append(subprocess.Popen(argv, env=task_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
    outputs = [p.communicate(timeout=600)[0] for p in processes]
    assert all(p.returncode == 0 for p in processes), outputs
    assert any("replay same-nodes-srun: steps 21..23" in text for text in outputs)
    again, first = read_replay(out / "replay" / "same-nodes-srun"), flip.replay(RUN_SAME)
    assert again.placement() == ORIGINAL_RANKS
    assert set(again.records) == set(first.records)
    for key, record in first.records.items():
        assert again.records[key].same_result(record), key


# ---------------------------------------------------------------------------- bad data, and a transient
def test_an_overlong_sample_reproduces_everywhere_and_acquits_the_hardware(overlong: Incident) -> None:
    assert all(r["code"] == 0 for r in overlong.results), overlong.results
    assert overlong.losses[SPIKE] > 2 * _normal_level(overlong)  # a real spike, finite
    verdict = overlong.verdict()
    assert verdict.verdict == "reproduced", verdict.summary
    assert verdict.culprit_nodes == [] and sdc_finding(verdict) is None and verdict.first_divergence is None
    same, other = overlong.replay(RUN_SAME), overlong.replay(RUN_OTHER)
    assert {k: r.local_grad_digest for k, r in same.records.items()} == \
        {k: r.local_grad_digest for k, r in other.records.items()}  # bit-identical on other nodes
    assert overlong.meta(RUN_OTHER)["ranks"] == {"0": "s1", "1": "s2", "2": "s3"}


def test_a_one_off_flip_is_reported_transient(transient: Incident) -> None:
    assert all(r["code"] == 0 for r in transient.results), transient.results
    level = _normal_level(transient)
    spike = transient.losses[SPIKE]
    assert not math.isfinite(spike) or spike > 1e6 * level
    assert transient.losses[SPIKE + 1] < 2 * level  # and the run went on normally
    verdict = transient.verdict()
    assert verdict.verdict == "transient", verdict.summary
    assert verdict.culprit_nodes == [] and sdc_finding(verdict) is None
    assert transient.meta(RUN_SAME)["flips"] == [] and transient.meta(RUN_OTHER)["flips"] == []

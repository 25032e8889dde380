"""spikeops.replay on crafted replays: the verdict's rule, its refusals, the reader, the plan.

The real replays (multi-process train_tiny with a bit flip) are in test_replay_train.py;
here every branch of the rule is driven by hand-made ``replay.jsonl`` text, so each refusal
("inconclusive", never a conviction) is shown to hold on the input that should trigger it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spikeops.remediation import check_env
from spikeops.replay import (
    ENV_RANK_NODES,
    ENV_REPLAY,
    ENV_REPLAY_OUT,
    ENV_REPLAY_UNTIL,
    ReplayRun,
    compare_replays,
    parse_replay,
    plan_other_nodes,
    rank_nodes_value,
    read_replay,
    replay_env,
    sdc_finding,
)
from spikeops.train import ResumeRequest

FIRST, SPIKE, WORLD = 21, 25, 4
ORIGINAL = {r: f"n{r}" for r in range(WORLD)}
SPARES = {r: f"s{r}" for r in range(WORLD)}


def _level(step: int) -> float:
    return 3.0 - 0.01 * step


def original_metrics(spike: float = math.nan) -> dict[int, float]:
    return {**{s: _level(s) for s in range(1, SPIKE)}, SPIKE: spike}


def replay_lines(placement: dict[int, str], *, bad: dict[str, int] | None = None, data_spike: bool = False,
                 first: int = FIRST, last: int = SPIKE, fingerprint: bool = True, noise: int | None = None
                 ) -> list[str]:
    """One replay: ``bad`` maps a NODE to the step its GPU starts corrupting whatever rank runs
    on it (non-finite loss, a different local digest); ``data_spike``: rank 2's batch at the
    spike step is poisoned wherever it runs (same digest in every replay); ``noise``: from this
    step on every rank computes slightly different bits (nondeterminism), tagged per placement."""
    bad = bad or {}
    lines = []
    broken_since: int | None = None
    tag = "".join(placement[r] for r in sorted(placement))
    for step in range(first, last + 1):
        corrupt = [r for r in sorted(placement) if placement[r] in bad and step >= bad[placement[r]]]
        if corrupt and broken_since is None:
            broken_since = step
        for rank in sorted(placement):
            loss, norm, local = _level(step), 0.8, f"{step}:{rank}:ok"
            if data_spike and step == last and rank == 2:
                loss, norm, local = 40.0, 55.0, f"{step}:{rank}:overlong"
            if rank in corrupt:
                loss, norm, local = math.nan, math.inf, f"{step}:{rank}:corrupt"
            elif broken_since is not None and step > broken_since:
                local += ":after"  # the weights already differ
            if noise is not None and step >= noise:
                local += f":{tag}"
                norm *= 1.0001
            reduced = f"{step}:reduced" + (":corrupt" if broken_since is not None else "")
            if noise is not None and step >= noise:
                reduced += f":{tag}"
            record = {"step": step, "rank": rank, "node": placement[rank], "loss": loss, "grad_norm": norm,
                      "local_grad_digest": local, "reduced_grad_digest": reduced}
            if fingerprint:
                record["fingerprint"] = f"batch-{step}-{rank}"
            lines.append(json.dumps(record))
    return lines


def run(name: str, lines: list[str]) -> ReplayRun:
    return parse_replay("\n".join(lines) + "\n", name=name)


def same_other(bad: dict[str, int] | None = None, *, other: dict[int, str] | None = None, data_spike: bool = False,
               **kwargs: object) -> tuple[ReplayRun, ReplayRun]:
    return (run("same-nodes", replay_lines(ORIGINAL, bad=bad, data_spike=data_spike, **kwargs)),  # type: ignore[arg-type]
            run("other-nodes", replay_lines(other or SPARES, bad=bad, data_spike=data_spike, **kwargs)))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the rule
def test_persistent_corruption_on_one_node_convicts_exactly_that_node() -> None:
    same, other = same_other({"n2": 24})
    verdict = compare_replays(original_metrics(), ORIGINAL, same, other, SPIKE)
    assert verdict.verdict == "sdc", verdict.summary
    assert verdict.culprit_nodes == ["n2"] and verdict.culprit_ranks == [2]
    assert verdict.first_divergence == 24 and verdict.steps == (FIRST, SPIKE)
    assert verdict.same_nodes.reproduces is True and verdict.other_nodes.reproduces is False
    cited = {(e.file, e.line) for e in verdict.evidence}
    line_same = next(r.line for r in same.records.values() if (r.step, r.rank) == (24, 2))
    line_other = next(r.line for r in other.records.values() if (r.step, r.rank) == (24, 2))
    assert ("replay/same-nodes/replay.jsonl", line_same) in cited
    assert ("replay/other-nodes/replay.jsonl", line_other) in cited
    assert all('"step"' in e.text for e in verdict.evidence)
    finding = sdc_finding(verdict)
    assert finding is not None
    assert set(finding) == {"layer", "cause", "confidence", "nodes", "ranks", "step", "evidence", "summary"}
    assert (finding["layer"], finding["cause"], finding["nodes"], finding["ranks"], finding["step"]) == \
        ("hardware", "silent_data_corruption", ["n2"], [2], 24)
    assert 0.8 <= finding["confidence"] <= 1.0 and "n2" in finding["summary"]
    json.dumps(verdict.to_json())  # serialisable for Slack and the bundle


def test_a_bad_batch_reproduces_everywhere_and_convicts_nobody() -> None:
    same, other = same_other(data_spike=True)
    verdict = compare_replays(original_metrics(spike=12.5), ORIGINAL, same, other, SPIKE)
    assert verdict.verdict == "reproduced", verdict.summary
    assert verdict.culprit_nodes == [] and verdict.first_divergence is None
    assert sdc_finding(verdict) is None and not verdict.convicts
    assert verdict.evidence and all(e.line for e in verdict.evidence)


def test_an_upset_that_neither_replay_meets_is_transient() -> None:
    same, other = same_other()
    verdict = compare_replays(original_metrics(), ORIGINAL, same, other, SPIKE)
    assert verdict.verdict == "transient", verdict.summary
    assert verdict.culprit_nodes == [] and sdc_finding(verdict) is None


def test_permuted_nodes_the_fault_follows_its_node() -> None:
    """No spares: the other replay puts rank 1 on the faulty n2, so both replays reproduce;
    the far-off rank moves with n2, and n2 alone is named."""
    permuted = {r: f"n{(r + 1) % WORLD}" for r in range(WORLD)}  # rank 1 -> n2
    same, other = same_other({"n2": 24}, other=permuted)
    verdict = compare_replays(original_metrics(), ORIGINAL, same, other, SPIKE)
    assert verdict.verdict == "sdc", verdict.summary
    assert verdict.culprit_nodes == ["n2"] and verdict.culprit_ranks == [2]
    assert verdict.same_nodes.reproduces and verdict.other_nodes.reproduces
    assert verdict.confidence < 0.9  # the extension is weaker than the spec's own case


def test_two_node_tie_is_broken_by_which_rank_is_far_off() -> None:
    """Two nodes swapped: every rank differs at the first divergence (a tie on counts), but
    rank 0 is far off on X in one replay and rank 1 on X in the other: X, not Y."""
    original = {0: "X", 1: "Y"}
    same = run("same-nodes", replay_lines(original, bad={"X": 23}))
    other = run("other-nodes", replay_lines({0: "Y", 1: "X"}, bad={"X": 23}))
    verdict = compare_replays(original_metrics(), original, same, other, SPIKE)
    assert verdict.verdict == "sdc" and verdict.culprit_nodes == ["X"] and verdict.culprit_ranks == [0]


def test_permutation_with_an_unexplained_difference_is_inconclusive() -> None:
    permuted = {r: f"n{(r + 1) % WORLD}" for r in range(WORLD)}
    same = run("same-nodes", replay_lines(ORIGINAL, bad={"n2": 24}))
    other = run("other-nodes", replay_lines(permuted, bad={"n0": 24}))  # a different node is off there
    verdict = compare_replays(original_metrics(), ORIGINAL, same, other, SPIKE)
    assert verdict.verdict == "inconclusive" and verdict.culprit_nodes == []
    assert "not bit-identically" in verdict.reason


def test_every_rank_different_by_small_amounts_is_nondeterminism_not_a_node() -> None:
    same = run("same-nodes", replay_lines(ORIGINAL, bad={"n2": 25}, noise=23))
    other = run("other-nodes", replay_lines(SPARES, noise=23))
    verdict = compare_replays(original_metrics(), ORIGINAL, same, other, SPIKE)
    assert verdict.verdict == "inconclusive" and verdict.culprit_nodes == []
    assert "nondeterminism" in verdict.reason and verdict.first_divergence == 23


def test_single_rank_job_convicts_at_lower_confidence() -> None:
    original = {0: "X"}
    same = run("same-nodes", replay_lines(original, bad={"X": 24}))
    other = run("other-nodes", replay_lines({0: "S"}))
    verdict = compare_replays(original_metrics(), original, same, other, SPIKE)
    assert verdict.verdict == "sdc" and verdict.culprit_nodes == ["X"]
    assert verdict.confidence < 0.9 and any("determinism" in note for note in verdict.notes)


def test_only_the_other_nodes_reproducing_convicts_nobody() -> None:
    same = run("same-nodes", replay_lines(ORIGINAL))
    other = run("other-nodes", replay_lines(SPARES, bad={"s1": 24}))
    verdict = compare_replays(original_metrics(), ORIGINAL, same, other, SPIKE)
    assert verdict.verdict == "inconclusive" and verdict.culprit_nodes == []
    assert "only the replay on other nodes" in verdict.reason and "s1" in verdict.reason


def test_only_reduced_gradients_differing_is_not_a_gpu() -> None:
    same_lines = replay_lines(ORIGINAL, bad={"n2": 25})
    other_lines = replay_lines(SPARES)
    # a reduction that went wrong at step 23 on the other placement: every rank's reduced digest differs
    other_lines = [line.replace('"23:reduced"', '"23:reduced:wire"') for line in other_lines]
    verdict = compare_replays(original_metrics(), ORIGINAL, run("same-nodes", same_lines),
                              run("other-nodes", other_lines), SPIKE)
    assert verdict.verdict == "inconclusive" and "reduced" in verdict.reason and verdict.first_divergence == 23


# ---------------------------------------------------------------------------- refusals
def test_a_truncated_replay_is_inconclusive_with_the_missing_step() -> None:
    same, _ = same_other({"n2": 24})
    lines = replay_lines(SPARES, bad={"n2": 24})
    cut = lines[: 4 * 3 + 2] + [lines[14][:30]]  # steps 21-23, two ranks of 24, a line cut mid-write
    other = run("other-nodes", cut)
    verdict = compare_replays(original_metrics(), ORIGINAL, same, other, SPIKE)
    assert verdict.verdict == "inconclusive" and verdict.culprit_nodes == []
    assert "incomplete" in verdict.reason and "step 24" in verdict.reason
    assert other.gaps and other.gaps[0].line == 15


def test_garbage_lines_are_gaps_and_the_rest_is_judged() -> None:
    lines = replay_lines(SPARES)
    noisy = lines[:3] + ["\x00\x00garbage{", "[1, 2]", '{"step": "x", "rank": 1}', ""] + lines[3:]
    other = run("other-nodes", noisy)
    assert len(other.gaps) == 3 and [g.line for g in other.gaps] == [4, 5, 6]
    same, _ = same_other({"n2": 24})
    verdict = compare_replays(original_metrics(), ORIGINAL, same, other, SPIKE)
    assert verdict.verdict == "sdc" and verdict.culprit_nodes == ["n2"]
    assert any("3 line(s) not read" in note for note in verdict.notes)
    # the evidence line numbers are the file's own, past the garbage
    record = other.records[(24, 2)]
    assert noisy[record.line - 1] == record.text


def test_two_different_records_for_one_step_and_rank_are_not_trusted() -> None:
    same, _ = same_other({"n2": 24})
    lines = replay_lines(SPARES)
    lines.append(lines[9].replace(":ok", ":other"))  # step 23 rank 1 again, differently
    other = run("other-nodes", lines)
    assert (23, 1) in other.conflicts and (23, 1) not in other.records
    verdict = compare_replays(original_metrics(), ORIGINAL, same, other, SPIKE)
    assert verdict.verdict == "inconclusive" and "written twice" in verdict.reason
    repeated = run("other-nodes", replay_lines(SPARES) + [replay_lines(SPARES)[9]])  # an identical repeat is fine
    assert not repeated.conflicts and not repeated.gaps


def test_replays_fed_different_data_are_not_compared() -> None:
    same, _ = same_other({"n2": 24})
    lines = [line.replace('"batch-22-3"', '"batch-other"') for line in replay_lines(SPARES)]
    verdict = compare_replays(original_metrics(), ORIGINAL, same, run("other-nodes", lines), SPIKE)
    assert verdict.verdict == "inconclusive" and "different data" in verdict.reason


def test_same_nodes_replay_off_the_original_placement_is_refused() -> None:
    moved = {**ORIGINAL, 2: "n9"}
    same = run("same-nodes", replay_lines(moved, bad={"n9": 24}))
    other = run("other-nodes", replay_lines(SPARES))
    verdict = compare_replays(original_metrics(), ORIGINAL, same, other, SPIKE)
    assert verdict.verdict == "inconclusive" and "n9" in verdict.reason


def test_a_culprit_rank_that_did_not_move_is_refused() -> None:
    partly = {**SPARES, 2: "n2"}  # rank 2 stayed on n2 in the other replay
    same = run("same-nodes", replay_lines(ORIGINAL, bad={"n2": 24}))
    other = run("other-nodes", [line.replace(":corrupt", ":corrupt2") for line in
                                replay_lines(partly, bad={"n2": 26})])
    verdict = compare_replays(original_metrics(), ORIGINAL, same, other, SPIKE)
    assert verdict.verdict == "inconclusive" and "in both replays" in verdict.reason


def test_no_anomaly_in_the_original_or_no_spike_step() -> None:
    same, other = same_other({"n2": 24})
    calm = compare_replays(original_metrics(spike=_level(SPIKE)), ORIGINAL, same, other, SPIKE)
    assert calm.verdict == "inconclusive" and "not anomalous" in calm.reason
    assert compare_replays(original_metrics(), ORIGINAL, same, other, None).verdict == "inconclusive"
    unlogged = {s: v for s, v in original_metrics().items() if s != SPIKE}
    assert "not in its metrics" in compare_replays(unlogged, ORIGINAL, same, other, SPIKE).reason


def test_a_partial_reproduction_is_inconclusive() -> None:
    same = run("same-nodes", replay_lines(ORIGINAL, data_spike=True))
    other_lines = [line.replace("40.0", "16.0").replace("55.0", "20.0") for line in replay_lines(SPARES,
                                                                                               data_spike=True)]
    verdict = compare_replays(original_metrics(spike=12.5), ORIGINAL, same, run("other-nodes", other_lines), SPIKE)
    assert verdict.verdict == "inconclusive" and "partial" in verdict.reason


def test_a_replay_that_stops_at_the_nan_still_counts() -> None:
    same_lines = replay_lines(ORIGINAL, bad={"n2": 23})
    stopped = [line for line in same_lines if json.loads(line)["step"] <= 23]  # a job that stops on NaN
    verdict = compare_replays(original_metrics(), ORIGINAL, run("same-nodes", stopped),
                              run("other-nodes", replay_lines(SPARES)), SPIKE)
    assert verdict.verdict == "sdc" and verdict.culprit_nodes == ["n2"] and verdict.first_divergence == 23


def test_replays_from_different_checkpoints_are_refused() -> None:
    same = run("same-nodes", replay_lines(ORIGINAL, bad={"n2": 24}))
    other = run("other-nodes", replay_lines(SPARES, first=22))
    verdict = compare_replays(original_metrics(), ORIGINAL, same, other, SPIKE)
    assert verdict.verdict == "inconclusive" and "different steps" in verdict.reason


def test_unreadable_files_are_inconclusive(tmp_path: Path) -> None:
    missing = read_replay(tmp_path / "replay" / "other-nodes")
    assert missing.problem and "no such file" in missing.problem and missing.name == "other-nodes"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "replay.jsonl").write_text("garbage\n")
    empty = read_replay(tmp_path / "empty" / "replay.jsonl", name="other-nodes")
    assert empty.problem and "no replay record" in empty.problem and "garbage" in empty.problem
    same, _ = same_other({"n2": 24})
    for bad in (missing, empty, parse_replay("", name="other-nodes"), parse_replay("\x00\x01{{{\n", name="x")):
        verdict = compare_replays(original_metrics(), ORIGINAL, same, bad, SPIKE)
        assert verdict.verdict == "inconclusive" and verdict.culprit_nodes == [] and sdc_finding(verdict) is None


def test_read_replay_reads_a_file_and_names_its_evidence(tmp_path: Path) -> None:
    folder = tmp_path / "replay" / "same-nodes"
    folder.mkdir(parents=True)
    lines = replay_lines(ORIGINAL)
    (folder / "replay.jsonl").write_text("\n".join(lines) + "\n" + lines[0][:20])  # a cut last line
    replay = read_replay(folder)
    assert replay.name == "same-nodes" and replay.file == "replay/same-nodes/replay.jsonl"
    assert len(replay.records) == len(lines) and replay.gaps[-1].line == len(lines) + 1
    assert replay.placement() == ORIGINAL


def test_metrics_as_records_and_without_rank_map() -> None:
    same, other = same_other({"n2": 24})
    records = [{"step": s, "loss": v} for s, v in original_metrics().items()]
    verdict = compare_replays(records, None, same, other, SPIKE)
    assert verdict.verdict == "sdc" and verdict.culprit_nodes == ["n2"]
    assert any("same-nodes replay's placement" in note for note in verdict.notes)


# ---------------------------------------------------------------------------- the plan
def test_plan_prefers_spares_and_moves_every_rank() -> None:
    ranks = {0: "a", 1: "a", 2: "b", 3: "b"}  # two GPUs per node
    spares = plan_other_nodes(["a", "b"], ["s1", "s2", "a"], ranks)
    assert spares.kind == "spares" and spares.ranks == {0: "s1", 1: "s1", 2: "s2", 3: "s2"}
    mixed = plan_other_nodes(["a", "b", "c"], ["s1"], {0: "a", 1: "b", 2: "c"})
    assert mixed.kind == "mixed" and mixed.ranks[0] == "s1"
    permuted = plan_other_nodes(["a", "b", "c"], [], {0: "a", 1: "b", 2: "c"})
    assert permuted.kind == "permuted" and sorted(permuted.nodes) == ["a", "b", "c"]
    two_left = plan_other_nodes(["a", "b"], ["s"], {0: "a", 1: "b"})
    assert two_left.kind == "mixed" and two_left.ranks == {0: "s", 1: "a"}
    for plan, original in ((spares, ranks), (mixed, {0: "a", 1: "b", 2: "c"}), (permuted, {0: "a", 1: "b", 2: "c"}),
                           (two_left, {0: "a", 1: "b"})):
        assert all(plan.ranks[r] != original[r] for r in original), plan
        # a node's ranks stay together (one node's GPUs go to one node)
        assert len({plan.ranks[r] for r in original if original[r] == "a"}) == 1


def test_plan_says_when_there_is_nowhere_else() -> None:
    alone = plan_other_nodes(["a"], [], {0: "a", 1: "a"})
    assert not alone.possible and "no spare" in alone.reason
    assert plan_other_nodes(["a"], ["s"], {0: "a"}).ranks == {0: "s"}
    stranger = plan_other_nodes(["a", "b"], [], {0: "a", 1: "zz"})
    assert not stranger.possible and "zz" in stranger.reason
    assert plan_other_nodes(["a", "b"], []).ranks == {0: "b", 1: "a"}  # default: rank i on the i-th node


def test_replay_env_is_safe_to_pass_and_read_back(tmp_path: Path) -> None:
    env = replay_env("other-nodes", 25, str(tmp_path / "replay" / "other-nodes"), "/ckpt/step-20",
                     {0: "n1", 1: "n2", 2: "n3", 3: "n0"})
    assert check_env(env) == env
    assert env[ENV_RANK_NODES] == "n1:n2:n3:n0" and env[ENV_REPLAY] == "other-nodes"
    request = ResumeRequest.from_env(env)
    assert request.checkpoint == "/ckpt/step-20" and request.replay is not None
    assert (request.replay.run, request.replay.until, request.replay.problem) == ("other-nodes", 25, None)
    assert request.replay.rank_nodes == ("n1", "n2", "n3", "n0")
    assert request.replay.directory("/run") == str(tmp_path / "replay" / "other-nodes")
    assert not request.remediated and "replay 'other-nodes' through step 25" in request.describe()
    with pytest.raises(ValueError):
        replay_env("../escape", 25, "/x", "/ckpt")
    with pytest.raises(ValueError):
        rank_nodes_value({0: "a", 2: "b"})
    with pytest.raises(ValueError):
        rank_nodes_value({0: "a,b"})


def test_a_malformed_replay_request_is_a_problem_never_ignored() -> None:
    assert ResumeRequest.from_env({}).replay is None
    no_until = ResumeRequest.from_env({ENV_REPLAY: "same-nodes"}).replay
    assert no_until is not None and ENV_REPLAY_UNTIL in (no_until.problem or "")
    bad = ResumeRequest.from_env({ENV_REPLAY: "a/b", ENV_REPLAY_UNTIL: "-3", ENV_REPLAY_OUT: "/o"}).replay
    assert bad is not None and "run name" in (bad.problem or "") and "-3" in (bad.problem or "")
    default = ResumeRequest.from_env({ENV_REPLAY: "same-nodes", ENV_REPLAY_UNTIL: "9"}).replay
    assert default is not None and default.problem is None
    assert default.directory("/run") == "/run/replay/same-nodes"


# ---------------------------------------------------------------------------- damaged files
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["drop", "cut", "repeat", "garbage", "swap"]), st.integers(0, 10_000)),
                max_size=4), st.booleans())
def test_damaged_replay_files_never_convict_a_healthy_node(damage: list[tuple[str, int]], damage_same: bool) -> None:
    """Structural damage (lines lost, cut, repeated, garbage, out of order) to either replay
    of the persistent-flip case: the verdict is the right node or inconclusive, never another
    node, and nothing raises."""
    same_lines = replay_lines(ORIGINAL, bad={"n2": 24})
    other_lines = replay_lines(SPARES, bad={"n2": 24})
    lines = same_lines if damage_same else other_lines
    for kind, where in damage:
        i = where % len(lines)
        if kind == "drop":
            del lines[i]
        elif kind == "cut":
            lines[i] = lines[i][: where % max(1, len(lines[i]))]
        elif kind == "repeat":
            lines.insert(i, lines[i])
        elif kind == "garbage":
            lines.insert(i, "\x00}{" * (where % 5))
        else:
            lines[i], lines[-1] = lines[-1], lines[i]
    verdict = compare_replays(original_metrics(), ORIGINAL, run("same-nodes", same_lines),
                              run("other-nodes", other_lines), SPIKE)
    assert verdict.verdict in ("sdc", "inconclusive"), verdict.summary
    assert verdict.culprit_nodes in ([], ["n2"])
    assert (verdict.verdict == "sdc") == bool(verdict.culprit_nodes)

"""The node lifecycle's pure parts (docs/lifecycle.md): what convicted a node and whether a
reset clears it, from real diagnoses of simulated incidents; a node's state and next step from
its ledger record; the validation checks judged on real tool output (shared/fixtures/real) and
on nccl-tests' printed format; the configuration's lifecycle keys."""

from __future__ import annotations

import json

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from spikeops.config import load_config
from spikeops.errors import InputError
from spikeops.lifecycle.checks import (
    CheckContext,
    judge_allreduce,
    judge_dcgm,
    judge_evidence,
    judge_nvidia_smi,
    validation_passed,
    CheckResult,
)
from spikeops.lifecycle.faults import ConvictionEvidence, reset_reason
from spikeops.lifecycle.plan import LifecyclePolicy, incident_of_reason, next_step
from spikeops.lifecycle.record import Event, NodeRecord, node_state
from spikeops.probes.nccl_tests import parse as parse_nccl_tests
from spikeops.schedulers.local import LocalNode
from spikeops.sim import build_bundle
from spikeops.sim.nodelife import all_reduce_rows
from tests.conftest import real_text

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def _t(minutes: float) -> str:
    return (NOW + timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------- faults


@pytest.mark.parametrize(("xids", "lost", "pending", "reset"), [
    ([79], False, False, True), ([48], False, False, True), ([94], False, False, True), ([95], False, False, True),
    ([63], False, False, False), ([63], False, True, True), ([64], False, True, True),
    ([], True, False, True), ([13], False, False, False), ([74], False, False, False), ([119], False, True, False),
])
def test_reset_class_is_the_xid_catalogues_reset_remedy(xids, lost, pending, reset) -> None:
    assert (reset_reason(xids, gpu_lost=lost, remap_pending=pending) is not None) == reset


def _diagnosed(cause: str, wanted, tmp: Path) -> tuple[Path, object]:
    """The first simulated incident of ``cause`` whose answer is ``wanted``, diagnosed."""
    from spikeops.diagnosis import diagnose

    for seed in range(40):
        bundle = tmp / f"{cause}-{seed}"
        if bundle.exists():
            continue
        answer = build_bundle(bundle, cause, seed=seed, nodes=4, distractors=False)
        if wanted(answer):
            (bundle / "diagnosis.json").write_text(json.dumps(diagnose(bundle).to_json()))
            return bundle, answer
    raise AssertionError(f"no {cause} incident among 40 seeds is the one wanted")


def test_a_conviction_carries_its_evidence_and_reset_class_into_the_ledger(tmp_path: Path) -> None:
    """From the diagnosis the flow wrote: an Xid 79 is reset-class, an NVLink Xid 74 is not; the
    ledger's convict event keeps both, and the lifecycle reads them back."""
    from spikeops.ledger.entry import entry_from_bundle

    for wanted, reset in (("Xid 79 ", True), ("Xid 74 ", False)):
        bundle, answer = _diagnosed("gpu_xid", lambda a, w=wanted: w in a.notes, tmp_path)
        entry = entry_from_bundle(bundle, {"cluster": "sim"})
        (convict,) = [e for e in entry["node_events"] if e["kind"] == "convict"]
        assert convict["node"] == answer.culprit_nodes[0]
        code = int(wanted.split()[1])
        assert convict["evidence"]["xids"] == [code] and convict["evidence"]["cause"] == "gpu_xid"
        assert (convict["evidence"]["reset"] is not None) is reset, convict
        back = ConvictionEvidence.from_json(convict["node"], convict["evidence"])
        assert back.xids == (code,) and (back.reset is not None) is reset and f"Xid {code}" in convict["detail"]


# ---------------------------------------------------------------------------- record and plan


def _record(*events: Event) -> NodeRecord:
    return NodeRecord("gpu-002", "sim", list(events))


def _convict(minutes: float, incident: str = "inc-1", reset: bool = True) -> Event:
    evidence = {"cause": "gpu_xid", "xids": [79 if reset else 74],
                "reset": "Xid 79 (GPU fallen off the bus): a reset clears it" if reset else None}
    return Event(_t(minutes), "convict", "gpu_xid at confidence 0.95", "spikeops diagnosis", f"culprit of {incident}",
                 incident, "gpu_xid", evidence)


MINE = LocalNode("gpu-002", "DRAIN", "spikeops: gpu_xid inc-1")
POLICY = LifecyclePolicy(reboot="auto", release="ask", validate_after_s=600, lemon_threshold=2,
                         lemon_window_s=30 * 86400)


def test_states_follow_the_spec_and_a_replacement_mark_holds_until_a_person_releases() -> None:
    drain = Event(_t(-60), "drain", "done", "spikeops", "", "inc-1")
    assert node_state([], NOW) is None and node_state([_convict(-61)], NOW) is None  # a conviction is no lifecycle
    assert node_state([drain], NOW) == "drained"
    reboot = Event(_t(-50), "reboot", "requested")
    assert node_state([drain, reboot], NOW) == "rebooting"
    assert node_state([drain, reboot, Event(_t(-45), "reboot", "done")], NOW) == "drained"
    started = Event(_t(-40), "validate", "started")
    assert node_state([drain, started], NOW) == "validating"
    assert node_state([drain, Event(_t(-40 - 7 * 60), "validate", "started")], NOW) == "failed-validation"  # died
    assert node_state([drain, started, Event(_t(-30), "validate", "failed")], NOW) == "failed-validation"
    assert node_state([drain, started, Event(_t(-30), "validate", "passed")], NOW) == "releasable"
    replace = Event(_t(-20), "replace", "marked")
    assert node_state([drain, replace, Event(_t(-10), "validate", "passed")], NOW) == "replace"
    assert node_state([drain, replace, Event(_t(-5), "force-release", "done")], NOW) == "released"


def test_the_next_step_of_a_drained_node() -> None:
    drain = Event(_t(-60), "drain", "done", "spikeops", "", "inc-1")
    # NHC's rule: someone else's drain, or no drain at all, is left alone
    theirs = LocalNode("gpu-002", "DRAIN", "bad DIMM, RMA", "alice")
    assert next_step(_record(_convict(-61), drain), theirs, POLICY, NOW).action == "hands-off"
    assert next_step(_record(drain), LocalNode("gpu-002"), POLICY, NOW).action == "hands-off"
    assert next_step(_record(drain), None, POLICY, NOW).action == "hands-off"
    # a reset-class conviction is rebooted first (asked, with reboot = "ask"), never with "never"
    step = next_step(_record(_convict(-61), drain), MINE, POLICY, NOW)
    assert step.action == "reboot" and not step.ask and "Xid 79" in step.why
    ask = LifecyclePolicy(reboot="ask", validate_after_s=600)
    assert next_step(_record(_convict(-61), drain), MINE, ask, NOW).ask
    never = LifecyclePolicy(reboot="never", validate_after_s=600)
    assert next_step(_record(_convict(-61), drain), MINE, never, NOW).action == "validate"
    # not reset-class: validated once the wait after the drain is over, not before
    fresh = Event(_t(-5), "drain", "done", "spikeops", "", "inc-1")
    step = next_step(_record(_convict(-6, reset=False), fresh), MINE, POLICY, NOW)
    assert step.action == "wait" and step.until == NOW + timedelta(minutes=5)
    assert next_step(_record(_convict(-61, reset=False), drain), MINE, POLICY, NOW).action == "validate"
    # a reboot in progress is waited for; its end is validated after the wait
    rebooting = LocalNode("gpu-002", "DOWN", "spikeops: gpu_xid inc-1 : reboot issued", flags=frozenset({"REBOOT_ISSUED"}))
    asked = Event(_t(-30), "reboot", "requested")
    assert next_step(_record(_convict(-61), drain, asked), rebooting, POLICY, NOW).action == "await-reboot"
    assert next_step(_record(_convict(-61), drain, asked), MINE, POLICY, NOW).action == "await-reboot"
    done = Event(_t(-20), "reboot", "done")
    assert next_step(_record(_convict(-61), drain, asked, done), MINE, POLICY, NOW).action == "validate"
    # each failed validation doubles the wait; a pass makes it releasable, with a person's yes
    failed = Event(_t(-15), "validate", "failed", detail="dcgmi-diag: failed")
    step = next_step(_record(_convict(-61), drain, asked, done, failed), MINE, POLICY, NOW)
    assert step.action == "wait" and step.until == NOW + timedelta(minutes=5)
    passed = Event(_t(-1), "validate", "passed")
    step = next_step(_record(_convict(-61), drain, asked, done, failed, passed), MINE, POLICY, NOW)
    assert step.action == "release" and step.ask
    assert not next_step(_record(_convict(-61), drain, asked, done, passed), MINE,
                         LifecyclePolicy(release="auto"), NOW).ask
    # a pass from before the last reboot earns nothing
    assert next_step(_record(_convict(-61), drain, passed.__class__(_t(-25), "validate", "passed"), asked, done),
                     MINE, POLICY, NOW).action == "validate"
    # a person's no is kept: a declined reboot is skipped (validated instead), a declined
    # release is not asked again until a new pass
    declined = Event(_t(-30), "reboot", "declined", "bob", "not now")
    assert next_step(_record(_convict(-61), drain, declined), MINE, POLICY, NOW).action == "validate"
    no = Event(_t(0), "release", "declined", "bob", "keep it out for the vendor")
    record = _record(_convict(-61), drain, asked, done, passed, no)
    step = next_step(record, MINE, POLICY, NOW)
    assert step.action == "hold" and "declined by bob" in step.why and record.state(NOW) == "releasable"
    # a drain whose incident is still open waits for its conviction
    assert next_step(_record(drain), MINE, POLICY, NOW, incident_open=True).action == "hold"
    assert incident_of_reason("spikeops: gpu_xid inc-20261202T1200Z-77 : reboot issued") == "inc-20261202T1200Z-77"


def test_the_lemon_rule_counts_convictions_in_the_window_not_doubted_ones() -> None:
    drain = Event(_t(-60), "drain", "done", "spikeops", "", "inc-2")
    second = _convict(-61, "inc-2")
    step = next_step(_record(_convict(-20 * 1440, "inc-1"), second, drain), MINE, POLICY, NOW)
    assert step.action == "replace" and "inc-1" in step.why and "inc-2" in step.why
    old = _convict(-40 * 1440, "inc-1")  # outside the 30 days
    assert next_step(_record(old, second, drain), MINE, POLICY, NOW).action == "reboot"
    doubt = Event(_t(-30), "doubt", "conviction in doubt", detail="recurred without it; convicted in inc-1",
                  incident="inc-9")
    assert next_step(_record(_convict(-20 * 1440, "inc-1"), second, drain, doubt), MINE, POLICY, NOW).action == "reboot"
    marked = Event(_t(-10), "replace", "marked", detail="2 convictions in 30 days")
    passed = Event(_t(-5), "validate", "passed")
    step = next_step(_record(_convict(-20 * 1440, "inc-1"), second, drain, marked, passed), MINE, POLICY, NOW)
    assert step.action == "hold" and "replacement" in step.why  # never released on its own


# ---------------------------------------------------------------------------- checks


def test_nvidia_smi_is_judged_against_the_drain_time_capture() -> None:
    clean = real_text("nvidia-smi/h100x8-q-535.161.08_gpud.txt")
    ctx = CheckContext("gpu-002", gpus_expected=8, drain_smi=clean)
    result, report = judge_nvidia_smi(clean, 0, ctx)
    assert result.verdict == "passed" and "8 GPU(s)" in result.detail and len(report.gpus) == 8
    # a GPU gone since the drain: the page lists seven
    blocks = clean.split("\nGPU 0000")
    seven = blocks[0] + "".join("\nGPU 0000" + b for b in blocks[2:])
    result, _ = judge_nvidia_smi(seven, 0, ctx)
    assert result.verdict == "failed" and "7 of 8 GPUs present" in result.detail
    pending = real_text("nvidia-smi/a100-sxm4-80gb-q-ecc-remap-pending_ml-engineering.txt")
    result, _ = judge_nvidia_smi(pending, 0, CheckContext("n"))
    assert result.verdict == "failed" and "remap is pending" in result.detail
    for text, code in (("", 127), ("", 9)):
        assert judge_nvidia_smi(text, code, ctx)[0].verdict == "failed"


def test_dcgmi_diag_real_captures() -> None:
    assert judge_dcgm(real_text("dcgm/dcgmi-diag-r2-p4de-a100-all-pass_awsome-distributed-training.txt"), "", 0
                      ).verdict == "passed"
    failed = judge_dcgm(real_text("dcgm/dcgmi-diag-r2-gpu-memory-fail-thermal_ml-engineering.txt"), "", 0)
    assert failed.verdict == "failed" and "GPU 0" in failed.detail and "GPU Memory" in failed.detail
    assert judge_dcgm("", "sh: 1: dcgmi: not found", 127).verdict == "skipped"
    broken = judge_dcgm("Error: unable to establish a connection to the specified host: localhost\n", "", 1)
    assert broken.verdict == "failed" and "no diagnostic result" in broken.detail


def test_all_reduce_perf_in_nccl_tests_format() -> None:
    ctx = CheckContext("gpu-002", peer="gpu-003", gpus_expected=8)
    header = "".join(f"#  Rank {r:2d} Group  0 Pid {4100 + r:6d} on {host:>10} device {r % 8:2d} [0000:19:00] NVIDIA\n"
                     for r, host in enumerate(["gpu-002"] * 8 + ["gpu-003"] * 8))
    rows, code = all_reduce_rows("gpu-002", "pass")
    run = parse_nccl_tests(header + rows)
    assert run.complete and run.out_of_bounds == 0 and len(run.rows) == 8 and run.hosts == ["gpu-002", "gpu-003"]
    assert judge_allreduce(header + rows, "", code, ctx).verdict == "passed"
    rows, code = all_reduce_rows("gpu-002", "wrong")
    result = judge_allreduce(header + rows, "", code, ctx)
    assert code == 1 and result.verdict == "failed" and "out-of-bounds" in result.detail
    rows, code = all_reduce_rows("gpu-002", "slow")
    slow = CheckContext("gpu-002", peer="gpu-003", allreduce_min_busbw=100.0)
    assert judge_allreduce(header + rows, "", code, slow).verdict == "failed"
    rows, code = all_reduce_rows("gpu-002", "error")
    result = judge_allreduce(rows, "", code, ctx)
    assert result.verdict == "failed" and "Test NCCL failure" in result.detail
    cut = header + "\n".join(all_reduce_rows("gpu-002", "pass")[0].splitlines()[:6])
    assert not parse_nccl_tests(cut).complete and judge_allreduce(cut, "", None, ctx).verdict == "failed"
    lonely = judge_allreduce(header.replace("gpu-003", "gpu-002") + all_reduce_rows("gpu-002", "pass")[0], "", 0, ctx)
    assert lonely.verdict == "failed" and "not on gpu-002 and gpu-003" in lonely.detail
    assert judge_allreduce("", "sh: 1: mpirun: not found", 127, ctx).verdict == "skipped"


def test_the_convicting_evidence_must_not_come_back() -> None:
    evidence = ConvictionEvidence("gpu-002", "gpu_xid", (79,), ("0000:4e:00",), reset="Xid 79")
    drained = NOW - timedelta(hours=1)
    old = "2026-12-02T10:30:00,000001+00:00 NVRM: Xid (PCI:0000:4e:00): 79, pid=0, GPU has fallen off the bus.\n"
    new = "2026-12-02T11:30:00,000001+00:00 NVRM: Xid (PCI:0000:4e:00): 79, pid=0, GPU has fallen off the bus.\n"
    ctx = CheckContext("gpu-002", evidence=evidence, since=drained)
    assert judge_evidence(old, 0, ctx, None).verdict == "passed"  # before the drain: the old fault
    back = judge_evidence(old + new, 0, ctx, None)
    assert back.verdict == "failed" and "Xid 79" in back.detail and "again" in back.detail
    plain = "[ 1234.000001] NVRM: Xid (PCI:0000:4e:00): 79, pid=0, GPU has fallen off the bus.\n"
    assert judge_evidence(plain, 0, ctx, None).verdict == "unchecked"  # no time, no reboot: cannot tell
    rebooted = CheckContext("gpu-002", evidence=evidence, since=drained, rebooted=True)
    assert judge_evidence(plain, 0, rebooted, None).verdict == "failed"  # this boot's log: it is new
    assert judge_evidence("", 0, ctx, None).verdict == "unchecked"
    assert judge_evidence(old, 0, CheckContext("gpu-002"), None).verdict == "skipped"  # a manual drain
    assert validation_passed([CheckResult("a", "passed", ""), CheckResult("b", "skipped", "")])
    assert not validation_passed([CheckResult("a", "passed", ""), CheckResult("b", "unchecked", "")])
    assert not validation_passed([CheckResult("a", "skipped", "")]) and not validation_passed([])


def test_the_lifecycle_keys_of_spikeops_toml(tmp_path: Path) -> None:
    path = tmp_path / "spikeops.toml"
    base = '[clusters.a]\ninventory = "i.toml"\nrun_dir = "/r"\n'
    path.write_text(base + 'reboot = "auto"\nrelease = "auto"\nvalidate_after = "10m"\nlemon_threshold = 3\n'
                    'lemon_window = "7d"\nvalidation = ["nvidia-smi", "evidence"]\n'
                    'validation_timeouts = { "nvidia-smi" = 30 }\nallreduce_min_busbw = 120.5\n')
    from spikeops.config import lifecycle_policy

    cluster = load_config(path).clusters["a"]
    policy = lifecycle_policy(cluster)
    assert (policy.reboot, policy.release, policy.validate_after_s, policy.lemon_threshold, policy.lemon_window_s) == \
        ("auto", "auto", 600, 3, 7 * 86400)
    assert cluster.validation == ["nvidia-smi", "evidence"] and cluster.validation_timeouts == {"nvidia-smi": 30}
    for bad, key in (('reboot = "sometimes"', "reboot"), ('release = "never"', "release"),
                     ('validate_after = "soon"', "validate_after"), ("lemon_threshold = 0", "lemon_threshold"),
                     ('validation = ["dcgm"]', "validation"), ('validation_timeouts = { "control" = 0 }',
                                                               "validation_timeouts"),
                     ('allreduce_command = "mpirun"', "allreduce_command"), ("allreduce_min_busbw = -1",
                                                                             "allreduce_min_busbw")):
        path.write_text(base + bad + "\n")
        with pytest.raises(InputError, match=key):
            load_config(path)



def test_the_diagnosis_names_earlier_convictions_from_other_lineages_and_never_convicts_on_them(tmp_path: Path
                                                                                                ) -> None:
    """node_history.json (the ledger's convictions of the job's nodes, in any lineage) names a
    repeat offender in its findings; a node with only history is not a culprit; a broken file
    is a line in ``missing``."""
    from spikeops.diagnosis import diagnose
    from spikeops.history import NODE_HISTORY_FILE, node_history_document

    bundle, answer = _diagnosed("gpu_xid", lambda a: "Xid 79 " in a.notes, tmp_path)
    culprit = answer.culprit_nodes[0]
    bystander = next(n for n in json.loads((bundle / "incident.json").read_text())["job"]["nodes"] if n != culprit)
    events = [{"kind": "convict", "node": culprit, "incident_id": "inc-other-lineage", "cause": "gpu_ecc",
               "time": "2026-11-20T10:00:00Z"},
              {"kind": "convict", "node": bystander, "incident_id": "inc-older", "cause": "ib_link_flap",
               "time": "2026-11-21T10:00:00Z"},
              {"kind": "doubt", "node": bystander, "incident_id": "inc-later", "detail": "convicted in inc-older"},
              {"kind": "convict", "node": culprit, "incident_id": "inc-this", "cause": "gpu_xid", "time": "x"}]
    document = node_history_document(events, exclude="inc-this")
    assert [(e["node"], e["incident_id"], e["in_doubt"]) for e in document] == [
        (culprit, "inc-other-lineage", False), (bystander, "inc-older", True)]
    (bundle / NODE_HISTORY_FILE).write_text(json.dumps(document))
    result = diagnose(bundle).to_json()
    assert result["culprit_nodes"] == [culprit]  # history alone never convicts the bystander
    named = [f for f in result["findings"] if culprit in f["nodes"] and "convicted before" in f["summary"]]
    assert named and "inc-other-lineage (gpu_ecc)" in named[0]["summary"]
    (bundle / NODE_HISTORY_FILE).write_text("{not json")
    result = diagnose(bundle).to_json()
    assert result["culprit_nodes"] == [culprit] and any(m.startswith(NODE_HISTORY_FILE) for m in result["missing"])


def test_the_flow_writes_the_nodes_earlier_convictions_into_the_bundle(tmp_path: Path) -> None:
    """At open, the incident flow's memory writes node_history.json from the ledger: every
    lineage's convictions of the job's nodes, the doubted ones said so."""
    from spikeops.config import IncidentSettings
    from spikeops.history import NODE_HISTORY_FILE
    from spikeops.ledger.store import Ledger
    from spikeops.tasks.ledger import IncidentMemory, Lineage

    with Ledger() as ledger:
        ledger.node_event({"cluster": "sim", "node": "gpu-007", "kind": "convict", "time": "2026-11-01T00:00:00Z",
                           "cause": "gpu_ecc", "for_incident": None})
        ledger.apply({"incident": {"incident_id": "inc-old", "cluster": "sim", "job_id": "77", "lineage": "77"},
                      "jobs": [], "resume": None,
                      "node_events": [{"cluster": "sim", "node": "gpu-007", "time": "2026-11-02T00:00:00Z",
                                       "kind": "convict", "incident_id": "inc-old", "cause": "gpu_xid"},
                                      {"cluster": "other", "node": "gpu-008", "time": "2026-11-02T00:00:00Z",
                                       "kind": "convict", "incident_id": "inc-elsewhere", "cause": "gpu_xid"}]})
    settings = IncidentSettings(job_id="91", inventory="i.toml", run_dir=str(tmp_path), cluster="sim",
                                incidents_dir=str(tmp_path))
    memory = IncidentMemory(settings, Lineage("sim", "91", "91"), "inc-new", str(tmp_path))
    memory._node_history(["gpu-007", "gpu-008"])
    document = json.loads((tmp_path / NODE_HISTORY_FILE).read_text())
    assert [(e["node"], e["incident_id"], e["cause"]) for e in document] == [("gpu-007", "inc-old", "gpu_xid")]


def test_the_local_scheduler_keeps_slurms_reboot_state_machine(tmp_path: Path) -> None:
    from spikeops.schedulers import LocalScheduler

    scheduler = LocalScheduler(tmp_path / "sched")
    scheduler.add_nodes(["a", "b", "c", "d"])
    scheduler.drain(["a", "b", "d"], "gpu_xid", "inc-1")
    scheduler.set_node("c", "DRAIN", "PSU swap", "alice")
    (missing,) = scheduler.reboot(["d"], "gpu_xid reboot", "inc-1")
    node = scheduler.nodes()["d"]
    assert missing.outcome == "failed" and "no reboot program" in missing.detail
    assert node.base_state == "DOWN" and node.drained_by_spikeops and "reboot failed" in node.reason
    # as Slurm, which skips a DOWN node: not rebooted again by spikeops, a person looks
    assert scheduler.reboot(["d"], "again")[0].outcome == "refused"
    program = tmp_path / "sched" / LocalScheduler.REBOOT_PROGRAM
    program.write_text('#!/bin/sh\necho "$1" >> "$(dirname "$0")/rebooted"\n[ "$1" != b ]\n')
    program.chmod(0o755)
    (failed,) = scheduler.reboot(["b"], "x", "inc-1")
    assert failed.outcome == "failed" and "exit 1" in failed.detail
    (done,) = scheduler.reboot(["a"], "gpu_xid reboot", "inc-1")
    node = scheduler.nodes()["a"]
    assert done.outcome == "done" and node.base_state == "DRAIN" and node.boot_time and not node.flags
    assert scheduler.reboot_status("a", done.extra["boot_before"])[0] == "done"
    assert (tmp_path / "sched" / "rebooted").read_text().split() == ["b", "a"]
    assert scheduler.reboot(["c"], "x")[0].outcome == "refused" and scheduler.nodes()["c"].reason == "PSU swap"
    assert scheduler.release(["a"])[0].outcome == "done" and scheduler.nodes()["a"].boot_time == node.boot_time

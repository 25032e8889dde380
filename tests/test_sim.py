"""The incident simulator (spikeops.sim): bundles that read cleanly, answers that match them.

Three kinds of checks:

- the bundle is a bundle: it opens, every file it holds is read by its parser without a
  single gap, ``spikeops parse BUNDLE`` succeeds, probes.json agrees with the files;
- the answer is self-consistent and follows the spec's conventions (culprits are job
  nodes, ``resume_from`` is the newest verified checkpoint before the onset, ...);
- the answer is *in the evidence*: an independent reading of the written files (not of
  the simulator's plan) finds the spike, the onset, the culprit's batch, the Xid in the
  window, the mismatched versions where the answer says they are.

Sizes are small so the whole file runs in well under 30 s; the benchmark size is measured
outside the test suite.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from spikeops import cli
from spikeops.bundle import ARCHIVES, open_bundle, probe_kind_for
from spikeops.probes.nccl_log import normalise_version
from spikeops.reading import read_evidence
from spikeops.sim import CAUSES, DISTRACTORS, Expected, build_bundle
from spikeops.sim import __main__ as sim_main
from spikeops.sim.build import expected_of, plan_incident
from spikeops.sim.model import LAYER_OF, NODE_CAUSES, SYMPTOMS
from spikeops.sim.plan import sub_rng
from spikeops.sim.world import make_world
from tests.conftest import ROOT

SEEDS = (0, 1, 2)


def _size(seed: int) -> dict:
    """Small, seed-varied sizes: 3-6 nodes, 4 or 8 GPUs, 160-290 steps."""
    return {"nodes": 3 + seed % 4, "gpus_per_node": 8 if seed % 2 == 0 else 4, "steps": 160 + 65 * seed}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], tuple[Path, Expected]]:
    root = tmp_path_factory.mktemp("sim")
    built = {}
    for cause in CAUSES:
        for seed in SEEDS:
            path = root / f"{cause}-{seed}"
            built[(cause, seed)] = (path, build_bundle(path, cause, seed=seed, **_size(seed)))
    return built


CASES = [(cause, seed) for cause in CAUSES for seed in SEEDS]


# ------------------------------------------------------------------------- reading back


def _probe_files(path: Path) -> list[Path]:
    return sorted(p for p in (path / "nodes").rglob("*") if p.is_file() and probe_kind_for(p.name))


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _metrics(path: Path):
    reading = open_bundle(path).metrics()
    assert reading is not None
    return reading.result.records


def _printed_times(path: Path) -> dict[int, float]:
    return {r.step: r.time.timestamp() for r in _metrics(path) if r.time is not None}


@pytest.mark.parametrize(("cause", "seed"), CASES)
def test_every_file_reads_without_gaps(bundles, cause: str, seed: int) -> None:
    path, _ = bundles[(cause, seed)]
    bundle = open_bundle(path)
    assert not bundle.missing
    for relative, kind in (("metrics.jsonl", "metrics-jsonl"), ("train.log", "training-log"),
                           ("ranks.jsonl", "ranks-jsonl"), ("batches.jsonl", "batches-jsonl"),
                           ("reference/batches.jsonl", "batches-jsonl"), ("checkpoints.json", "checkpoints-json"),
                           ("incident.json", "incident-json")):
        if (path / relative).is_file():
            reading = read_evidence(path / relative, kind)
            assert reading.gaps == [], (relative, reading.gaps[:3])
    files = _probe_files(path)
    assert files
    for file in files:
        if file.stat().st_size == 0:  # a failed probe's empty stdout; its .err says why
            assert file.with_suffix(".err").is_file(), file
            continue
        reading = read_evidence(file, probe_kind_for(file.name))
        assert reading.gaps == [], (file.relative_to(path), reading.gaps[:3])


@pytest.mark.parametrize(("cause", "seed"), CASES)
def test_probes_json_agrees_with_the_files(bundles, cause: str, seed: int) -> None:
    path, _ = bundles[(cause, seed)]
    bundle = open_bundle(path)
    for node in bundle.incident.job.nodes:
        probes = bundle.probes(node)
        assert not probes.gaps
        folder = path / "nodes" / node
        if probes.unreachable:
            assert sorted(p.name for p in folder.iterdir()) == ["probes.json"]
            continue
        for name, status in probes.probes.items():
            if name in ARCHIVES:  # flight recorder dumps, stacks: a folder of files
                assert status.error is None and any((folder / name).iterdir()), name
                continue
            stdout = folder / ("kernel.log" if name == "kernel" else "nccl.log" if name == "nccl" else f"{name}.txt")
            if status.error == "timeout":
                assert not stdout.exists(), stdout
            else:
                assert stdout.is_file(), stdout
            if status.error == "command-failed":
                assert stdout.with_suffix(".err").is_file()
        assert (folder / "baseline" / "nvidia-smi-q.txt").is_file()


@pytest.mark.parametrize("cause", CAUSES)
def test_spikeops_parse_reads_the_bundle(bundles, cause: str) -> None:
    path, _ = bundles[(cause, 0)]
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["parse", str(path)], out=out, err=err) == 0, err.getvalue()
    assert "bundle" in out.getvalue()


# ----------------------------------------------------------------- answer consistency


@pytest.mark.parametrize(("cause", "seed"), CASES)
def test_expected_is_self_consistent(bundles, cause: str, seed: int) -> None:
    path, expected = bundles[(cause, seed)]
    incident = open_bundle(path).incident
    job = incident.job
    assert expected.cause == cause and expected.layer == LAYER_OF[cause]
    assert expected.symptom in SYMPTOMS
    assert set(expected.culprit_nodes) <= set(job.nodes)
    assert bool(expected.culprit_nodes) == (cause in NODE_CAUSES)
    if cause == "nccl_version_mismatch":
        assert len(expected.culprit_nodes) < len(job.nodes) / 2
    ranks = len(job.nodes) * (job.gpus_per_node or 0)
    assert all(0 <= r < ranks for r in expected.culprit_ranks)
    assert (expected.spike_step is None) == (expected.symptom in ("none", "creeping_increase"))
    assert (expected.onset_step is None) == (cause == "false_alarm")
    steps = [r.step for r in _metrics(path)]
    for step in (expected.spike_step, expected.onset_step):
        assert step is None or steps[0] <= step <= steps[-1]
    if expected.spike_step is not None:
        assert expected.onset_step is not None and expected.onset_step <= expected.spike_step
    if expected.symptom != "none":
        window = incident.window
        anchor = expected.spike_step or expected.onset_step
        if expected.symptom != "creeping_increase":
            assert window.start.timestamp() <= _printed_times(path)[anchor] <= window.end.timestamp()
    listed = open_bundle(path).checkpoints()
    checkpoints = listed.checkpoints if listed is not None else []
    good = [c.step for c in checkpoints if c.verified is True and expected.onset_step is not None
            and c.step < expected.onset_step]
    if expected.resume_from is None:
        assert not good
    else:
        assert expected.resume_from["step"] == max(good)
        match = [c for c in checkpoints if c.step == expected.resume_from["step"]]
        assert match[0].path == expected.resume_from["path"] and match[0].verified is True
    assert set(expected.distractors) <= set(DISTRACTORS)


# ------------------------------------------------------------ the answer is in the files


def _level(records, index: int, span: int = 20) -> float:
    """Median of the last ``span`` logged losses before ``index`` (skipped fp16 steps in a
    Megatron log print no loss, so the look-back reaches past them)."""
    window = [r.loss for r in records[:index] if _finite(r.loss)][-span:]
    return statistics.median(window)


@pytest.mark.parametrize(("cause", "seed"), CASES)
def test_symptom_is_in_the_metrics(bundles, cause: str, seed: int) -> None:
    path, expected = bundles[(cause, seed)]
    records = _metrics(path)
    position = {r.step: i for i, r in enumerate(records)}
    bad = [r.step for r in records if r.nan or not _finite(r.grad_norm) and r.grad_norm is not None]
    if expected.symptom == "instant_nan":
        assert bad and bad[0] == expected.spike_step
        assert bad == [r.step for r in records if r.step >= expected.spike_step]
        return
    assert not bad
    if expected.symptom in ("single_spike", "spike_no_recovery"):
        i = position[expected.spike_step]
        level = _level(records, i)
        assert records[i].loss >= 1.35 * level
        quiet = [r.loss for r in records[max(0, i - 30):i] if _finite(r.loss)]
        assert max(quiet) < 1.15 * _level(records, max(1, i - 30), 30) or i < 31
        later = [r.loss for r in records[i + 8:] if _finite(r.loss)]
        if expected.symptom == "single_spike":
            assert statistics.median(later) < 1.1 * level
        else:
            assert statistics.median(later) > 1.25 * level
    elif expected.symptom == "creeping_increase":
        losses = [r.loss for r in records if _finite(r.loss)]
        assert max(abs(b / a - 1.0) for a, b in zip(losses, losses[1:], strict=False)) < 0.12
        i = position[expected.onset_step]
        assert statistics.mean(losses[-15:]) > 1.04 * statistics.mean(losses[max(0, i - 15):i])
    else:
        losses = [r.loss for r in records if _finite(r.loss)]
        for k in range(30, len(losses)):
            assert losses[k] < 1.15 * statistics.median(losses[k - 30:k])


def _kernel_xids(path: Path, node: str):
    file = path / "nodes" / node / "kernel.log"
    return read_evidence(file, "kernel-log").result.xids if file.is_file() else []


@pytest.mark.parametrize(("cause", "seed"), [c for c in CASES if c[0] in ("gpu_xid", "gpu_ecc", "thermal_throttle")])
def test_hardware_evidence_names_the_culprit(bundles, cause: str, seed: int) -> None:
    path, expected = bundles[(cause, seed)]
    bundle = open_bundle(path)
    window = bundle.incident.window
    (node,) = expected.culprit_nodes
    times = _printed_times(path)
    in_window = [x for x in _kernel_xids(path, node) if window.contains(x.time)]
    for other in bundle.incident.job.nodes:
        if other != node:
            assert not [x for x in _kernel_xids(path, other)
                        if window.contains(x.time) and x.info.implicates_gpu], other
    if cause == "gpu_xid":
        assert in_window and in_window[0].info.implicates_gpu and not in_window[0].info.memory_related
    if in_window:
        moment = in_window[0].time.timestamp()
        assert min(step for step, t in times.items() if t >= moment) == expected.onset_step
    if cause == "gpu_ecc":
        now = bundle.read_probe(node, "nvidia-smi-q.txt").result
        base = bundle.read_probe(node, "nvidia-smi-q.txt", baseline=True).result
        grown = [g for g, b in zip(now.gpus, base.gpus, strict=True)
                 if (g.uncorrectable_ecc() or 0) > (b.uncorrectable_ecc() or 0)]
        assert len(grown) == 1
    if cause == "thermal_throttle":
        smi = bundle.read_probe(node, "nvidia-smi-q.txt").result
        assert any(g.thermal_throttling for g in smi.gpus)
        for other in bundle.incident.job.nodes:
            if other != node and (path / "nodes" / other / "nvidia-smi-q.txt").is_file():
                result = bundle.read_probe(other, "nvidia-smi-q.txt").result
                assert not any(g.thermal_throttling for g in result.gpus)


def _counters(path: Path, node: str, baseline: bool) -> dict[str, int]:
    """Every ethtool and IB port counter of a node, keyed by file and name."""
    folder = path / "nodes" / node / ("baseline" if baseline else "")
    values: dict[str, int] = {}
    for file in sorted(folder.glob("ethtool-*.txt")):
        result = read_evidence(file, "ethtool").result
        values.update({f"{file.name}:{k}": v for k, v in result.counters.items()})
        for queue, counters in result.queues.items():
            values.update({f"{file.name}:{queue}:{k}": v for k, v in counters.items()})
    file = folder / "ib-counters.txt"
    if file.is_file():
        for port in read_evidence(file, "ib-counters").result.ports:
            values.update({f"{port.device}:{port.port}:{k}": v for k, v in port.counters.items()})
    return values


def _grown(path: Path, node: str, names: tuple[str, ...], at_least: int) -> list[str]:
    now, base = _counters(path, node, False), _counters(path, node, True)
    return [k for k, v in now.items() if k.rsplit(":", 1)[-1] in names and v - base.get(k, 0) >= at_least]


@pytest.mark.parametrize(("cause", "seed"), CASES)
def test_counters_never_fall_below_the_baseline(bundles, cause: str, seed: int) -> None:
    path, _ = bundles[(cause, seed)]
    bundle = open_bundle(path)
    for node in bundle.incident.job.nodes:
        if bundle.probes(node).unreachable:
            continue
        now, base = _counters(path, node, False), _counters(path, node, True)
        assert base and all(now[k] >= v for k, v in base.items() if k in now)
        if (path / "nodes" / node / "nvidia-smi-q.txt").stat().st_size if (
                path / "nodes" / node / "nvidia-smi-q.txt").is_file() else 0:
            gpus = bundle.read_probe(node, "nvidia-smi-q.txt").result.gpus
            old = {g.bus_id: g for g in bundle.read_probe(node, "nvidia-smi-q.txt", baseline=True).result.gpus}
            for gpu in gpus:
                assert (gpu.uncorrectable_ecc() or 0) >= (old[gpu.bus_id].uncorrectable_ecc() or 0)
                assert (gpu.correctable_ecc() or 0) >= (old[gpu.bus_id].correctable_ecc() or 0)


_FLAP = ("link_downed", "link_error_recovery")
_PAUSE = ("rx_pause_ctrl_phy", "tx_pause_ctrl_phy", "rx_discards_phy", "rx_out_of_buffer", "rx_prio3_discards")


@pytest.mark.parametrize("seed", SEEDS)
def test_communication_and_link_evidence(bundles, seed: int) -> None:
    path, expected = bundles[("ib_link_flap", seed)]
    nodes = open_bundle(path).incident.job.nodes
    assert [n for n in nodes if (path / "nodes" / n / "ib-counters.txt").is_file() and _grown(path, n, _FLAP, 1)] \
        == expected.culprit_nodes
    path, expected = bundles[("network_congestion", seed)]
    nodes = open_bundle(path).incident.job.nodes
    congested = [n for n in nodes if (path / "nodes" / n / "probes.json").is_file()
                 and list((path / "nodes" / n).glob("ethtool-*.txt")) and _grown(path, n, _PAUSE, 10_000)]
    assert len(congested) >= max(1, (len(nodes) - 2) // 2)
    path, expected = bundles[("nccl_error", seed)]
    warned = []
    for node in open_bundle(path).incident.job.nodes:
        file = path / "nodes" / node / "nccl.log"
        if file.is_file() and read_evidence(file, "nccl-log").result.events_of("ib_completion_error"):
            warned.append(node)
    assert len(warned) >= min(2, len(open_bundle(path).incident.job.nodes) - 1)


@pytest.mark.parametrize("seed", SEEDS)
def test_data_causes_leave_their_batch(bundles, seed: int) -> None:
    for cause in ("overlong_sample", "corrupted_sample"):
        path, expected = bundles[(cause, seed)]
        (rank,) = expected.culprit_ranks
        records = open_bundle(path).batches().records
        max_length = open_bundle(path).incident.job.max_length
        odd = [(b.step, b.rank) for b in records if (b.max_tokens or 0) > 20 * max_length or (b.num_empty or 0) > 0]
        assert odd == [(expected.spike_step, rank)]


@pytest.mark.parametrize("seed", SEEDS)
def test_resume_causes_and_reference_batches(bundles, seed: int) -> None:
    path, expected = bundles[("rng_not_restored", seed)]
    bundle = open_bundle(path)
    assert bundle.incident.job.resumed_from.step == expected.onset_step - 1
    current = {(b.step, b.rank): b.fingerprint for b in bundle.batches().records}
    reference = {(b.step, b.rank): b.fingerprint for b in bundle.reference_batches().records}
    shared = set(current) & set(reference)
    assert shared and all(current[k] != reference[k] for k in shared)
    path, expected = bundles[("corrupted_checkpoint", seed)]
    bundle = open_bundle(path)
    resumed = bundle.incident.job.resumed_from.step
    assert resumed == expected.onset_step - 1
    (entry,) = [c for c in bundle.checkpoints().checkpoints if c.step == resumed]
    assert entry.verified is False and entry.problem


@pytest.mark.parametrize("seed", SEEDS)
def test_version_mismatch_minority(bundles, seed: int) -> None:
    path, expected = bundles[("nccl_version_mismatch", seed)]
    versions = {}
    for node in open_bundle(path).incident.job.nodes:
        file = path / "nodes" / node / "nccl-version.txt"
        if file.is_file():
            versions[node] = read_evidence(file, "nccl-version").result.version
    odd = sorted(n for n, v in versions.items() if list(versions.values()).count(v) < len(versions) / 2)
    assert odd == sorted(expected.culprit_nodes)
    for node in expected.culprit_nodes:
        log = read_evidence(path / "nodes" / node / "nccl.log", "nccl-log").result
        assert {normalise_version(v) for v in log.versions if v} == {versions[node]}


def test_intact_resume_keeps_the_data_order(tmp_path: Path) -> None:
    for seed in range(6):
        path = tmp_path / f"b{seed}"
        expected = build_bundle(path, "grad_explosion", seed=seed, nodes=3, gpus_per_node=4, steps=200,
                                distractors=["intact_resume"])
        bundle = open_bundle(path)
        if "intact_resume" not in expected.distractors:
            continue
        resumed = bundle.incident.job.resumed_from.step
        assert resumed < expected.onset_step
        current = {(b.step, b.rank): b.fingerprint for b in bundle.batches().records}
        reference = {(b.step, b.rank): b.fingerprint for b in bundle.reference_batches().records}
        shared = set(current) & set(reference)
        assert shared and all(current[k] == reference[k] for k in shared)
        return
    pytest.fail("intact_resume was never planted")


# ------------------------------------------------------------------ determinism, variety


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(file.relative_to(path)).encode())
        h.update(file.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("cause", ["gpu_xid", "rng_not_restored", "rank_data_misalignment"])
def test_same_seed_same_bytes(tmp_path: Path, cause: str) -> None:
    a = build_bundle(tmp_path / "a", cause, seed=7, nodes=4, gpus_per_node=4, steps=180)
    b = build_bundle(tmp_path / "b", cause, seed=7, nodes=4, gpus_per_node=4, steps=180)
    assert a == b
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")


def test_same_bytes_in_another_process(tmp_path: Path) -> None:
    """String hashing is randomised per process: nothing may depend on set or dict order
    of strings."""
    build_bundle(tmp_path / "here", "nccl_error", seed=5, nodes=4, gpus_per_node=4, steps=170)
    code = ("from pathlib import Path; from spikeops.sim import build_bundle; "
            f"build_bundle(Path({str(tmp_path / 'there')!r}), 'nccl_error', seed=5, nodes=4, gpus_per_node=4, "
            "steps=170)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert _digest(tmp_path / "here") == _digest(tmp_path / "there")


def test_seeds_vary_names_culprits_and_numbers(bundles) -> None:
    for cause in ("gpu_xid", "overlong_sample", "thermal_throttle"):
        names = {tuple(open_bundle(bundles[(cause, s)][0]).incident.job.nodes) for s in SEEDS}
        assert len(names) == len(SEEDS)
        culprits = {(tuple(bundles[(cause, s)][1].culprit_nodes), tuple(bundles[(cause, s)][1].culprit_ranks))
                    for s in SEEDS}
        assert len(culprits) == len(SEEDS)
        spikes = {bundles[(cause, s)][1].spike_step or bundles[(cause, s)][1].onset_step for s in SEEDS}
        assert len(spikes) == len(SEEDS)


def test_world_draws_vary() -> None:
    worlds = [make_world(sub_rng("gpu_xid", seed, "world"), "gpu_xid", 6, 8) for seed in range(40)]
    assert len({w.nodes[0].rstrip("0123456789") for w in worlds}) >= 4
    assert {w.gpu.family for w in worlds} == {"H100", "A100"}
    assert {w.metrics_form for w in worlds} == {"jsonl", "megatron"}
    assert len({round(w.step_seconds) for w in worlds}) >= 6
    assert all(2.0 <= w.step_seconds <= 12.0 for w in worlds)
    assert len({f for w in worlds for f in w.kernel_formats}) == 4


def test_megatron_train_log_variant(tmp_path: Path) -> None:
    seed = next(s for s in range(100) if make_world(sub_rng("gpu_ecc", s, "world"), "gpu_ecc", 3, 4)
                .metrics_form == "megatron")
    expected = build_bundle(tmp_path / "b", "gpu_ecc", seed=seed, nodes=3, gpus_per_node=4, steps=170)
    assert not (tmp_path / "b" / "metrics.jsonl").exists()
    reading = read_evidence(tmp_path / "b" / "train.log", "training-log")
    assert reading.gaps == [] and reading.result.format == "megatron"
    steps = [r.step for r in reading.result.records]
    assert steps[0] <= expected.spike_step <= steps[-1]


# ------------------------------------------------------------------- distractors, CLI


@pytest.mark.parametrize("name", DISTRACTORS)
def test_each_distractor_can_be_planted(tmp_path: Path, name: str) -> None:
    for seed in range(5):
        expected = build_bundle(tmp_path / f"b{seed}", "false_alarm", seed=seed, nodes=5, gpus_per_node=4,
                                steps=170, distractors=[name])
        if name in expected.distractors:
            assert expected.culprit_nodes == [] and expected.symptom == "none"
            return
    pytest.fail(f"{name} was never planted")


@pytest.mark.parametrize("cause", CAUSES)
def test_distractors_never_change_the_answer(cause: str) -> None:
    for seed in range(6):
        size = {"nodes": 3 + seed, "gpus_per_node": (8, 4, 2)[seed % 3], "steps": 150 + 40 * seed}
        with_them = expected_of(plan_incident(cause, seed=seed, distractors=True, **size))
        without = expected_of(plan_incident(cause, seed=seed, distractors=False, **size))
        assert without.distractors == []
        for name in ("symptom", "layer", "culprit_nodes", "culprit_ranks", "spike_step", "onset_step",
                     "resume_from"):
            assert getattr(with_them, name) == getattr(without, name), (seed, name, with_them.distractors)


def test_distractor_requests_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        build_bundle(tmp_path / "a", "rng_not_restored", distractors=["intact_resume"])
    with pytest.raises(ValueError):
        build_bundle(tmp_path / "b", "false_alarm", distractors=["no_such_thing"])
    with pytest.raises(ValueError):
        build_bundle(tmp_path / "c", "no_such_cause")
    expected = build_bundle(tmp_path / "d", "false_alarm", nodes=3, gpus_per_node=4, steps=160, distractors=False)
    assert expected.distractors == []


def test_refuses_to_write_over_files(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_bundle(tmp_path / "x", "false_alarm", steps=160)
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["ib_link_flap", str(tmp_path / "b"), "--seed", "4", "--nodes", "3", "--steps", "170",
            "--no-distractors", "--write-expected"]
    assert sim_main.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["cause"] == "ib_link_flap" and printed["distractors"] == []
    stored = json.loads((tmp_path / "b" / "diagnosis.expected.json").read_text())
    assert stored["culprit_nodes"] == printed["culprit_nodes"]
    assert sim_main.main(argv) == 2
    assert sim_main.main([*argv, "--force"]) == 0

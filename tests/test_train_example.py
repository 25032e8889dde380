"""examples/train_tiny.py: a real (tiny, CPU) PyTorch training loop with every piece of
spikeops.train, whose output directory is a bundle that ``spikeops diagnose`` reads.

One injected run (a 50x max_length sample on rank 2 at step 60) is shared by the tests; the
resume tests start from its step-40 checkpoint with and without the RNG restored.
"""

from __future__ import annotations

import importlib.util
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from spikeops.checkpoints import verify  # noqa: E402
from spikeops.diagnosis import diagnose  # noqa: E402
from spikeops.train import DataOrderWarning  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny.py"
INJECT_STEP, INJECT_RANK, WORLD, MAX_LENGTH = 60, 2, 4, 32


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("train_tiny_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example() -> Any:
    return _example()


@pytest.fixture(scope="module")
def injected(example: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("injected")
    summary = example.main(["--out", str(out), "--steps", "80", "--inject-overlong", str(INJECT_STEP), "--seed", "0"])
    return out, summary


def _jsonl(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    assert lines, f"{path} is empty"
    return [json.loads(line) for line in lines]


def test_injected_overlong_sample_is_diagnosed(injected: tuple[Path, dict[str, Any]]) -> None:
    out, summary = injected
    losses, norms = summary["losses"], summary["grad_norms"]
    before = [losses[s] for s in range(INJECT_STEP - 10, INJECT_STEP)]
    assert losses[INJECT_STEP] > 2 * max(before), "the overlong sample must make the loss spike for real"
    assert norms[INJECT_STEP] > 2 * max(norms[s] for s in range(INJECT_STEP - 10, INJECT_STEP))
    assert INJECT_STEP in [step for step, _, _ in summary["grad_alarms"]]

    result = diagnose(out)
    assert result.primary.cause == "overlong_sample" and result.primary.layer == "data"
    assert result.primary.step == INJECT_STEP
    assert result.primary.ranks == [INJECT_RANK]
    assert result.spike_step == INJECT_STEP
    assert result.resume_from is not None
    assert result.resume_from["step"] < INJECT_STEP
    entries = {entry["step"]: entry for entry in json.loads((out / "checkpoints.json").read_text())}
    assert entries[result.resume_from["step"]]["verified"] is True
    assert result.resume_from["step"] == 40  # the newest checkpoint strictly before the spike


def test_bundle_files_follow_the_spec(injected: tuple[Path, dict[str, Any]]) -> None:
    out, _ = injected
    incident = json.loads((out / "incident.json").read_text())
    assert incident["format"] == "spikeops-bundle/1"
    assert incident["alert"]["source"] == "spikeops.train"
    job = incident["job"]
    assert job["scheduler"] == "local" and job["nodes"] == ["localhost"] and job["gpus_per_node"] == WORLD
    assert job["max_length"] == MAX_LENGTH and job["resumed_from"] is None
    assert incident["window"]["start"] <= incident["window"]["end"]

    metrics = _jsonl(out / "metrics.jsonl")
    assert [row["step"] for row in metrics] == list(range(1, 81))
    for row in metrics:
        assert isinstance(row["loss"], float) and math.isfinite(row["loss"])
        assert {"time", "lr", "grad_norm", "tokens"} <= row.keys()
        assert isinstance(row["time"], float) or row["time"].endswith("Z")  # Unix seconds or ISO 8601

    ranks = _jsonl(out / "ranks.jsonl")
    assert len(ranks) == 80 * WORLD
    assert {(row["step"], row["rank"]) for row in ranks} == {(s, r) for s in range(1, 81) for r in range(WORLD)}
    assert all(isinstance(row["loss"], float) and isinstance(row["grad_norm"], float) for row in ranks)

    batches = _jsonl(out / "batches.jsonl")
    assert len(batches) == 80 * WORLD
    for record in batches:
        assert {"step", "rank", "fingerprint", "num_samples", "max_tokens", "min_tokens", "num_empty",
                "sample_ids", "source"} <= record.keys()
        assert isinstance(record["fingerprint"], str) and len(record["fingerprint"]) == 32
        assert record["num_samples"] == len(record["sample_ids"])
        assert all(":" in sample and sample.startswith("shard-") for sample in record["sample_ids"])
        spike = record["step"] == INJECT_STEP and record["rank"] == INJECT_RANK
        # token counts before truncation: normal samples up to 48 (> max_length 32), the injected one 50x
        assert record["max_tokens"] == (50 * MAX_LENGTH if spike else record["max_tokens"])
        assert spike or record["max_tokens"] <= 48
    assert any(record["max_tokens"] > MAX_LENGTH for record in batches if record["step"] != INJECT_STEP)


def test_every_checkpoint_has_a_manifest_that_verifies(injected: tuple[Path, dict[str, Any]]) -> None:
    out, _ = injected
    directories = sorted((out / "ckpt").iterdir())
    assert [d.name for d in directories] == ["step-20", "step-40", "step-60", "step-80"]
    for directory in directories:
        assert (directory / "MANIFEST.json").is_file()
        assert (directory / "spikeops-train-state.pkl").is_file()
        assert verify(directory).ok
    entries = json.loads((out / "checkpoints.json").read_text())
    assert sorted(entry["step"] for entry in entries) == [20, 40, 60, 80]
    assert all(entry["verified"] is True and entry["problem"] is None for entry in entries)


def test_resume_with_rng_restored_keeps_the_data_order(example: Any, injected: tuple[Path, dict[str, Any]],
                                                       tmp_path: Path) -> None:
    base, before = injected
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataOrderWarning)
        summary = example.main(["--out", str(tmp_path), "--steps", "80", "--inject-overlong", str(INJECT_STEP),
                                "--resume-from", str(base / "ckpt" / "step-40")])
    assert summary["first_step"] == 41
    assert summary["fingerprints"] == {"matched": 20 * WORLD, "mismatches": 0, "ok": True}
    assert summary["order_warnings"] == []
    assert summary["anomaly"]["steps_checked"] == 5 and summary["anomaly"]["operator"] is None
    assert summary["losses"][80] == pytest.approx(before["losses"][80], rel=1e-6)  # the same run, resumed
    incident = json.loads((tmp_path / "incident.json").read_text())
    assert incident["job"]["resumed_from"]["step"] == 40
    assert (tmp_path / "reference" / "batches.jsonl").is_file()
    result = diagnose(tmp_path)
    assert "rng_not_restored" not in {finding.cause for finding in result.findings}


def test_resume_without_rng_restore_is_caught(example: Any, injected: tuple[Path, dict[str, Any]],
                                              tmp_path: Path) -> None:
    base, _ = injected
    with pytest.warns(DataOrderWarning, match="data order changed after the resume"):
        summary = example.main(["--out", str(tmp_path), "--steps", "80", "--inject-overlong", str(INJECT_STEP),
                                "--resume-from", str(base / "ckpt" / "step-40"), "--no-restore-rng"])
    assert summary["fingerprints"]["ok"] is False
    assert summary["fingerprints"]["mismatches"] > 0
    assert len(summary["order_warnings"]) == 1
    result = diagnose(tmp_path)
    assert "rng_not_restored" in {finding.cause for finding in result.findings}


def test_run_without_injection_has_no_overlong_sample(example: Any, tmp_path: Path) -> None:
    summary = example.main(["--out", str(tmp_path), "--steps", "80"])
    assert summary["filter"]["truncated"] > 0  # the filter did its job on the normal long samples
    result = diagnose(tmp_path)
    assert result.primary.cause != "overlong_sample"
    assert "overlong_sample" not in {finding.cause for finding in result.findings}


def test_the_diagnosis_remediation_reaches_the_resumed_run(example: Any, injected: tuple[Path, dict[str, Any]],
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole chain: diagnose the injected run, turn its actions into the resume
    environment the flow would pass, and resume with it: the poisoned batch is skipped."""
    from spikeops.remediation import resume_plan

    base, before = injected
    document = diagnose(base).to_json()
    plan = resume_plan(document["actions"], document["findings"])
    assert plan.env["SPIKEOPS_SKIP_STEPS"] == str(INJECT_STEP)
    for name, value in {**plan.env, "SPIKEOPS_RESUME_FROM": document["resume_from"]["path"]}.items():
        monkeypatch.setenv(name, value)
    summary = example.main(["--out", str(tmp_path), "--steps", "80", "--inject-overlong", str(INJECT_STEP)])
    assert summary["first_step"] == 41 and summary["skipped"] == [INJECT_STEP]
    assert INJECT_STEP not in summary["losses"]
    assert max(summary["losses"].values()) < before["losses"][INJECT_STEP] / 2  # no spike this time
    assert diagnose(tmp_path).primary.cause == "false_alarm"

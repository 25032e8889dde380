"""Checkpoint manifests, verification and picking, on real files in every layout."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import blake3
import pytest

from spikeops.checkpoints import bundle_entries, find_checkpoints, pick, save_manifest, verify, write_manifest
from spikeops.checkpoints.digest import CHUNK, hash_file
from spikeops.checkpoints.manifest import MANIFEST_NAME, QUARANTINE_MARKER, ManifestError, build_manifest, locate
from spikeops.cli import main
from spikeops.errors import InputError

LAYOUTS = {
    "pytorch-dcp": ("step-1200", [".metadata", "__0_0.distcp", "__1_0.distcp"]),
    "megatron": ("iter_0001200", ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"]),
    "deepspeed": ("global_step1200", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]),
    "safetensors": ("checkpoint-1200", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                        "model.safetensors.index.json", "trainer_state.json"]),
}


def _fill(folder: Path, names: list[str], size: int = 20_000) -> None:
    for index, name in enumerate(names):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size + index))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_round_trips(tmp_path: Path, layout: str) -> None:
    name, files = LAYOUTS[layout]
    folder = tmp_path / name
    _fill(folder, files)
    target = write_manifest(folder)
    document = json.loads(target.read_text())
    assert document["layout"] == layout and document["step"] == 1200 and document["algorithm"] == "blake3"
    assert sorted(entry["path"] for entry in document["files"]) == sorted(files)
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]  # the atomic write left nothing
    report = verify(folder)
    assert report.ok and report.files_checked == len(files) and report.bytes_hashed == document["total_bytes"]


def test_single_file_checkpoint_gets_a_sidecar(tmp_path: Path) -> None:
    model = tmp_path / "model-step500.pt"
    model.write_bytes(os.urandom(50_000))
    target = write_manifest(model, algorithm="sha256")
    assert target.name == "model-step500.pt.MANIFEST.json"
    assert json.loads(target.read_text())["files"][0]["digest"] == hashlib.sha256(model.read_bytes()).hexdigest()
    assert verify(model).ok
    with model.open("r+b") as handle:
        handle.seek(123)
        handle.write(b"\x00" if model.read_bytes()[123] else b"\x01")
    report = verify(model)
    assert [(p.path, p.kind) for p in report.problems] == [("model-step500.pt", "mismatch")]


def test_digests_are_the_libraries_own(tmp_path: Path) -> None:
    data = os.urandom(CHUNK * 2 + 12345)  # several chunks, not aligned
    path = tmp_path / "x.bin"
    path.write_bytes(data)
    assert hash_file(path, "blake3").digest == blake3.blake3(data).hexdigest()
    assert hash_file(path, "sha256").digest == hashlib.sha256(data).hexdigest()
    assert hash_file(path, "blake3", threads=False).digest == blake3.blake3(data).hexdigest()


def test_every_problem_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "global_step300"
    _fill(folder, ["a.pt", "b.pt", "c.pt", "d.pt", "e.pt", "sub/f.pt"])
    write_manifest(folder)
    (folder / "a.pt").unlink()                                   # missing
    (folder / "b.pt").write_bytes((folder / "b.pt").read_bytes()[:100])  # truncated
    (folder / "c.pt").write_bytes((folder / "c.pt").read_bytes() + b"more")  # grown
    raw = bytearray((folder / "d.pt").read_bytes())
    raw[5000] ^= 0xFF
    (folder / "d.pt").write_bytes(bytes(raw))                     # same size, other bytes
    (folder / "e.pt").unlink()
    (folder / "e.pt").mkdir()                                     # cannot be read as a file
    (folder / "new.pt").write_bytes(b"surprise")                  # extra
    report = verify(folder)
    kinds = {p.path: p.kind for p in report.problems}
    assert kinds == {"a.pt": "missing", "b.pt": "truncated", "c.pt": "grown", "d.pt": "mismatch",
                     "e.pt": "unreadable", "new.pt": "extra"}
    assert not report.ok and "missing" in report.summary()
    assert "sub/f.pt" not in kinds


def test_a_file_changed_while_read_is_never_verified(tmp_path: Path) -> None:
    folder = tmp_path / "step-10"
    folder.mkdir()
    big = folder / "shard.bin"
    big.write_bytes(os.urandom(CHUNK + 1000))
    write_manifest(folder)
    calls = []

    def writer_interferes(count: int) -> None:
        if not calls:
            with big.open("ab") as handle:
                handle.write(b"appended by a still-running save")
        calls.append(count)

    report = verify(folder, progress=writer_interferes, workers=1)
    assert [(p.path, p.kind) for p in report.problems] == [("shard.bin", "changed")]


def test_symlink_loops_and_links_are_not_followed(tmp_path: Path) -> None:
    folder = tmp_path / "step-20"
    _fill(folder, ["w.pt"])
    os.symlink("loop", folder / "loop")
    os.symlink(folder, folder / "self")
    document = build_manifest(folder)
    assert [entry["path"] for entry in document["files"]] == ["w.pt"]
    assert any("symlink" in note for note in document["not_listed"])
    manifest = folder / MANIFEST_NAME
    document["files"].append({"path": "loop", "size": 1, "digest": "ab" * 32})
    manifest.write_text(json.dumps(document))
    report = verify(folder)
    assert [(p.path, p.kind) for p in report.problems] == [("loop", "unreadable")]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: "not json {", "not valid JSON"),
        (lambda d: json.dumps([1, 2]), "not a JSON object"),
        (lambda d: json.dumps({**d, "files": [{"path": "../../etc/passwd", "size": 1, "digest": "ab" * 32}]}),
         "outside the checkpoint"),
        (lambda d: json.dumps({**d, "files": [{"path": "/etc/passwd", "size": 1, "digest": "ab" * 32}]}),
         "outside the checkpoint"),
        (lambda d: json.dumps({**d, "files": d["files"] * 2}), "lists a file twice"),
        (lambda d: json.dumps({**d, "algorithm": "md5"}), "unknown algorithm"),
        (lambda d: json.dumps({**d, "format": "other/9"}), "unknown format"),
        (lambda d: json.dumps({**d, "files": [{"path": "w.pt", "size": -1, "digest": "ab" * 32}]}), "valid size"),
        (lambda d: json.dumps({**d, "files": []}), "lists no files"),
    ],
)
def test_untrustworthy_manifests_are_refused(tmp_path: Path, edit, message: str) -> None:
    folder = tmp_path / "step-30"
    _fill(folder, ["w.pt"])
    manifest = write_manifest(folder)
    manifest.write_text(edit(json.loads(manifest.read_text())))
    with pytest.raises(ManifestError) as caught:
        verify(folder)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    err = io.StringIO()
    assert main(["checkpoint", "verify", str(folder)], out=io.StringIO(), err=err) == 2
    assert err.getvalue().count("\n") == 1


def test_cli_exit_statuses(tmp_path: Path) -> None:
    folder = tmp_path / "step-40"
    _fill(folder, ["w.pt"])
    out = io.StringIO()
    assert main(["checkpoint", "manifest", str(folder)], out=out, err=io.StringIO()) == 0
    assert main(["checkpoint", "verify", str(folder)], out=io.StringIO(), err=io.StringIO()) == 0
    out = io.StringIO()
    assert main(["checkpoint", "verify", str(folder), "--json"], out=out, err=io.StringIO()) == 0
    assert json.loads(out.getvalue())["verified"] is True
    (folder / "w.pt").write_bytes(b"short")
    out = io.StringIO()
    assert main(["checkpoint", "verify", str(folder)], out=out, err=io.StringIO()) == 1
    assert "w.pt: truncated" in out.getvalue()
    err = io.StringIO()
    assert main(["checkpoint", "verify", str(tmp_path / "none")], out=io.StringIO(), err=err) == 2
    assert "no such checkpoint" in err.getvalue()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["checkpoint", "verify", str(empty)], out=io.StringIO(), err=io.StringIO()) == 2
    assert main(["checkpoint", "manifest", str(empty)], out=io.StringIO(), err=io.StringIO()) == 2


def _run_root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    for step in (1000, 2000, 3000, 4000):
        _fill(root / f"global_step{step}", ["mp_rank_00/model_optim_rng.pt", "latest"])
        if step != 3000:  # 3000 was saved by a job without the manifest hook
            write_manifest(root / f"global_step{step}")
    (root / "latest_checkpointed_iteration.txt").write_text("4000\n")
    return root


def test_pick_takes_the_newest_verified_before_the_onset(tmp_path: Path) -> None:
    root = _run_root(tmp_path)
    (root / "global_step2000" / "latest").write_bytes(b"corrupted by a failing GPU")
    result = pick(root, 4000)
    assert result.chosen is not None and result.chosen.step == 1000
    reasons = {c.step: why for c, why in result.skipped}
    assert reasons[4000] == "step 4000 is not before 4000"
    assert reasons[3000] == "no manifest: cannot be verified"
    assert reasons[2000].startswith("corrupt: latest: truncated")
    entries = {e["step"]: e for e in bundle_entries(result)}
    assert entries[1000]["verified"] is True and entries[1000]["problem"] is None
    assert entries[2000]["verified"] is False and "truncated" in entries[2000]["problem"]
    assert entries[3000]["verified"] is None and entries[4000]["verified"] is None
    assert pick(root, 1000).chosen is None  # strictly before


def test_quarantine_marks_or_renames_and_never_deletes(tmp_path: Path) -> None:
    root = _run_root(tmp_path)
    (root / "global_step2000" / "latest").write_bytes(b"bad")
    files_before = sorted(p.relative_to(root).as_posix().replace("global_step2000", "X")
                          for p in root.rglob("*") if p.is_file())
    result = pick(root, 4000, quarantine_mode="marker")
    assert [c.step for c, _ in result.quarantined] == [2000]
    assert (root / "global_step2000" / QUARANTINE_MARKER).is_file()
    again = pick(root, 4000)
    assert {c.step: why for c, why in again.skipped}[2000].startswith("quarantined: latest: truncated")
    renamed = pick(root, 3000, quarantine_mode="rename")
    assert renamed.chosen is not None and renamed.chosen.step == 1000
    (root / "global_step1000" / "latest").write_bytes(b"bad too")
    moved = pick(root, 2000, quarantine_mode="rename")
    assert moved.chosen is None and (root / "global_step1000.quarantined").is_dir()
    assert not (root / "global_step1000").exists()
    files_after = sorted(p.relative_to(root).as_posix().replace("global_step2000", "X")
                         .replace("global_step1000.quarantined", "global_step1000")
                         for p in root.rglob("*") if p.is_file() and p.name != QUARANTINE_MARKER)
    assert files_after == files_before
    assert [c.step for c in find_checkpoints(root)] == [4000, 3000, 2000, 1000]


def test_cli_pick(tmp_path: Path) -> None:
    root = _run_root(tmp_path)
    out = io.StringIO()
    assert main(["checkpoint", "pick", str(root), "--before", "4500", "--json"], out=out, err=io.StringIO()) == 0
    document = json.loads(out.getvalue())
    assert document["chosen"]["step"] == 4000 and document["chosen"]["verify"]["verified"] is True
    assert main(["checkpoint", "pick", str(root), "--before", "10"], out=io.StringIO(), err=io.StringIO()) == 1
    err = io.StringIO()
    assert main(["checkpoint", "pick", str(tmp_path / "nope"), "--before", "10"], out=io.StringIO(), err=err) == 2


def test_save_manifest_from_a_training_script(tmp_path: Path) -> None:
    folder = tmp_path / "step-50"
    _fill(folder, ["w.pt"])
    future = save_manifest(folder, step=50, background=True)
    path = future.result(timeout=30)
    assert json.loads(path.read_text())["step"] == 50 and verify(folder).ok
    with pytest.raises(InputError):
        locate(tmp_path / "missing")


def test_prefect_tasks_fill_the_bundles_checkpoints_json(tmp_path: Path, prefect_server: None) -> None:
    from prefect import flow

    from spikeops.bundle import open_bundle
    from spikeops.tasks.checkpoints import pick_checkpoint, verify_checkpoint

    root = _run_root(tmp_path)
    (root / "global_step2000" / "latest").write_bytes(b"bad")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "incident.json").write_text(json.dumps({"format": "spikeops-bundle/1", "incident_id": "inc-1",
                                                      "job": {"id": "1", "nodes": []}}))

    @flow
    def resume_point() -> tuple[dict, dict]:
        return (verify_checkpoint(str(root / "global_step4000")),
                pick_checkpoint(str(root), 4000, bundle=str(bundle)))

    verified, picked = resume_point()
    assert verified["verified"] is True
    assert picked["chosen"]["step"] == 1000
    listed = open_bundle(bundle).checkpoints()
    assert listed is not None
    status = {c.step: c.verified for c in listed.checkpoints}
    assert status == {4000: None, 3000: None, 2000: False, 1000: True}


def test_protect_keeps_a_checkpoint_through_the_jobs_retention(tmp_path: Path) -> None:
    from spikeops.checkpoints.protect import protect

    root = _run_root(tmp_path)
    target, made = protect(root / "global_step2000", "inc-1")
    assert made == 3 and protect(root / "global_step2000")[1] == 0  # idempotent
    import shutil

    shutil.rmtree(root / "global_step2000")  # the job's "keep last 2" retention
    assert verify(target).ok  # the data and its manifest survived, hard-linked

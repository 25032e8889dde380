"""``spikeops checkpoint manifest|verify|pick``: checkpoint integrity by manifest. Its imports
are the command's start-up time, which a verify of a warm checkpoint pays in full: nothing
beyond the checkpoint package is imported for it."""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from spikeops.cli.common import EXIT_NOTHING, EXIT_OK

__all__ = ["add_checkpoint"]


def _byte_progress(stream: TextIO, total: int, label: str):
    """Bytes hashed so far, on a terminal only."""
    if not stream.isatty() or total <= 0:
        return None
    import threading

    lock = threading.Lock()
    done = 0
    last = [0.0]

    def show(count: int) -> None:
        nonlocal done
        import time

        with lock:
            done += count
            now = time.monotonic()
            if now - last[0] < 0.2 and done < total:
                return
            last[0] = now
            stream.write(f"\r  {label}: {100.0 * done / total:5.1f}% of {total / 1e9:.2f} GB")
            stream.flush()

    return show


def _checkpoint_total(path: str) -> int:
    from spikeops.checkpoints.manifest import list_files, locate

    checkpoint = locate(path)
    files, _ = list_files(checkpoint)
    total = 0
    for rel in files:
        try:
            total += (checkpoint.root / rel).stat().st_size
        except OSError:
            pass
    return total


def _cmd_checkpoint(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.checkpoints import pick, verify, write_manifest

    if args.action == "manifest":
        progress = _byte_progress(err, _checkpoint_total(args.path) if err.isatty() else 0, "hashing")
        target = write_manifest(args.path, algorithm=args.algorithm, step=args.step, workers=args.workers,
                                progress=progress)
        if progress:
            err.write("\n")
        out.write(f"written: {target}\n")
        return EXIT_OK
    if args.action == "verify":
        progress = _byte_progress(err, _checkpoint_total(args.path) if err.isatty() and not args.json else 0,
                                  "verifying")
        report = verify(args.path, workers=args.workers, progress=progress)
        if progress:
            err.write("\n")
        if args.json:
            out.write(json.dumps(report.to_json(), indent=2) + "\n")
        else:
            rate = report.bytes_hashed / report.seconds / 1e6 if report.seconds else 0.0
            out.write(f"{report.checkpoint.path}: {'verified' if report.ok else 'NOT VERIFIED'} "
                      f"({len(report.manifest.files)} files, {report.manifest.total_bytes / 1e9:.2f} GB, "
                      f"{report.manifest.algorithm}, {report.seconds:.1f} s, {rate:.0f} MB/s)\n")
            for problem in report.problems:
                out.write(f"  {problem.line()}\n")
        return EXIT_OK if report.ok else EXIT_NOTHING
    # pick
    def announce(candidate: Any) -> None:
        if err.isatty() and not args.json:
            err.write(f"  verifying {candidate.path} (step {candidate.step})\n")

    result = pick(args.path, args.before, quarantine_mode=args.quarantine, workers=args.workers,
                  on_candidate=announce)
    if args.json:
        out.write(json.dumps(result.to_json(), indent=2) + "\n")
    else:
        if result.chosen is not None:
            out.write(f"resume from: {result.chosen.path} (step {result.chosen.step}, verified)\n")
        else:
            out.write(f"no verified checkpoint before step {args.before} under {args.path}\n")
        for candidate, why in result.skipped:
            out.write(f"  skipped {candidate.path.name}: {why}\n")
        for candidate, how in result.quarantined:
            out.write(f"  quarantined {candidate.path.name}: {how}\n")
    return EXIT_OK if result.chosen is not None else EXIT_NOTHING


def add_checkpoint(commands: Any) -> None:
    ckpt = commands.add_parser(
        "checkpoint",
        help="write, verify and pick checkpoints by their MANIFEST.json (BLAKE3 or SHA-256)",
        description=(
            "Checkpoint integrity. A MANIFEST.json in the checkpoint directory lists every file's "
            "path, size and digest, the algorithm, the step and the time; it is written atomically. "
            "Works for PyTorch DCP directories, Megatron/DeepSpeed global_stepN/iter_N with mp_rank_* "
            "files, Hugging Face safetensors shards, any directory, and a single file (sidecar "
            "FILE.MANIFEST.json)."
        ),
        epilog=(
            "Examples:\n"
            "  spikeops checkpoint manifest /ckpt/run7/global_step12000\n"
            "  spikeops checkpoint verify /ckpt/run7/global_step12000 --json\n"
            "  spikeops checkpoint pick /ckpt/run7 --before 12345 --quarantine marker\n"
            "Exit status: manifest 0 written, 2 unreadable; verify 0 every file matches, 1 any does "
            "not (each named), 2 no manifest or unreadable; pick 0 a checkpoint was chosen, 1 none "
            "verified before STEP, 2 bad input."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = ckpt.add_subparsers(dest="action", metavar="ACTION", required=True)
    make = actions.add_parser("manifest", help="write DIR/MANIFEST.json")
    make.add_argument("path", metavar="DIR", help="checkpoint directory (or single checkpoint file)")
    make.add_argument("--algorithm", choices=("blake3", "sha256"), default="blake3",
                      help="digest (default blake3: several GB/s a core; sha256 for compliance)")
    make.add_argument("--step", type=int, default=None, help="the step (default: from the name, e.g. global_step12000)")
    check = actions.add_parser("verify", help="check every file against the manifest")
    check.add_argument("path", metavar="DIR", help="checkpoint directory (or single checkpoint file)")
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    choose = actions.add_parser("pick", help="newest verified checkpoint strictly before a step")
    choose.add_argument("path", metavar="ROOT", help="directory holding the checkpoints")
    choose.add_argument("--before", type=int, required=True, metavar="STEP",
                        help="the onset step: only checkpoints with a smaller step qualify")
    choose.add_argument("--quarantine", choices=("marker", "rename"), default=None,
                        help="mark corrupt checkpoints (marker file) or rename them so loaders skip them")
    choose.add_argument("--json", action="store_true", help="print the result as JSON")
    for sub in (make, check, choose):
        sub.add_argument("--workers", type=int, default=None, help="files hashed at once (default: CPUs, 2-8)")
    ckpt.set_defaults(handler=_cmd_checkpoint)

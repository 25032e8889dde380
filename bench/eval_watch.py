#!/usr/bin/env python3
"""The watcher on real logs: false incidents on healthy runs, and real spikes caught. Run by hand.

Three measurements of ``spikeops watch --log`` (the same ``Detector`` over the same log reader,
in-process, every record of each file from its start):

- **false incidents per 10,000 steps** on healthy runs logged every step (``--healthy``: a
  folder of training logs; the public runs used for bench/README.md are named there);
- **real spikes caught**: every case of the real-incident corpus (``--corpus``, default
  tests/fixtures/real-incidents) whose label has a loss anomaly (``instant_nan``,
  ``single_spike``, ``spike_no_recovery``), replayed through the watcher: caught when it
  starts an incident at or after the first step of the labelled trouble;
- **injected spikes** (``--inject N``, synthetic on real texture): N copies of each healthy log,
  each with one jump put in at a random step past the first 500: a one-step x2 jump (the loss
  doubles), and a x1.4 jump held for 10 steps; caught when an incident starts within 10 steps.

``--old`` judges with the spike rule alone (no routine jumps, no holds), the watcher before
issue 28, for the before/after figures.

Usage: python bench/eval_watch.py --healthy DIR [--corpus DIR] [--inject 3] [--old] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spikeops.watch.detect import Detector, WatchConfig  # noqa: E402
from spikeops.watch.sources import follow_log  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ANOMALOUS = ("instant_nan", "single_spike", "spike_no_recovery")


def _config(old: bool) -> WatchConfig:
    """The watcher's defaults; ``old``: a jump is never routine and never held (the spike test
    alone, as before issue 28)."""
    config = WatchConfig()
    if old:
        config = replace(config, jump_factor=0.0, routine_margin=1e-9, order_of_magnitude=1e18)
    return config


class _OldDetector(Detector):
    """The pre-issue-28 rule: a z-spike fires at once; no hold, no texture, no short history."""

    def _loss_jump(self, loss: float, step: int, judged: bool):  # noqa: ANN202
        spike = self._spike(self._loss, loss, self.config.loss_z, self.config.loss_rel, judged)
        if spike is None:
            return None
        from spikeops.watch.detect import _Finding

        return _Finding("loss_spike", loss, spike[0], f"loss {loss:.4g} spike")


def _detector(old: bool) -> Detector:
    return _OldDetector(_config(False)) if old else Detector(_config(False))


def _records(path: Path) -> list[dict[str, Any]]:
    return list(follow_log(path, from_start=True, once=True))


def healthy(folder: Path, old: bool) -> dict[str, Any]:
    rows, steps, incidents = [], 0, 0
    for path in sorted(folder.glob("*.log")):
        detector = _detector(old)
        records = _records(path)
        for record in records:
            detector.feed(record)
        steps += len(records)
        incidents += len(detector.incidents)
        rows.append({"log": path.name, "steps": len(records), "incidents": [a.step for a in detector.incidents],
                     "recorded": len(getattr(detector, "recorded", []))})
    return {"logs": rows, "steps": steps, "incidents": incidents,
            "per_10k": round(10_000 * incidents / steps, 2) if steps else None}


def corpus(folder: Path, old: bool) -> dict[str, Any]:
    rows = []
    for case in sorted(p for p in folder.iterdir() if (p / "label.json").is_file() and (p / "train.log").is_file()):
        label = json.loads((case / "label.json").read_text(encoding="utf-8"))
        if label["symptom"] not in ANOMALOUS:
            continue
        detector = _detector(old)
        records = _records(case / "train.log")
        for record in records:
            detector.feed(record)
        rows.append({"case": case.name, "symptom": label["symptom"], "records": len(records),
                     "fired": [(a.kind, a.step) for a in detector.incidents]})
    return {"cases": rows, "caught": sum(bool(r["fired"]) for r in rows), "of": len(rows)}


def inject(folder: Path, copies: int, old: bool, seed: int = 28) -> dict[str, Any]:
    rng = random.Random(seed)
    results: dict[str, list[bool]] = {"one-step x2": [], "x1.4 held 10 steps": []}
    for path in sorted(folder.glob("*.log")):
        base = [r for r in _records(path) if r.get("loss") is not None]
        if len(base) < 700:
            continue
        for _ in range(copies):
            for kind in results:
                at = rng.randrange(500, len(base) - 20)
                records = [dict(r) for r in base]
                span = 1 if kind == "one-step x2" else 10
                factor = 2.0 if kind == "one-step x2" else 1.4
                for record in records[at:at + span]:
                    record["loss"] = float(record["loss"]) * factor
                detector = _detector(old)
                caught = False
                for index, record in enumerate(records):
                    anomaly = detector.feed(record)
                    if anomaly is not None and at <= index <= at + 10:
                        caught = True
                results[kind].append(caught)
    return {kind: {"caught": sum(flags), "of": len(flags)} for kind, flags in results.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--healthy", type=Path, required=True, help="folder of healthy per-step training logs")
    parser.add_argument("--corpus", type=Path, default=ROOT / "tests" / "fixtures" / "real-incidents")
    parser.add_argument("--inject", type=int, default=0, metavar="N", help="injected jumps per log and kind")
    parser.add_argument("--old", action="store_true", help="the spike test alone (the watcher before issue 28)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not args.healthy.is_dir() or not any(args.healthy.glob("*.log")):
        print(f"eval_watch: no *.log under {args.healthy}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"healthy": healthy(args.healthy, args.old)}
    if args.corpus.is_dir():
        out["corpus"] = corpus(args.corpus, args.old)
    if args.inject:
        out["injected"] = inject(args.healthy, args.inject, args.old)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    h = out["healthy"]
    for row in h["logs"]:
        print(f"{row['log'][:44]:44} steps {row['steps']:6}  incidents {len(row['incidents']):3}  "
              f"recorded {row['recorded']:3}  {row['incidents'][:6]}")
    print(f"healthy: {h['incidents']} incident(s) over {h['steps']:,} steps = {h['per_10k']} per 10,000 steps")
    if "corpus" in out:
        c = out["corpus"]
        for row in c["cases"]:
            print(f"  {row['case'][:44]:44} {row['symptom']:17} records {row['records']:4}  fired {row['fired']}")
        print(f"real spikes caught: {c['caught']}/{c['of']} corpus cases with a loss anomaly")
    for kind, value in out.get("injected", {}).items():
        print(f"injected {kind}: caught {value['caught']}/{value['of']} within 10 steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Accuracy of `spikeops diagnose` on REAL incidents (tests/fixtures/real-incidents). Run by hand.

Each case is an incident bundle built around text that a real run printed (a public training
chronicle, or an issue thread where someone pasted their log), with a ``label.json`` holding the
symptom the metrics in the text show and the cause the thread concluded (null where it reached
none). Every case is copied to a temporary directory and diagnosed in-process
(``spikeops.diagnosis.diagnose``), so the fixture tree is never written to.

Scored per case:
- symptom: the diagnosis's symptom equals the label's;
- cause: the primary cause equals the label's (only cases whose thread reached a cause); a
  label may list ``acceptable`` alternatives (a thread that concluded one cause but whose text
  also fits another the spec names), counted apart;
- culprits: the culprit node set equals the label's.
Totals also count the two failures that hurt most on call:
- confident false alarm on unread evidence: label symptom ``unknown`` (no step metrics could be
  judged), answer ``false_alarm`` with confidence >= 0.5;
- healthy node drained: a culprit node the label does not name; and culprits missed;
- a guess presented as a cause: a primary cause other than ``inconclusive``/``false_alarm`` at a
  confidence below 0.5 (a cause is named only by a rule that holds).

Two corpora: ``tests/fixtures/real-incidents`` (the rules were written and tuned against it) and
``tests/fixtures/real-incidents-heldout`` (collected after the rules of issue 28 were written,
scored once; ``--corpus`` selects it). Report their figures apart.

Unlike bench/eval_diagnosis.py (our own generator), nobody here wrote the incidents for us:
treat these figures as the honest ones, and the corpus as small (one wrong case moves the
percentages by several points).

Usage: python bench/eval_real.py [--corpus DIR] [--case NAME] [--json] [--misses]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spikeops.diagnosis import diagnose  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "fixtures" / "real-incidents"
#: The spec's bar for a confident answer (a false alarm below it is a hedge, not a claim).
CONFIDENT = 0.5


@dataclass
class Row:
    case: str
    want_symptom: str
    want_cause: str | None
    want_culprits: list[str]
    acceptable: list[str] = field(default_factory=list)
    got_symptom: str | None = None
    got_cause: str | None = None
    confidence: float | None = None
    got_culprits: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    @property
    def symptom_right(self) -> bool:
        return self.error is None and self.got_symptom == self.want_symptom

    @property
    def cause_right(self) -> bool | None:
        if self.want_cause is None:
            return None
        return self.error is None and self.got_cause == self.want_cause

    @property
    def cause_acceptable(self) -> bool | None:
        """Right, or one of the label's acceptable alternatives."""
        if self.want_cause is None:
            return None
        return self.error is None and (self.got_cause == self.want_cause or self.got_cause in self.acceptable)

    @property
    def guess_as_cause(self) -> bool:
        return (self.error is None and self.got_cause not in ("inconclusive", "false_alarm")
                and (self.confidence or 0.0) < CONFIDENT)

    @property
    def culprits_right(self) -> bool:
        return self.error is None and sorted(self.got_culprits) == sorted(self.want_culprits)

    @property
    def drained(self) -> list[str]:
        return sorted(set(self.got_culprits) - set(self.want_culprits))

    @property
    def missed(self) -> list[str]:
        return sorted(set(self.want_culprits) - set(self.got_culprits))

    @property
    def confident_false_alarm_unread(self) -> bool:
        return (self.want_symptom == "unknown" and self.got_cause == "false_alarm"
                and (self.confidence or 0.0) >= CONFIDENT)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(symptom_right=self.symptom_right, cause_right=self.cause_right,
                    cause_acceptable=self.cause_acceptable, guess_as_cause=self.guess_as_cause,
                    culprits_right=self.culprits_right, drained=self.drained, missed=self.missed,
                    confident_false_alarm_unread=self.confident_false_alarm_unread)
        return data


def cases(corpus: Path) -> list[Path]:
    """Case directories: those holding both incident.json and label.json, by name."""
    return sorted(p for p in corpus.iterdir()
                  if p.is_dir() and (p / "incident.json").is_file() and (p / "label.json").is_file())


def evaluate(case_dir: Path, scratch: Path) -> Row:
    """Diagnose a copy of one case and compare it with its label (errors become a row)."""
    label = json.loads((case_dir / "label.json").read_text(encoding="utf-8"))
    row = Row(case_dir.name, label["symptom"], label.get("cause"), list(label.get("culprit_nodes") or []),
              list(label.get("acceptable") or []))
    copy = scratch / case_dir.name
    shutil.copytree(case_dir, copy)
    started = time.perf_counter()
    try:
        got = diagnose(copy).to_json()
    except Exception as exc:  # a crash is a wrong answer, and worth seeing, not a stop
        row.error = f"{type(exc).__name__}: {exc}"
    else:
        row.got_symptom = got["symptom"]
        row.got_cause = got["primary"]["cause"]
        row.confidence = float(got["primary"]["confidence"])
        row.got_culprits = list(got["culprit_nodes"])
    row.seconds = time.perf_counter() - started
    shutil.rmtree(copy, ignore_errors=True)
    return row


def totals(rows: list[Row]) -> dict[str, Any]:
    labelled = [r for r in rows if r.want_cause is not None]
    with_culprits = [r for r in rows if r.want_culprits]
    by_symptom: dict[str, list[int]] = {}
    for r in rows:
        right_total = by_symptom.setdefault(r.want_symptom, [0, 0])
        right_total[0] += r.symptom_right
        right_total[1] += 1
    return {
        "cases": len(rows),
        "symptom_right": sum(r.symptom_right for r in rows),
        "cause_labelled": len(labelled),
        "cause_right": sum(bool(r.cause_right) for r in labelled),
        "cause_acceptable": sum(bool(r.cause_acceptable) for r in labelled),
        "no_cause_reached": len(rows) - len(labelled),
        "no_cause_and_none_named": sum(r.got_cause in ("inconclusive", "false_alarm") for r in rows
                                       if r.want_cause is None and r.error is None),
        "guesses_as_causes": sum(r.guess_as_cause for r in rows),
        "culprits_labelled": len(with_culprits),
        "culprits_exact": sum(r.culprits_right for r in rows),
        "confident_false_alarm_unread": sum(r.confident_false_alarm_unread for r in rows),
        "unread_cases": sum(r.want_symptom == "unknown" for r in rows),
        "healthy_nodes_drained": sum(len(r.drained) for r in rows),
        "cases_draining_healthy": sum(bool(r.drained) for r in rows),
        "culprits_missed": sum(len(r.missed) for r in rows),
        "errors": sum(r.error is not None for r in rows),
        "symptom_by_label": {k: {"right": v[0], "of": v[1]} for k, v in sorted(by_symptom.items())},
        "seconds": round(sum(r.seconds for r in rows), 2),
    }


def _pct(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.0f} %)" if whole else "0/0"


def _mark(value: bool | None) -> str:
    return "-" if value is None else ("ok" if value else "XX")


def print_table(rows: list[Row], summary: dict[str, Any], out=sys.stdout) -> None:
    header = (f"{'case':44} {'want symptom':17} {'want cause':20} {'got symptom':17} "
              f"{'got cause':22} {'conf':>4}  S  C  N  culprits want -> got")
    out.write(header + "\n" + "-" * len(header) + "\n")
    for r in rows:
        got_cause = r.got_cause if r.error is None else "ERROR"
        conf = f"{r.confidence:.2f}" if r.confidence is not None else "  - "
        culprits = f"{','.join(r.want_culprits) or '-'} -> {','.join(r.got_culprits) or '-'}"
        out.write(f"{r.case[:44]:44} {r.want_symptom:17} {str(r.want_cause or '(none)'):20} "
                  f"{str(r.got_symptom):17} {str(got_cause):22} {conf:>4} "
                  f"{_mark(r.symptom_right):>2} {_mark(r.cause_right):>2} {_mark(r.culprits_right):>2}  "
                  f"{culprits}\n")
        if r.error:
            out.write(f"    error: {r.error}\n")
    s = summary
    out.write("\n")
    out.write(f"cases: {s['cases']} ({s['seconds']} s)\n")
    out.write(f"symptom right: {_pct(s['symptom_right'], s['cases'])}\n")
    for name, v in s["symptom_by_label"].items():
        out.write(f"  label {name:17} {_pct(v['right'], v['of'])}\n")
    out.write(f"cause right: {_pct(s['cause_right'], s['cause_labelled'])} (cases whose thread reached a cause)\n")
    if s["cause_acceptable"] != s["cause_right"]:
        out.write(f"cause right or an acceptable alternative: {_pct(s['cause_acceptable'], s['cause_labelled'])}\n")
    out.write(f"no cause named where the thread reached none: "
              f"{_pct(s['no_cause_and_none_named'], s['no_cause_reached'])} (inconclusive or false_alarm)\n")
    out.write(f"a cause named below confidence 0.5 (a guess as a cause): {s['guesses_as_causes']}\n")
    out.write(f"culprit set exact: {_pct(s['culprits_exact'], s['cases'])} "
              f"({s['culprits_labelled']} case(s) name a faulty node)\n")
    out.write(f"confident false_alarm on unread evidence: {s['confident_false_alarm_unread']} "
              f"of {s['unread_cases']} unread case(s)\n")
    out.write(f"healthy nodes drained: {s['healthy_nodes_drained']} (in {s['cases_draining_healthy']} case(s))\n")
    out.write(f"culprits missed: {s['culprits_missed']}\n")
    if s["errors"]:
        out.write(f"errors: {s['errors']}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=CORPUS, help=f"corpus directory (default: {CORPUS})")
    parser.add_argument("--case", action="append", metavar="NAME",
                        help="only this case (repeatable; a directory name under the corpus)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (rows and totals) instead")
    parser.add_argument("--misses", action="store_true", help="list only the cases with a wrong mark")
    args = parser.parse_args(argv)
    if not args.corpus.is_dir():
        print(f"eval_real: no corpus at {args.corpus}", file=sys.stderr)
        return 2
    found = cases(args.corpus)
    if args.case:
        names = {p.name: p for p in found}
        unknown = [name for name in args.case if name not in names]
        if unknown:
            print(f"eval_real: no such case: {', '.join(unknown)} (see {args.corpus})", file=sys.stderr)
            return 2
        found = [names[name] for name in args.case]
    if not found:
        print(f"eval_real: no cases under {args.corpus}", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="spikeops-eval-real-"))
    try:
        rows = []
        for index, case_dir in enumerate(found, 1):
            if not args.json and sys.stderr.isatty():
                print(f"\r[{index}/{len(found)}] {case_dir.name[:60]:60}", end="", file=sys.stderr, flush=True)
            rows.append(evaluate(case_dir, scratch))
        if not args.json and sys.stderr.isatty():
            print("\r" + " " * 72 + "\r", end="", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = totals(rows)
    if args.json:
        print(json.dumps({"corpus": str(args.corpus), "rows": [r.to_json() for r in rows], "totals": summary},
                         indent=2))
        return 0
    shown = [r for r in rows if not (r.symptom_right and r.cause_right is not False and r.culprits_right)] \
        if args.misses else rows
    print_table(shown, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

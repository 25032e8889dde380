"""``spikeops incidents``, ``spikeops ledger`` and ``spikeops nodes history``: the ledger for people.

- ``incidents list|show|report [--since 30d] [--cluster C] [--json]``: rich tables (plain text
  when piped); ``--json`` prints shared/spec/ledger.md's shapes and nothing else;
- ``ledger import DIR``: rebuild the ledger from existing bundles (oldest first, so a resumed
  job finds its parent's lineage), with a line per bundle; ``ledger replay``: write what the
  flow spooled while the ledger was unreachable; ``ledger upgrade``: migrate; ``ledger info``:
  which ledger (its URL masked), its schema, its rows;
- ``nodes history NODE [--json]``: a node's convictions and lifecycle.

Every command takes ``--config F`` (``[ledger] url``); the URL's password is never printed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

from spikeops.errors import InputError, SpikeopsError

__all__ = ["add_parsers", "add_incidents_parser", "add_ledger_parser", "add_history_parser", "run_nodes_history", "node_history", "since_stamp", "import_bundles",
           "LIFECYCLE"]

#: A node's lifecycle event kinds (ledger.md); ``spikeops.lifecycle.record`` reads them.
LIFECYCLE = ("drain", "reboot", "validate", "release", "force-release", "replace")


def _ledger(config_path: str | None) -> Any:
    from spikeops.config import load_config
    from spikeops.ledger.store import Ledger

    return Ledger(load_config(config_path).ledger_url)


def since_stamp(text: str | None, now: datetime | None = None) -> str | None:
    """``30d``/``12h``/``90m`` ago, or an ISO date or time, as a ledger time; None for all."""
    from spikeops.config import parse_duration
    from spikeops.ledger.store import stamp
    from spikeops.timeparse import parse_any

    if not text or text.strip().lower() == "all":
        return None
    try:
        return stamp((now or datetime.now(UTC)) - timedelta(seconds=parse_duration(text)))
    except ValueError:
        moment = parse_any(text.strip())
        if moment is None and len(text.strip()) == 10:
            moment = parse_any(text.strip() + "T00:00:00Z")
        if moment is None:
            raise InputError(f"--since {text!r}: a duration (30d, 12h, 90m) or an ISO date") from None
        return stamp(moment)


def _console(out: TextIO) -> Any:
    from rich.console import Console

    return Console(file=out, highlight=False, soft_wrap=False, width=None if out.isatty() else 160)


def _hours(value: Any) -> str:
    return "—" if value is None else f"{value:,.1f}"


def _duration(seconds: Any) -> str:
    if seconds is None:
        return "—"
    seconds = float(seconds)
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.1f} min"


def _views(ledger: Any, since: str | None, cluster: str | None) -> list[dict[str, Any]]:
    from spikeops.ledger.summary import views

    rows = ledger.incidents(since=since, cluster=cluster)
    lineages = {(r["cluster"], r["lineage"]) for r in rows}
    every = [row for c, lineage in lineages for row in ledger.lineage_incidents(c, lineage)]
    return views(rows, lineage_rows=every)


def _cmd_list(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from rich.table import Table

    with _ledger(args.config) as ledger:
        items = _views(ledger, since_stamp(args.since), args.cluster)
    if args.json:
        out.write(json.dumps(items, indent=2) + "\n")
        return 0
    if not items:
        out.write("no incident in the ledger" + (f" since {args.since}" if args.since else "") + "\n")
        return 0
    table = Table(title=f"incidents ({len(items)})", title_justify="left")
    for name in ("opened", "incident", "cluster", "job", "lineage", "cause", "culprits", "resumed", "GPU-h lost",
                 "state"):
        table.add_column(name, overflow="fold")
    from spikeops.inventory import fold_nodes

    for view in items:
        resumed = f"{view['resumed_as']} from {(view.get('resumed_from') or {}).get('step')}" if view.get("resumed_as") \
            else "—"
        state = "waiting for a person" if view["held_for_person"] else ("recurrence of " + view["recurrence_of"]
                                                                         if view.get("recurrence_of") else "")
        table.add_row(str(view["opened"]), str(view["incident_id"]), str(view["cluster"]), str(view["job_id"]),
                      str(view["lineage"]), str(view["cause"]), fold_nodes(view["culprit_nodes"]) or "—", resumed,
                      _hours(view["lost"]["gpu_hours"]), state)
    _console(out).print(table)
    return 0


def _cmd_show(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.ledger.summary import views

    with _ledger(args.config) as ledger:
        row = ledger.incident(args.incident)
        if row is None:
            raise InputError(f"no incident {args.incident!r} in the ledger {ledger.display_url}")
        lineage = ledger.lineage_incidents(row["cluster"], row["lineage"])
    view = views([row], lineage_rows=lineage)[0]
    view["lineage_incidents"] = [r["incident_id"] for r in lineage]
    if args.json:
        out.write(json.dumps(view, indent=2) + "\n")
        return 0
    console = _console(out)
    lost = view["lost"]
    lines = [f"incident {view['incident_id']} ({view['cluster']}): {view['cause']} ({view['symptom']} at step "
             f"{view['spike_step']})",
             f"job {view['job_id']}, lineage {view['lineage']} ({len(lineage)} incident(s): "
             f"{', '.join(view['lineage_incidents'])})",
             f"culprits: {', '.join(view['culprit_nodes']) or 'none'}; recurrence of: {view['recurrence_of'] or '—'}",
             "resumed: " + (f"as {view['resumed_as']} from {(view['resumed_from'] or {}).get('path')}"
                            if view["resumed_as"] else ("no: waiting for a person" if view["held_for_person"] else "no")),
             f"cost: {_hours(lost['gpu_hours'])} GPU-hours ({lost['gpus'] or '?'} GPUs; "
             f"{lost['steps_rolled_back'] if lost['steps_rolled_back'] is not None else '—'} steps rolled back at "
             f"{lost['step_seconds'] or '?'} s/step; {_duration(lost['downtime_s'])} down"
             + (", still counting" if lost["still_down"] else "") + ")",
             "times: " + "; ".join(f"{k.replace('_', ' ')} {v or '—'}" for k, v in view["times"].items()),
             f"outcome: {view['outcome'] or '—'}", f"bundle: {view['bundle'] or '—'}"]
    for line in lines:
        console.print(line)
    return 0


def _cmd_report(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from rich.table import Table

    from spikeops.ledger.summary import summarize

    with _ledger(args.config) as ledger:
        items = _views(ledger, since_stamp(args.since), args.cluster)
    report = summarize(items)
    report["since"] = args.since
    report["cluster"] = args.cluster
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
        return 0
    console = _console(out)
    total = report["total"]
    window = f" since {args.since}" if args.since and args.since.lower() != "all" else ""
    console.print(f"{total['incidents']} incident(s){window}"
                  f"{' on ' + args.cluster if args.cluster else ''}: {_hours(total['gpu_hours'])} GPU-hours lost, "
                  f"MTTR {_duration(total['mttr_s'])} (alert to the resumed job running), {total['resumed']} resumed, "
                  f"{total['recurrences']} recurrence(s), {total['held_for_person']} waiting for a person")
    for title, key, label in (("by cause", "by_cause", "cause"), ("by cluster", "by_cluster", "cluster")):
        table = Table(title=title, title_justify="left")
        for name in (label, "incidents", "GPU-h lost", "MTTR", "resumed", "recurrences", "waiting"):
            table.add_column(name)
        for row in report[key]:
            table.add_row(str(row[label]), str(row["incidents"]), _hours(row["gpu_hours"]), _duration(row["mttr_s"]),
                          str(row["resumed"]), str(row["recurrences"]), str(row["held_for_person"]))
        console.print(table)
    table = Table(title="repeat lineages", title_justify="left")
    for name in ("cluster", "lineage", "incidents", "jobs", "causes", "GPU-h lost", "now"):
        table.add_column(name, overflow="fold")
    for row in report["repeat_lineages"]:
        table.add_row(row["cluster"], row["lineage"], str(row["incidents"]), ", ".join(row["jobs"]),
                      ", ".join(row["causes"]), _hours(row["gpu_hours"]),
                      "waiting for a person" if row["held_for_person"] else "")
    console.print(table if report["repeat_lineages"] else "no repeat lineage")
    return 0


def node_history(events: list[dict[str, Any]], node: str) -> dict[str, Any]:
    """ledger.md's ``nodes history`` object from a node's events (one cluster), oldest first.
    A conviction someone later doubted carries ``in_doubt``; each conviction its ``evidence``
    and each event its ``incident`` (extensions: docs/ledger.md)."""
    from spikeops.lifecycle.record import NodeRecord

    clusters = sorted({e["cluster"] for e in events})
    if len(clusters) > 1:
        raise InputError(f"node {node} is known on clusters {', '.join(clusters)}: name one (--cluster)")
    record = NodeRecord.from_rows(node, clusters[0] if clusters else None, events)
    doubts = [e for e in events if e["kind"] == "doubt"]
    convictions = []
    for event in events:
        if event["kind"] != "convict":
            continue
        entry = {"incident_id": event["incident_id"], "cause": event["cause"], "time": event["time"]}
        if event.get("evidence"):
            entry["evidence"] = event["evidence"]
        doubted = [d for d in doubts if d["detail"] and str(event["incident_id"]) in d["detail"]]
        if doubted:
            entry["in_doubt"] = [{"incident_id": d["incident_id"], "time": d["time"], "why": d["detail"]}
                                 for d in doubted]
        convictions.append(entry)
    from datetime import UTC, datetime

    return {"node": node, "cluster": record.cluster, "state": record.state(datetime.now(UTC)),
            "convictions": convictions,
            "events": [{"time": e.time, "kind": e.kind, "result": e.result, "by": e.by, "detail": e.detail,
                        "incident": e.incident} for e in record.lifecycle()]}


def run_nodes_history(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``spikeops nodes history NODE``."""
    with _ledger(args.config) as ledger:
        events = ledger.node_events(args.node, args.cluster)
    record = node_history(events, args.node)
    if args.json:
        out.write(json.dumps(record, indent=2) + "\n")
        return 0
    if not events:
        out.write(f"{args.node}: nothing in the ledger\n")
        return 0
    console = _console(out)
    console.print(f"{record['node']} ({record['cluster']}): {record['state'] or 'no lifecycle event'}; "
                  f"{len(record['convictions'])} conviction(s)")
    for conviction in record["convictions"]:
        doubt = "; IN DOUBT: " + "; ".join(d["why"] for d in conviction["in_doubt"]) if conviction.get("in_doubt") \
            else ""
        console.print(f"  convicted {conviction['time']} in {conviction['incident_id']} ({conviction['cause']}){doubt}")
    for event in record["events"]:
        console.print(f"  {event['time']} {event['kind']}: {event['result']} by {event['by']} ({event['detail']})")
    return 0


def _bundles(root: Path) -> list[tuple[str, Path]]:
    from spikeops.ledger.entry import read_json

    found = [root] if (root / "incident.json").is_file() else [p.parent for p in root.glob("*/incident.json")]
    dated = []
    for path in found:
        doc = read_json(path / "incident.json")
        dated.append((str((doc or {}).get("created") or "") if isinstance(doc, dict) else "", path))
    return sorted(dated)


def import_bundles(ledger: Any, root: str | Path, *, cluster: str | None = None,
                   say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Rebuild the ledger from the bundles under ``root`` (oldest first) and its spool; each
    bundle that cannot be read is reported and skipped."""
    from spikeops.ledger.entry import LEDGER_FILE, entry_from_bundle, read_json
    from spikeops.ledger.spool import replay

    base = Path(root).expanduser()
    if not base.is_dir():
        raise InputError(f"{base}: no such directory")
    result: dict[str, Any] = {"imported": [], "new": 0, "skipped": [], "spool": []}

    def lineage_of(c: str, job: str) -> str | None:
        row = ledger.job(c, job)
        return row["lineage"] if row else None

    bundles = _bundles(base)
    for index, (_, path) in enumerate(bundles, 1):
        kept = read_json(path / LEDGER_FILE)
        context = dict((kept or {}).get("context") or {}) if isinstance(kept, dict) else {}
        if cluster and not context.get("cluster"):
            context["cluster"] = cluster
        try:
            entry = entry_from_bundle(path, context, lineage_of=lineage_of)
            new = ledger.apply(entry)
        except SpikeopsError as exc:
            result["skipped"].append(f"{path.name}: {exc}")
            if say:
                say(f"[{index}/{len(bundles)}] {path.name}: skipped ({exc})")
            continue
        result["imported"].append(entry["incident"]["incident_id"])
        result["new"] += int(new)
        if say:
            incident = entry["incident"]
            say(f"[{index}/{len(bundles)}] {incident['incident_id']}: job {incident['job_id']} of lineage "
                f"{incident['lineage']}, {incident.get('cause')}" + ("" if new else " (already known)"))
    result["spool"] = replay(ledger, base).written
    return result


def _cmd_import(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    with _ledger(args.config) as ledger:
        say = None if args.json else (lambda line: (out.write(line + "\n"), out.flush()))
        result = import_bundles(ledger, args.dir, cluster=args.cluster, say=say)
        result["ledger"] = ledger.display_url
    if args.json:
        out.write(json.dumps(result, indent=2) + "\n")
    else:
        out.write(f"{len(result['imported'])} incident(s) imported into {result['ledger']} ({result['new']} new, "
                  f"{len(result['skipped'])} bundle(s) skipped, {len(result['spool'])} spooled entr(ies) written)\n")
    for line in result["skipped"]:
        err.write(f"spikeops ledger import: skipped {line}\n")
    return 0 if not result["skipped"] else 1


def _cmd_replay(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.config import load_config
    from spikeops.ledger.spool import pending, replay

    folder = args.dir or load_config(args.config).incidents_dir
    with _ledger(args.config) as ledger:
        waiting = len(pending(folder))
        done = replay(ledger, folder)
    out.write(f"{len(done.written)} of {waiting} spooled entr(ies) written to the ledger\n")
    for line in done.failed:
        err.write(f"spikeops ledger replay: {line}\n")
    return 0 if not done.failed else 1


def _cmd_info(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    with _ledger(args.config) as ledger:
        info = {"url": ledger.display_url, "revision": ledger.revision(), "rows": ledger.counts()}
    if args.json:
        out.write(json.dumps(info, indent=2) + "\n")
    else:
        out.write(f"ledger {info['url']}: schema {info['revision']}; "
                  + ", ".join(f"{v} {k}" for k, v in info["rows"].items()) + "\n")
    return 0


def add_parsers(commands: Any) -> None:
    """``incidents`` and ``ledger`` on the CLI's subparsers."""
    add_incidents_parser(commands)
    add_ledger_parser(commands)


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="spikeops.toml (default $SPIKEOPS_CONFIG or ./spikeops.toml): [ledger] url")
    common.add_argument("--json", action="store_true", help="print JSON (shared/spec/ledger.md's shapes)")
    return common


def add_incidents_parser(commands: Any) -> None:
    """``spikeops incidents list|show|report``."""
    common = _common()
    window = argparse.ArgumentParser(add_help=False)
    window.add_argument("--since", default="30d", help="incidents opened in the last 30d (default), 12h, 90m, "
                        "or since an ISO date; 'all' for every one")
    window.add_argument("--cluster", help="one cluster only")
    incidents = commands.add_parser(
        "incidents", help="the incidents in the ledger: list, show one, report their cost",
        description="Incidents across runs, from the ledger (docs/ledger.md): each one's cause, lineage, resume "
        "and cost in GPU-hours (the compute rolled back plus the downtime from the spike to the resumed job "
        "running), and a report per cause and cluster with MTTR and the repeat lineages.")
    actions = incidents.add_subparsers(dest="action", metavar="ACTION", required=True)
    listed = actions.add_parser("list", parents=[common, window], help="the incidents, newest first")
    listed.set_defaults(handler=_cmd_list)
    shown = actions.add_parser("show", parents=[common], help="one incident, with its lineage and cost")
    shown.add_argument("incident", metavar="INCIDENT_ID")
    shown.set_defaults(handler=_cmd_show)
    report = actions.add_parser("report", parents=[common, window],
                                help="per-cause counts, MTTR, GPU-hours lost, repeat lineages")
    report.set_defaults(handler=_cmd_report)


def add_ledger_parser(commands: Any) -> None:
    """``spikeops ledger import|replay|upgrade|info``."""
    common = _common()
    ledger = commands.add_parser(
        "ledger", help="the ledger itself: import bundles, write spooled entries, migrate, show which",
        description="The ledger is the index across incidents (each bundle stays the record of its own): "
        "[ledger] url in spikeops.toml, else $SPIKEOPS_LEDGER_URL, else SQLite under $XDG_STATE_HOME/spikeops. "
        "Its URL is printed with the password masked.")
    ledger_actions = ledger.add_subparsers(dest="action", metavar="ACTION", required=True)
    imported = ledger_actions.add_parser("import", parents=[common], help="rebuild the ledger from bundles",
                                         description="Read every bundle under DIR (DIR/INCIDENT/incident.json, or "
                                         "DIR itself), oldest first, and write its entry; entries already there "
                                         "are updated, never doubled. Exit 1 when a bundle had to be skipped.")
    imported.add_argument("dir", metavar="DIR", type=Path, help="the incidents directory (or one bundle)")
    imported.add_argument("--cluster", help="the cluster of bundles that do not say (default: 'default')")
    imported.set_defaults(handler=_cmd_import)
    replayed = ledger_actions.add_parser("replay", parents=[common], help="write the entries spooled while the "
                                         "ledger could not be reached")
    replayed.add_argument("--dir", help="the incidents directory (default: [incidents] dir)")
    replayed.set_defaults(handler=_cmd_replay)
    for name, text in (("upgrade", "migrate the ledger's schema to this version's (done on every use too)"),
                       ("info", "which ledger (URL masked), its schema revision and rows")):
        action = ledger_actions.add_parser(name, parents=[common], help=text, description=text)
        action.set_defaults(handler=_cmd_info)


def add_history_parser(node_actions: Any, common: argparse.ArgumentParser | None = None) -> None:
    """``nodes history NODE`` under the CLI's ``nodes`` command."""
    history = node_actions.add_parser("history", help="a node's convictions, drains and lifecycle, from the ledger",
                                      description="The node's record in the ledger (shared/spec/ledger.md): its "
                                      "state, the incidents that convicted it (and any doubt cast on them later), "
                                      "and its lifecycle events.")
    history.add_argument("node", metavar="NODE")
    history.add_argument("--cluster", help="the cluster, when the name is known on several")
    history.add_argument("--config", help="spikeops.toml (default $SPIKEOPS_CONFIG or ./spikeops.toml): [ledger] url")
    history.add_argument("--json", action="store_true", help="print ledger.md's JSON object")
    history.set_defaults(handler=run_nodes_history)

"""The ``spikeops`` command line.

Every failure a user can cause (a missing file, binary data, an unknown kind, a broken
bundle) ends in one line on stderr and exit status 2; a bug in spikeops ends in one line
and status 70, with the traceback only when ``SPIKEOPS_DEBUG=1``. Nobody debugging a loss
spike at 3 a.m. should have to read a Python traceback from their incident tool.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from spikeops import __version__
from spikeops.errors import InputError, SpikeopsError
from spikeops.jsonable import to_jsonable
from spikeops.probes.base import clip
from spikeops.textio import ReadReport

__all__ = ["main", "build_parser"]

EXIT_OK = 0
#: ``collect`` reached no node at all (the bundle still records why, node by node).
EXIT_NOTHING = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 70


def _progress_printer(stream: TextIO):
    """A progress line for long reads, only on an interactive terminal."""
    if not stream.isatty():
        return None

    def show(report: ReadReport) -> None:
        if report.size and not report.compressed:
            share = min(100.0, 100.0 * report.bytes_read / report.size)
            stream.write(f"\r  reading {report.path}: {share:5.1f}% ({report.lines:,} lines)")
        else:
            stream.write(f"\r  reading {report.path}: {report.lines:,} lines")
        stream.flush()

    return show


def _print_reading(reading: Any, out: TextIO) -> None:
    how = f"detected, confidence {reading.confidence:.2f}" if reading.detected else "as requested"
    command = f" (`{clip(reading.kind.command, 60)}`)" if reading.kind.command else ""
    out.write(f"{reading.path}: {reading.kind.name}{command} [{how}]\n")
    try:
        summary = reading.kind.summarize(reading.result)
    except Exception as exc:  # a summary bug must not hide the parse
        summary = [f"(summary unavailable: {exc})"]
    for line in summary:
        out.write(f"  {line}\n")
    if reading.gaps:
        out.write(f"  not read ({len(reading.gaps)}):\n")
        for gap in reading.gaps[:20]:
            where = f"line {gap.line}: " if gap.line else ""
            out.write(f"    - {where}{gap.reason}\n")
        if len(reading.gaps) > 20:
            out.write(f"    - ... and {len(reading.gaps) - 20} more (see --json)\n")


def _reading_json(reading: Any) -> dict[str, Any]:
    return {
        "path": reading.path,
        "kind": reading.kind.name,
        "command": reading.kind.command,
        "detected": reading.detected,
        "confidence": reading.confidence,
        "result": to_jsonable(reading.result),
        "gaps": [{"line": gap.line, "reason": gap.reason} for gap in reading.gaps],
        "read": {
            "lines": reading.report.lines,
            "bytes": reading.report.bytes_read,
            "compressed": reading.report.compressed,
        },
    }


def _cmd_parse(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.probes import kind_names, registry

    if args.list_kinds:
        kinds = {kind.name: kind for kind in registry().values()}
        for name in sorted(kinds):
            kind = kinds[name]
            out.write(f"{name:22} {kind.description}\n")
        return EXIT_OK
    if not args.file:
        err.write("spikeops parse: a FILE is required (or --list-kinds)\n")
        return EXIT_USAGE
    target = Path(args.file)
    if target.is_dir() and (target / "incident.json").exists() and args.kind is None:
        from spikeops.bundle_view import describe_bundle, print_bundle

        description = describe_bundle(target)
        if args.json:
            out.write(json.dumps(to_jsonable(description), indent=2, allow_nan=True) + "\n")
        else:
            print_bundle(description, out)
        return EXIT_OK
    from spikeops.reading import read_evidence

    if args.kind is not None and args.kind not in kind_names():
        err.write(f"spikeops parse: unknown kind {args.kind!r}; known: {', '.join(kind_names())}\n")
        return EXIT_USAGE
    progress = None if args.json else _progress_printer(err)
    reading = read_evidence(target, args.kind, progress=progress)
    if progress is not None and reading.report.lines >= 200_000:
        err.write("\n")
    if args.json:
        out.write(json.dumps(_reading_json(reading), indent=2, ensure_ascii=False, allow_nan=True) + "\n")
    else:
        _print_reading(reading, out)
    return EXIT_OK


def _cmd_diagnose(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.bundle import atomic_write
    from spikeops.diagnosis import diagnose
    from spikeops.diagnosis.report import render

    diagnosis = diagnose(args.bundle, workers=args.workers)
    document = diagnosis.to_json()
    text = json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False, default=str) + "\n"
    target = Path(args.bundle) / "diagnosis.json"
    if not args.no_write:
        try:
            atomic_write(target, text.encode())
        except OSError as exc:
            err.write(f"spikeops diagnose: could not write {target} ({exc.strerror or exc}); printing only\n")
    if args.json:
        out.write(text)
    else:
        render(diagnosis, out)
        if not args.no_write:
            out.write(f"\nwritten: {target}\n")
    return EXIT_OK


def _collect_progress(stream: TextIO):
    """A one-line progress counter on a terminal; nothing when piped or in CI logs."""
    if not stream.isatty():
        return None
    failed = 0

    def show(done: int, total: int, result: Any) -> None:
        nonlocal failed
        failed += result.outcome != "ok"
        stream.write(f"\r  collecting: {done}/{total} nodes ({failed} not ok)")
        if done == total:
            stream.write("\n")
        stream.flush()

    return show


def _cmd_collect(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.collect import collect
    from spikeops.inventory import expand_nodes, load_inventory

    inventory = load_inventory(args.inventory)
    nodes = expand_nodes(args.nodes) if args.nodes else None
    result = collect(inventory, args.job, args.out, nodes=nodes, baseline=args.baseline, replace=args.replace,
                     fanout=args.fanout, progress=None if args.json else _collect_progress(err))
    if args.json:
        out.write(json.dumps(result.to_json(), indent=2) + "\n")
    else:
        for line in result.summary_lines():
            out.write(line + "\n")
    return EXIT_OK if result.buckets()["ok"] or any(r.probes for r in result.nodes) else EXIT_NOTHING


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


EXIT_REFUSED = 1


def _scheduler(args: argparse.Namespace):
    from pathlib import Path as _Path

    from spikeops.schedulers import SlurmConfig, open_scheduler
    from spikeops.schedulers.base import default_log_path

    log = _Path(args.bundle) / "actions.jsonl" if args.bundle else default_log_path()
    config = SlurmConfig(signal_grace=getattr(args, "grace", None) or 30.0,
                         resume_env=getattr(args, "env_var", None) or "SPIKEOPS_RESUME_FROM",
                         timeout=args.timeout)
    return open_scheduler(args.scheduler, log_path=log, dry_run=args.dry_run, incident=args.incident,
                          state_dir=args.state_dir, config=config)


def _report_actions(results: list[Any], out: TextIO, as_json: bool) -> int:
    if as_json:
        out.write(json.dumps([r.to_json() for r in results], indent=2) + "\n")
    else:
        for result in results:
            out.write(result.line() + "\n")
            if result.outcome == "dry-run":
                for command in result.commands:
                    if not command.ran:
                        out.write("  would run: " + shlex.join(command.argv) + "\n")
    if any(r.outcome == "failed" for r in results):
        return EXIT_USAGE
    return EXIT_REFUSED if any(r.outcome == "refused" for r in results) else EXIT_OK


def _cmd_nodes(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.inventory import expand_nodes

    if args.action == "history":  # the ledger's record, not the scheduler's
        from spikeops.ledger.cli import run_nodes_history

        return run_nodes_history(args, out, err)
    scheduler = _scheduler(args)
    if args.action == "list":
        drained = scheduler.drained()
        if args.json:
            out.write(json.dumps([{"node": n.name, "state": n.state, "reason": n.reason,
                                   "incident": next((w for w in (n.reason or "").split() if w.startswith("inc-")), None)}
                                  for n in drained], indent=2) + "\n")
        elif not drained:
            out.write("no node is drained by spikeops\n")
        else:
            for node in drained:
                out.write(f"{node.name:20} {node.state:16} {node.reason}\n")
        return EXIT_OK
    names = expand_nodes(args.nodes)
    if args.action == "drain":
        results = scheduler.drain(names, args.reason, args.incident)
    else:
        results = scheduler.release(names)
    return _report_actions(results, out, args.json)


def _cmd_job(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.collect.plan import check_job_id
    from spikeops.inventory import expand_nodes

    check_job_id(args.job)
    scheduler = _scheduler(args)
    if args.action == "stop":
        result = scheduler.stop(args.job, signal=args.signal, mode=args.mode, grace=args.grace)
    elif args.action == "preserve":
        if not args.bundle:
            err.write("spikeops job preserve: --bundle DIR is required (where the job's record goes)\n")
            return EXIT_USAGE
        result = scheduler.preserve(args.job, args.bundle, checkpoint=args.keep)
    else:
        exclude = expand_nodes(args.exclude) if args.exclude else []
        env = {}
        for pair in args.set_env or ():
            name, sep, value = pair.partition("=")
            if not sep:
                raise InputError(f"--set-env {pair!r}: expected NAME=VALUE")
            env[name] = value
        result = scheduler.resume(args.job, args.checkpoint or "", exclude=exclude, requeue=args.requeue,
                                  script=args.script, env=env)
    return _report_actions([result], out, args.json)


def _cmd_notify(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.bundle import open_bundle
    from spikeops.notify import SlackNotifier, notify_bundle

    open_bundle(args.bundle)  # a one-line error for what is not a bundle
    links = {key: value for key, value in (("flow_run", args.flow_run_url), ("approval", args.approval_url)) if value}
    notifier = SlackNotifier(args.bundle, channel=args.channel)
    result = notify_bundle(args.bundle, channel=args.channel, links=links or None, notifier=notifier)
    where = "posted to Slack" if notifier.online else "no SLACK_BOT_TOKEN: written to the bundle's outbox.jsonl"
    out.write(f"{args.bundle}: {where}\n")
    for delivery in result.deliveries:
        state = "skipped (already posted)" if delivery.skipped else "ok" if delivery.posted else delivery.error
        out.write(f"  {delivery.key}: {state}\n")
    out.write(f"  report: {result.report} ({result.html.name})\n")
    if notifier.online and not result.delivered:
        err.write("spikeops notify: some messages were not delivered (kept in outbox.jsonl)\n")
        return EXIT_NOTHING
    return EXIT_OK


def _cmd_config_check(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.config import check_config, load_config

    config = load_config(args.config)
    if config.path is None:
        err.write("spikeops config check: no spikeops.toml here (--config FILE or $SPIKEOPS_CONFIG)\n")
        return EXIT_USAGE
    problems = check_config(config) + ([] if config.clusters else ["no [clusters.NAME] configured"])
    for problem in problems:
        err.write(f"spikeops config check: {config.path}: {problem}\n")
    if problems:
        return EXIT_USAGE
    out.write(f"{config.path}: ok ({len(config.clusters)} cluster(s): {', '.join(config.clusters)}; "
              f"incidents in {config.incidents_dir}, at most {config.max_concurrent} at once; "
              f"receiver {config.receiver_addr})\n")
    return EXIT_OK


def _cmd_serve(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.config import check_config, load_config

    config = load_config(args.config)
    if not config.clusters:
        err.write("spikeops serve: no [clusters.NAME] configured (spikeops.toml or --config; docs/flow.md)\n")
        return EXIT_USAGE
    # The receiver alone never touches a cluster: the inventories live with the workers.
    problems = [] if args.receiver_only else check_config(config)
    if problems:  # refuse now: the first alert would otherwise fail
        err.write(f"spikeops serve: {config.path}: {problems[0]}"
                  + (f" (and {len(problems) - 1} more: spikeops config check)" if len(problems) > 1 else "") + "\n")
        return EXIT_USAGE
    # The Prefect side lives outside the core (deployments/), imported only for this command.
    from spikeops.deployments.local_server import prefect_api
    from spikeops.deployments.serve import serve, serve_receiver

    def say(line: str) -> None:
        out.write(f"spikeops serve: {line}\n")
        out.flush()

    addr = args.addr or config.receiver_addr
    try:
        with prefect_api(config.prefect_home, config.prefect_port, say=say) as api:
            if args.receiver_only:
                out.write(f"serving the alert receiver on http://{addr}/alerts/...: each alert starts "
                          f"incident-response/CLUSTER on its cluster's work pool (clusters: "
                          f"{', '.join(config.clusters)}; Prefect API {api})\n")
            else:
                out.write(f"serving the incident flow and the alert receiver on http://{addr}/alerts/... "
                          f"(clusters: {', '.join(config.clusters)}; Prefect API {api})\n")
            out.flush()
            if args.receiver_only:
                serve_receiver(config, addr)
            else:
                serve(config, addr, warm_start=not args.cold_start)
    except ValueError as exc:
        err.write(f"spikeops serve: {exc}\n")
        return EXIT_USAGE
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.demo import SCENARIOS, DemoOptions, run_demo, stop_demo

    if args.list:
        for name, what in SCENARIOS.items():
            out.write(f"{name:<24} {what}\n")
        return EXIT_OK
    if args.stop:
        out.write("stopped: " + ", ".join(stop_demo(args.stop)) + "\n")
        return EXIT_OK
    if args.scenario not in SCENARIOS:
        raise InputError(f"unknown scenario {args.scenario!r}; `spikeops demo --list` shows them")
    if not 2 <= args.nodes <= 64:
        raise InputError("--nodes: between 2 and 64")
    try:
        run_demo(DemoOptions(scenario=args.scenario, nodes=args.nodes, seed=args.seed, keep=args.keep,
                             directory=args.dir, scheduler=args.scheduler, monitoring=args.monitoring), out)
    except SpikeopsError:
        raise
    except Exception as exc:  # a daemon that would not start, a flow that failed: one line, what was built stays
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        err.write(f"spikeops demo: failed: {type(exc).__name__}: {first} (files kept in the demo directory)\n")
        return 1
    return EXIT_OK


def _cmd_node_report(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.probes.nvml import collect as read_nvml

    document = read_nvml(xid_wait=args.xid_wait)
    out.write(json.dumps(document, indent=2, allow_nan=False, default=str) + "\n")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spikeops",
        description=(
            "Incident pipeline for loss spikes and NaNs in large GPU training runs: reads the "
            "evidence real tools print on real nodes, diagnoses it layer by layer (data, numeric, "
            "communication, hardware), and acts on the scheduler."
        ),
        epilog="Exit status: 0 success, 2 bad input (one-line reason on stderr), 70 internal error.",
    )
    parser.add_argument("--version", action="version", version=f"spikeops {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    parse = commands.add_parser(
        "parse",
        help="show what spikeops reads in a tool-output file, a captured sysfs tree, or a bundle",
        description=(
            "Read FILE the way the diagnosis will, and show what was read: the detected kind of "
            "tool output (nvidia-smi, kernel log with Xid events, ethtool -S, InfiniBand, NCCL, "
            "training logs, DCGM, Slurm, bundle files), a summary of its values, and every part "
            "that could not be read. FILE may be gzip-compressed. A directory is read as a "
            "captured /sys/class/infiniband tree, or as an incident bundle (incident.json inside)."
        ),
        epilog=(
            "Examples:\n"
            "  spikeops parse nodes/gpu-003/kernel.log\n"
            "  spikeops parse --kind ethtool ethtool-ib0.txt --json | jq .result.counters\n"
            "  spikeops parse examples/bundle-xid79\n"
            "Exit status: 0 read (possibly with gaps), 2 unreadable or unrecognised input."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parse.add_argument("file", nargs="?", metavar="FILE", help="file, sysfs tree or bundle directory")
    parse.add_argument("--kind", help="parse as this kind instead of detecting it (see --list-kinds)")
    parse.add_argument("--json", action="store_true", help="print the full parse as JSON on stdout")
    parse.add_argument("--list-kinds", action="store_true", help="list the kinds of evidence spikeops reads")
    parse.set_defaults(handler=_cmd_parse)

    diag = commands.add_parser(
        "diagnose",
        help="name the cause of a loss spike or NaN from an incident bundle",
        description=(
            "Diagnose an incident bundle (shared/spec/bundle.md) with the four-layer framework: "
            "data, numeric, communication, hardware, then checkpoint integrity. Classifies the "
            "symptom from the step metrics, finds the spike and onset steps, names the primary "
            "cause with the evidence lines it rests on, the culprit nodes (the ones to isolate) "
            "and ranks, what was ruled out and what evidence was missing, the actions, and the "
            "newest verified checkpoint before the onset. Writes BUNDLE/diagnosis.json."
        ),
        epilog=(
            "Examples:\n"
            "  spikeops diagnose /incidents/inc-20261129T180312Z-4412\n"
            "  spikeops diagnose BUNDLE --json | jq .culprit_nodes\n"
            "Output format: shared/spec/diagnosis.md (format spikeops-diagnosis/1); action kinds in docs/diagnosis.md.\n"
            "Exit status: 0 a diagnosis was made (false_alarm included), 2 the bundle cannot be read."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diag.add_argument("bundle", metavar="BUNDLE", help="incident bundle directory (with incident.json)")
    diag.add_argument("--json", action="store_true", help="print only the diagnosis JSON on stdout")
    diag.add_argument("--no-write", action="store_true", help="do not write BUNDLE/diagnosis.json")
    diag.add_argument("--workers", type=int, default=None,
                      help="processes parsing node evidence (default: CPUs for 24+ nodes, else 1)")
    diag.set_defaults(handler=_cmd_diagnose)

    coll = commands.add_parser(
        "collect",
        help="collect a job's evidence from every node over SSH into an incident bundle",
        description=(
            "Fan out over SSH to the job's nodes (one connection per node, at most [ssh] fanout at "
            "once) and run the bundle spec's probes on each: nvidia-smi -q, the kernel log with "
            "wall-clock times, ethtool -S for each interface, ibstat, the InfiniBand sysfs "
            "counters, the job's NCCL and training log lines, and nvml.json where spikeops is "
            "installed on the node. Host keys are checked strictly against known_hosts. Every "
            "probe has a timeout and an output cap; a node that is down, silent, refuses the key "
            "or hangs is recorded in its probes.json and in the summary, never fatal. Writes "
            "OUT/nodes/NODE/ (OUT/nodes/NODE/baseline/ with --baseline), and OUT/incident.json "
            "when OUT has none."
        ),
        epilog=(
            "The inventory (TOML: nodes, [ssh] user/port/identity_file/known_hosts/jump_host/"
            "timeouts/fanout, [hosts], [job] log paths, [probes.NAME] overrides) is described in "
            "docs/inventory.md; ~/.ssh/config fills in what it leaves unset.\n"
            "Examples:\n"
            "  spikeops collect --inventory cluster.toml --job 4412 --out /incidents/inc-4412\n"
            "  spikeops collect --inventory cluster.toml --job 4412 --nodes 'gpu-[001-064]' --out B\n"
            "  spikeops collect --inventory cluster.toml --job 4412 --baseline --out /baselines/4412\n"
            "Exit status: 0 the bundle was written (failed nodes are recorded in it), 1 no node "
            "could be reached, 2 bad input (inventory, job id, nodes, OUT already holding evidence)."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    coll.add_argument("--inventory", "-i", required=True, metavar="FILE", help="cluster inventory (docs/inventory.md)")
    coll.add_argument("--job", "-j", required=True, metavar="JOB", help="job id (fills {job} in the [job] log paths)")
    coll.add_argument("--out", "-o", required=True, metavar="DIR", help="bundle directory to write into")
    coll.add_argument("--nodes", "-w", metavar="NODESET",
                      help="the job's nodes, as a node set (default: every node of the inventory)")
    coll.add_argument("--baseline", action="store_true", help="write into nodes/*/baseline/ (a healthy reference)")
    coll.add_argument("--replace", action="store_true", help="replace evidence already collected into DIR")
    coll.add_argument("--fanout", type=int, default=None, help="connections at once (default: [ssh] fanout)")
    coll.add_argument("--json", action="store_true", help="print the per-node results as JSON")
    coll.set_defaults(handler=_cmd_collect)

    report = commands.add_parser(
        "node-report",
        help="print this node's NVML reading as nvml.json (run on a GPU node by the collector)",
        description=(
            "Read every GPU on this node through NVML (nvidia-ml-py): ECC counters, remapped rows, "
            "retired pages, clock event reasons, temperatures, power, and the Xid events NVML "
            "delivers while listening. Prints the nvml.json document (format spikeops-nvml/1, "
            "docs/bundle.md). A node without a driver prints a document whose error says so."
        ),
    )
    report.add_argument("--xid-wait", type=float, default=0.0, metavar="SECONDS",
                        help="listen this long for Xid events (NVML keeps no history; default 0: do not listen)")
    report.set_defaults(handler=_cmd_node_report)

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

    notify = commands.add_parser(
        "notify",
        help="post a bundle's diagnosis to Slack (thread, plot, summary) and write its report",
        description=(
            "Post the diagnosis of BUNDLE to Slack as one thread: the opening message, the diagnosis "
            "(cause, findings with evidence, culprits, actions), the plot of the curves around the "
            "spike, and the summary edited into the opening message. Writes BUNDLE/report.md, "
            "report.html and plot.png. The token comes from SLACK_BOT_TOKEN (never printed); "
            "SPIKEOPS_SLACK_API_URL replaces Slack's API address. Without a token, the messages go "
            "to BUNDLE/outbox.jsonl. A re-run continues the same thread and posts nothing twice."
        ),
        epilog="Exit status: 0 posted (or written to the outbox), 1 Slack refused or failed (kept in the "
               "outbox), 2 not a bundle.",
    )
    notify.add_argument("bundle", metavar="BUNDLE")
    notify.add_argument("--channel", help="channel id or #name (default $SPIKEOPS_SLACK_CHANNEL or #incidents)")
    notify.add_argument("--flow-run-url", help="link for the 'Open the flow run' button")
    notify.add_argument("--approval-url", help="link for the 'Review and approve' button")
    notify.set_defaults(handler=_cmd_notify)

    served = commands.add_parser(
        "serve",
        help="serve the incident flow's deployment and the alert receiver",
        description=(
            "Serve the incident-response deployment (prefect serve) and the alert receiver "
            "(POST /alerts/alertmanager, /alerts/grafana, /alerts/generic) in one process. "
            "Alerts are mapped to flow parameters through spikeops.toml; each alert occurrence "
            "starts one flow run. Set SPIKEOPS_RECEIVER_TOKEN or SPIKEOPS_RECEIVER_HMAC_KEY to "
            "listen beyond loopback; PREFECT_API_URL names the Prefect server."
        ),
    )
    served.add_argument("--config", help="spikeops.toml (default $SPIKEOPS_CONFIG or ./spikeops.toml)")
    served.add_argument("--addr", help="receiver HOST:PORT (default [receiver] addr or 127.0.0.1:8787)")
    served.add_argument("--receiver-only", action="store_true",
                        help="the receiver alone, no flow runner here: each alert starts its cluster's deployment "
                             "incident-response/CLUSTER, run by that cluster's workers (infra/prefect/up; "
                             "docs/scaleout.md)")
    served.add_argument("--cold-start", action="store_true",
                        help="start each incident run in a new interpreter (Prefect's spawn) instead of forking it "
                             "from a process that imported the flow when serve started (3-4 s sooner; docs/flow.md)")
    served.set_defaults(handler=_cmd_serve)

    configured = commands.add_parser("config", help="check spikeops.toml",
                                     description="Check spikeops.toml: every key's type and range, each "
                                                 "cluster's inventory, what a scheduler needs. Exit 0 when it "
                                                 "is usable, 2 with one line per problem.")
    config_actions = configured.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    check = config_actions.add_parser("check", help="check the file; one line per problem")
    check.add_argument("--config", help="spikeops.toml (default $SPIKEOPS_CONFIG or ./spikeops.toml)")
    check.set_defaults(handler=_cmd_config_check)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--scheduler", choices=("slurm", "local"), default="slurm",
                        help="slurm (default; its commands on this machine, SLURM_CONF honoured) or local")
    common.add_argument("--state-dir", help="the local scheduler's state directory")
    common.add_argument("--dry-run", action="store_true", help="print exactly what would run; change nothing")
    common.add_argument("--bundle", metavar="DIR",
                        help="incident bundle: actions are appended to DIR/actions.jsonl "
                             "(default: ~/.local/state/spikeops/actions.jsonl)")
    common.add_argument("--incident", metavar="ID", help="incident id written into drain reasons and the log")
    common.add_argument("--timeout", type=float, default=30.0, help="seconds each scheduler command may take")
    common.add_argument("--json", action="store_true", help="print the results as JSON")
    safety = ("Safety: a node is drained only with a reason starting 'spikeops:', never over a reason "
              "someone else wrote, never from an unknown state; only nodes spikeops drained are released. "
              "Exit status: 0 done or nothing to do, 1 refused for safety (the reason is printed), "
              "2 bad input or a scheduler error.")
    from spikeops.baselines import add_baselines_parser
    from spikeops.watch.cli import add_parser as add_watch_parser

    from spikeops.ledger.cli import add_history_parser, add_parsers as add_ledger_parsers

    add_baselines_parser(commands)
    add_watch_parser(commands)
    add_ledger_parsers(commands)

    demo = commands.add_parser(
        "demo", help="the whole pipeline on one machine: a cluster, a diverging job, the flow",
        description="Start a local cluster (one real sshd per node on loopback; the real Slurm when installed, "
        "else local processes), a training job that diverges as the scenario says, the watcher, and the incident "
        "flow on an ephemeral Prefect server. Prints each stage, the diagnosis, what was done and where the "
        "bundle, report, plot and Slack outbox are; then stops everything.")
    demo.add_argument("--scenario", default="gpu_xid", metavar="NAME",
                      help="the incident to stage (default gpu_xid: an Xid 79 on one node); see --list")
    demo.add_argument("--nodes", type=int, default=8, help="nodes in the job (2-64, default 8)")
    demo.add_argument("--seed", type=int, default=None, help="scenario seed (default: a fixed one)")
    demo.add_argument("--dir", type=Path, default=None, help="where the demo's files go (default: a new temp dir)")
    demo.add_argument("--scheduler", choices=("auto", "slurm", "local"), default="auto",
                      help="auto (default): the real Slurm when its daemons are installed and we are root")
    demo.add_argument("--monitoring", choices=("watcher", "prometheus"), default="watcher",
                      help="what notices the anomaly: spikeops' watcher (default), or the real Prometheus and "
                      "Alertmanager (Debian's packages, when installed) with the shipped rules, through the receiver")
    demo.add_argument("--keep", action="store_true", help="leave the cluster and jobs running (stop: --stop DIR)")
    demo.add_argument("--list", action="store_true", help="list the scenarios and exit")
    demo.add_argument("--stop", type=Path, metavar="DIR", help="stop what a --keep demo left running in DIR")
    demo.set_defaults(handler=_cmd_demo)

    nodes = commands.add_parser("nodes", help="drain, release and list the nodes spikeops isolated",
                                description="Isolate nodes the way NHC does. " + safety)
    node_actions = nodes.add_subparsers(dest="action", metavar="ACTION", required=True)
    drain = node_actions.add_parser("drain", parents=[common], help="drain nodes with a spikeops reason",
                                    description="scontrol update NodeName=N State=DRAIN Reason='spikeops: TEXT ID'. "
                                    + safety)
    drain.add_argument("nodes", nargs="+", metavar="NODE", help="node names or node sets (gpu-[001-004])")
    drain.add_argument("--reason", required=True, help="why (the cause); 'spikeops:' and the incident are added")
    release = node_actions.add_parser("release", parents=[common], help="resume nodes spikeops drained",
                                      description="scontrol update NodeName=N State=RESUME, for nodes spikeops "
                                      "drained only. " + safety)
    release.add_argument("nodes", nargs="+", metavar="NODE", help="node names or node sets")
    node_actions.add_parser("list", parents=[common], help="the nodes spikeops has drained, with reasons")
    add_history_parser(node_actions)
    nodes.set_defaults(handler=_cmd_nodes)

    job = commands.add_parser("job", help="stop, preserve and resume a job",
                              description="Act on a job. Exit status: 0 done or nothing to do, 1 refused, "
                              "2 bad input or a scheduler error (unknown job, controller down).")
    job_actions = job.add_subparsers(dest="action", metavar="ACTION", required=True)
    stop = job_actions.add_parser("stop", parents=[common], help="signal (optional), then cancel/requeue/hold",
                                  description="Signal the batch script first when asked (scancel --signal=SIG "
                                  "--batch: plain --signal reaches only the steps), wait --grace seconds for it "
                                  "to save and exit, then cancel (default), requeue or hold it.")
    stop.add_argument("job", metavar="JOB")
    stop.add_argument("--signal", help="signal for the batch script first, e.g. USR1")
    stop.add_argument("--mode", choices=("cancel", "requeue", "hold"), default="cancel")
    stop.add_argument("--grace", type=float, default=30.0, help="seconds between the signal and the stop")
    keep = job_actions.add_parser("preserve", parents=[common], help="save the job record, batch script, node list",
                                  description="scontrol show job -d and scontrol write batch_script into "
                                  "BUNDLE/scheduler/, before anything changes them.")
    keep.add_argument("job", metavar="JOB")
    keep.add_argument("--keep", metavar="CHECKPOINT",
                      help="also keep this checkpoint from the job's retention (hard links in .spikeops-keep/)")
    resume = job_actions.add_parser("resume", parents=[common], help="resubmit from a checkpoint, excluding nodes",
                                    description="Resubmit the job's batch script (recorded, or from Slurm) with "
                                    "--exclude and the checkpoint in an environment variable, or requeue it. "
                                    "Idempotent: a second resume of the same incident submits nothing.")
    resume.add_argument("job", metavar="JOB")
    resume.add_argument("--from", dest="checkpoint", metavar="CHECKPOINT", help="checkpoint to resume from")
    resume.add_argument("--exclude", metavar="NODES", help="node set to keep the job off")
    resume.add_argument("--requeue", action="store_true", help="requeue the job itself (ExcNodeList) instead")
    resume.add_argument("--script", help="batch script to resubmit (default: the job's own, from Slurm)")
    resume.add_argument("--env-var", default="SPIKEOPS_RESUME_FROM",
                        help="environment variable that carries the checkpoint (default SPIKEOPS_RESUME_FROM)")
    resume.add_argument("--set-env", action="append", metavar="NAME=VALUE",
                        help="a remediation for the resumed job, e.g. SPIKEOPS_LR_SCALE=0.3 or NCCL_DEBUG=INFO "
                        "(repeatable; SPIKEOPS_* and NCCL debug variables only; docs/flow.md)")
    job.set_defaults(handler=_cmd_job)
    return parser


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(out)
        return EXIT_USAGE
    try:
        return int(args.handler(args, out, err))
    except SpikeopsError as exc:
        err.write(f"spikeops {args.command}: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.write("\nspikeops: interrupted\n")
        return 130
    except BrokenPipeError:
        # `spikeops parse big.log --json | head`: the reader left; that is not an error.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        except OSError:
            pass
        return EXIT_OK
    except Exception as exc:  # the last line of defence: never a traceback by default
        if os.environ.get("SPIKEOPS_DEBUG"):
            traceback.print_exc(file=err)
        err.write(
            f"spikeops {args.command}: internal error: {type(exc).__name__}: {exc} "
            "(set SPIKEOPS_DEBUG=1 for the traceback and report it)\n"
        )
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

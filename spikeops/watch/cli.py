"""``spikeops watch``: follow a job's metrics and start the incident flow on an anomaly.

``add_parser(commands)`` adds the subcommand to ``spikeops``' parser; ``run(args, out, err)``
runs it: one line on ``out`` per incident started, a one-line summary on ``err`` at the end,
exit 0; bad input (a missing file, a bad ``[watch]`` table, a refused alert) is one line on
``err`` and exit 2; an interrupt (Ctrl-C) ends the watch with its summary and exit 130.
"""

from __future__ import annotations

import argparse
import os
import urllib.parse
from typing import Any, TextIO

from spikeops.errors import InputError, SpikeopsError
from spikeops.watch.detect import PROMETHEUS_FIELDS, Detector, WatchConfig
from spikeops.watch.fire import Fire, describe, print_target, receiver_target, watch
from spikeops.watch.sources import SourceStats, open_source

__all__ = ["add_parser", "run", "RECEIVER_TOKEN_ENV"]

RECEIVER_TOKEN_ENV = "SPIKEOPS_RECEIVER_TOKEN"
EXIT_OK, EXIT_USAGE, EXIT_INTERRUPTED = 0, 2, 130


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "watch",
        help="follow a job's metrics and start the incident flow on a NaN, spike, collapse, slowdown or stall",
        description=(
            "Follow a job's metrics (a metrics.jsonl, a training log, or Prometheus queries) and "
            "start one incident per anomaly: a NaN, a loss or grad-norm spike (robust z-score), a "
            "loss-scale collapse, a sustained throughput drop, or a stall (no new step for "
            "stall_factor x the typical step time, at least stall_min_s). Debounced: a NaN that persists, a "
            "long spike, or several kinds at once make one incident. Thresholds: the [watch] table "
            "of spikeops.toml (docs/watch.md). Exit status: 0 done, 2 bad input, 130 interrupted."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--metrics", metavar="FILE", help="a metrics.jsonl the job appends to")
    source.add_argument("--log", metavar="FILE",
                        help="the job's log (Megatron, DeepSpeed, HF Trainer or generic step lines)")
    source.add_argument("--prometheus", metavar="URL", help="a Prometheus server (instant queries, polled)")
    parser.add_argument("--query", action="append", default=[], metavar="FIELD=PROMQL",
                        help=f"a Prometheus query for one field ({', '.join(PROMETHEUS_FIELDS)}); "
                             "repeatable; adds to [watch.prometheus]")
    parser.add_argument("--job", help="the job id (required to fire at the receiver or the deployment)")
    parser.add_argument("--cluster", help="the cluster name in spikeops.toml")
    parser.add_argument("--config", help="spikeops.toml (default $SPIKEOPS_CONFIG or ./spikeops.toml)")
    parser.add_argument("--fire", choices=("print", "receiver", "deployment"), default="print",
                        help="print: only print each incident (default); receiver: POST it to the alert "
                             f"receiver (Bearer ${RECEIVER_TOKEN_ENV}); deployment: start the incident flow "
                             "with run_deployment (PREFECT_API_URL)")
    parser.add_argument("--deployment", metavar="NAME", default="incident-response/incident-response",
                        help="with --fire deployment: the deployment to start (default that of spikeops serve; "
                             "'incident-response/{cluster}' for the work-pool layout, docs/scaleout.md)")
    parser.add_argument("--receiver", metavar="URL",
                        help="the receiver's URL (default http://[receiver] addr/alerts/generic)")
    parser.add_argument("--from-start", action="store_true",
                        help="judge what the file already holds too (default: only what is written from now)")
    parser.add_argument("--once", action="store_true",
                        help="read what is there now (from the start) and exit; one poll for Prometheus")
    parser.add_argument("--max-incidents", type=int, metavar="N", help="stop after N incidents")
    parser.add_argument("--timeout", type=float, metavar="S", help="stop after S seconds")
    parser.add_argument("--poll", type=float, metavar="S",
                        help="seconds between polls (files 0.25; Prometheus [watch] poll_s, 15)")
    parser.set_defaults(handler=run)


def _queries(pairs: list[str]) -> dict[str, str]:
    queries = {}
    for pair in pairs:
        name, sep, query = pair.partition("=")
        if not sep or not query.strip():
            raise InputError(f"--query wants FIELD=PROMQL, not {pair!r}")
        queries[name.strip()] = query.strip()
    return queries


def _receiver_url(given: str | None, addr: str) -> str:
    url = given or f"http://{addr}/alerts/generic"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InputError(f"--receiver must be an http(s) URL, not {url!r}")
    if parts.path in ("", "/"):
        url = url.rstrip("/") + "/alerts/generic"
    return url


def _target(args: argparse.Namespace, config: Any, out: TextIO) -> Fire:
    if args.fire == "print":
        return print_target(out)
    if not args.job:
        raise InputError(f"--fire {args.fire} needs --job")
    if args.fire == "receiver":
        start = receiver_target(_receiver_url(args.receiver, config.receiver_addr), args.job, args.cluster,
                                os.environ.get(RECEIVER_TOKEN_ENV) or None)
    else:
        # Prefect lives outside the core: imported only for this target.
        from spikeops.tasks.start import deployment_target

        start = deployment_target(config, args.job, args.cluster, deployment=args.deployment)

    def fire(anomaly: Any) -> str | None:
        note = start(anomaly)
        out.write(describe(anomaly) + (f" -> {note}" if note else "") + "\n")
        out.flush()
        return note

    return fire


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from spikeops.config import load_config

    stats = SourceStats()
    detector: Detector | None = None
    status = EXIT_OK
    try:
        if args.max_incidents is not None and args.max_incidents < 1:
            raise InputError("--max-incidents must be at least 1")
        if args.timeout is not None and args.timeout < 0:
            raise InputError("--timeout must not be negative")
        if args.poll is not None and args.poll <= 0:
            raise InputError("--poll must be above 0")
        config = load_config(args.config)
        settings = WatchConfig.from_table(config.watch)
        fire = _target(args, config, out)
        records = open_source(settings, metrics=args.metrics, log=args.log, prometheus=args.prometheus,
                              queries=_queries(args.query), from_start=args.from_start, once=args.once,
                              timeout=args.timeout, poll_s=args.poll, stats=stats, idle=not args.once)
        detector = Detector(settings)
        watch(records, detector, fire, max_incidents=args.max_incidents)
    except SpikeopsError as exc:
        err.write(f"spikeops watch: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        status = EXIT_INTERRUPTED
    if detector is not None:
        steps = f" (steps {detector.first_step}..{detector.last_step})" if detector.first_step is not None else ""
        unread = f", {stats.bad_lines} unreadable line(s)" if stats.bad_lines else ""
        errors = f", {stats.errors} failed poll(s), last: {stats.last_error}" if stats.errors else ""
        recorded = (f", {len(detector.recorded)} routine jump(s) recorded (not incidents)"
                    if detector.recorded else "")
        err.write(f"spikeops watch: {detector.counts['records']} record(s){steps}, "
                  f"{len(detector.incidents)} incident(s){recorded}{unread}{errors}\n")
    return status

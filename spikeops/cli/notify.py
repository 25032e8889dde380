"""``spikeops notify``: a bundle's diagnosis to Slack, and its report."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from spikeops.cli.common import EXIT_NOTHING, EXIT_OK

__all__ = ["add_notify"]


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


def add_notify(commands: Any) -> None:
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

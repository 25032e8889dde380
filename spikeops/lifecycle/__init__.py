"""A drained node's way back (docs/lifecycle.md): reboot, validation, release, replacement.

spikeops drains the nodes the evidence convicts; this is what happens after. A node comes back
only when it has proven healthy, and a node that keeps failing is flagged for replacement:

    faults    what convicted a node, and whether a reset (a reboot) can clear it (pure)
    record    a node's ledger record read as its lifecycle: state, cycle, validations (pure)
    plan      the next step for a drained node, from its record and the policy (pure)
    checks    the validation checks: the command each runs and how its output is judged (pure)
    validate  the checks run on one node over SSH
    service   one cluster's lifecycle: scheduler, ledger, SSH and Slack around the decisions
    cli       ``spikeops nodes validate|reboot|release|list`` with the lifecycle

The Prefect side is ``spikeops.flows.node_lifecycle`` (scheduled per cluster by
``spikeops serve`` and in each cluster's work pool), over ``spikeops.tasks.lifecycle``.
"""

__all__: list[str] = []

"""Prefect tasks: small, typed, thin wrappers over the core in ``spikeops``.

Tasks do the I/O (SSH, scheduler commands, Slack) and carry the retries; parsing and judging
stay in the core so both can be retried or cached independently. Empty until the incident
flow issue: nothing here is used yet.
"""

__all__: list[str] = []

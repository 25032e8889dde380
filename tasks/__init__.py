"""Prefect tasks: one module per stage of the incident pipeline, each thin over the core.

| stage | module |
| --- | --- |
| open the incident (bundle, snapshot of the job's files) | ``incident`` |
| classify the symptom; observe a single spike | ``classify`` |
| protect the run (preserve, stop) | ``protect`` |
| collect the evidence over SSH | ``collect`` (and ``baselines``) |
| diagnose; pick the verified checkpoint | ``diagnose`` (and ``checkpoints``) |
| decide: ask a person | ``approve`` |
| isolate the culprits | ``isolate`` |
| resume the job | ``resume`` |
| tell the team | ``notify`` |
| start an incident for an alert or an anomaly | ``start`` |
| one incident per job | ``concurrency`` |
| memory across incidents: lineage, history, restart budget, cost | ``ledger`` |
| after the drain: reboot, validate, release, replace (the node-lifecycle flow) | ``lifecycle`` |

Tasks do the I/O (SSH, scheduler commands, Slack) and carry the retries; parsing, judging and
deciding stay in the core (``spikeops.diagnosis``, ``spikeops.response``) so both can be
tested, retried or cached independently.
"""

__all__: list[str] = []

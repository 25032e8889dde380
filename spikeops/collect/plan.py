"""What runs on each node: the registered remote probes, shaped by the inventory.

Pure functions, so the exact commands are testable without a node. Two rules keep a shell
on the node from ever seeing an untrusted word: the only values spliced into a command are
the job id and node name (validated, then ``shlex``-quoted) and interface names read from the
node's sysfs (validated, quoted); everything else is the operator's own inventory text.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from spikeops.errors import InputError
from spikeops.inventory import Inventory

__all__ = [
    "PlannedProbe",
    "plan_probes",
    "plan_interfaces",
    "physical_interfaces",
    "check_job_id",
    "IFACE_DISCOVERY",
    "remote_command",
]

#: Slurm ids (``4412``, ``4412_7`` for arrays, ``4412+1`` for het jobs) and k8s names.
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,127}$")
_IFACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
#: Virtual interfaces whose ``ethtool -S`` says nothing about the fabric.
_VIRTUAL = re.compile(r"^(lo|veth|docker|br-|virbr|cali|flannel|cni|tunl|vxlan|kube|tap|tun|dummy|"
                      r"gre|ip6|sit|nerdctl|weave|genev|wg)")
#: Lists the interfaces under the (movable) sysfs root; one name a line.
IFACE_DISCOVERY = 'ls -1 "${SPIKEOPS_SYSFS:-/sys}/class/net"'
#: Words a shell passes through untouched: such a command needs no ``sh -c`` around it.
_PLAIN = re.compile(r"^[A-Za-z0-9_./=,+-]+( [A-Za-z0-9_./=,+-]+)*$")
#: Seconds between ``timeout`` sending TERM and KILL on the node.
_KILL_AFTER = 2
MAX_INTERFACES = 64


@dataclass(frozen=True)
class PlannedProbe:
    """One command for one node. ``command`` is what probes.json records (what a person would
    type); ``remote`` is what is sent: the same, bounded by ``timeout`` on the node so a hung
    tool dies there too instead of lingering after the channel closes."""

    name: str
    filename: str
    kind: str
    command: str
    remote: str
    timeout: float
    max_bytes: int
    keep: str
    #: The node folder the probe's tar archive is unpacked into (``RemoteProbe.unpack``).
    unpack: str | None = None


def check_job_id(job: str) -> str:
    if not _JOB_ID.match(job or ""):
        raise InputError(f"bad job id {job!r} (letters, digits and _.:+- only)")
    return job


def remote_command(command: str, timeout: float, max_bytes: int, keep: str) -> str:
    """``timeout`` around the command; a plain command runs directly under it, anything with
    shell syntax under ``sh -c`` (one process fewer per probe on every node otherwise)."""
    body = f"{command} | tail -c {max_bytes}" if keep == "tail" else command
    seconds = max(1, int(round(timeout)))
    inner = body if _PLAIN.match(body) else f"sh -c {shlex.quote(body)}"
    return f"exec timeout -k {_KILL_AFTER} {seconds} {inner}"


def _fill(template: str, job: str, node: str) -> str:
    return template.replace("{job}", shlex.quote(job)).replace("{node}", shlex.quote(node))


def _job_command(inventory: Inventory, name: str, job: str, node: str) -> tuple[str, str]:
    """(what probes.json records, the script) of the flight recorder and stacks probes,
    written around the job's processes (``spikeops.collect.jobside``). The dump prefix is a
    literal path: job and node (checked names, no shell characters) are put in as they are,
    and the whole is quoted once."""
    from spikeops.collect.jobside import flight_recorder_command, stacks_command

    pids = _fill(inventory.job.pids, job, node) if inventory.job.pids else None
    which = f"the processes of job {job} ({inventory.job.pids})" if pids else f"the processes of job {job}"
    if name == "stacks":
        return f"py-spy dump --pid PID for each of {which}: tar of PID.txt", stacks_command(job, node, pids)
    prefix = inventory.job.flight_recorder
    if prefix:
        prefix = prefix.replace("{job}", job).replace("{node}", node)
    where = prefix or "$TORCH_FR_DUMP_TEMP_FILE of " + which
    return (f"tar of the flight recorder dumps {where}<rank>",
            flight_recorder_command(job, node, prefix, pids))


def plan_probes(inventory: Inventory, job: str, node: str, *, baseline: bool = False) -> list[PlannedProbe]:
    """The probes for one node, minus the per-interface ones (``plan_interfaces`` adds those
    once the node has said which interfaces it has); a baseline leaves out the probes of a
    running job's state (flight recorder, stacks, RAS)."""
    from spikeops.probes import registry
    from spikeops.probes.base import remote_probes

    registry()
    check_job_id(job)
    planned: list[PlannedProbe] = []
    for probe in remote_probes():
        settings = inventory.probes.get(probe.name)
        if settings is not None and not settings.enabled:
            continue
        if probe.per_interface or (baseline and not probe.baseline):
            continue
        command = settings.command if settings and settings.command else probe.command
        script = None
        if probe.unpack and not (settings and settings.command):
            command, script = _job_command(inventory, probe.name, job, node)
        if probe.needs:
            template = getattr(inventory.job, probe.needs)
            if not template:
                continue
            command = command.replace("{files}", _fill(template, job, node))
        if probe.name == "nccl-version" and inventory.job.nccl_version and not (settings and settings.command):
            command = inventory.job.nccl_version
        command = _fill(command, job, node)
        planned.append(_planned(inventory, probe.name, probe.name, probe.filename, probe.kind, command,
                                probe.max_bytes, probe.keep, probe.unpack, script))
    return planned


def _planned(inventory: Inventory, key: str, name: str, filename: str, kind: str, command: str,
             max_bytes: int, keep: str, unpack: str | None = None, script: str | None = None) -> PlannedProbe:
    """``script``, when given, is what runs on the node; ``command`` (what probes.json
    records) is then the one line that says what it does."""
    settings = inventory.probes.get(key)
    timeout = (settings.timeout if settings and settings.timeout else None) or inventory.ssh.command_timeout
    cap = (settings.max_bytes if settings and settings.max_bytes else None) or max_bytes
    return PlannedProbe(name, filename, kind, command, remote_command(script or command, timeout, cap, keep),
                        timeout, cap, keep, unpack)


def physical_interfaces(listing: Iterable[str]) -> list[str]:
    """Interface names worth an ``ethtool -S`` from a ``ls /sys/class/net`` listing; names that
    are not plain interface names are dropped, never passed on to a shell."""
    names: list[str] = []
    for raw in listing:
        name = raw.strip()
        if name and _IFACE.match(name) and not _VIRTUAL.match(name) and name not in names:
            names.append(name)
    return names[:MAX_INTERFACES]


def plan_interfaces(inventory: Inventory, interfaces: Iterable[str]) -> list[PlannedProbe]:
    """``ethtool -S`` (or whatever per-interface probes are registered) for each interface."""
    from spikeops.probes.base import remote_probes

    planned: list[PlannedProbe] = []
    for probe in remote_probes():
        settings = inventory.probes.get(probe.name)
        if not probe.per_interface or (settings is not None and not settings.enabled):
            continue
        template = settings.command if settings and settings.command else probe.command
        for iface in interfaces:
            if not _IFACE.match(iface):
                continue
            planned.append(_planned(
                inventory, probe.name, f"{probe.name}-{iface}", probe.filename.replace("{iface}", iface), probe.kind,
                template.replace("{iface}", shlex.quote(iface)), probe.max_bytes, probe.keep,
            ))
    return planned

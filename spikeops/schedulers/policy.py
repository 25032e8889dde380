"""The safety rules for touching nodes, shared by every scheduler (NHC's rules).

Pure functions over a node's state, so the Slurm and local schedulers cannot drift apart and
the rules are testable without a cluster. A verdict of ``None`` means "go ahead"; otherwise
it is the outcome (``nothing-to-do`` or ``refused``) and the reason a person will read.
"""

from __future__ import annotations

from typing import Any

__all__ = ["drain_verdict", "release_verdict", "reboot_verdict", "rebooting", "DRAINABLE", "HANDS_OFF", "REBOOTING"]

#: Base states spikeops may drain from; anything else is someone else's business.
DRAINABLE = frozenset({"IDLE", "ALLOCATED", "MIXED", "COMPLETING"})
#: Flags that mean a person or a power/reboot workflow owns the node right now.
HANDS_OFF = frozenset({"MAINTENANCE", "REBOOT_REQUESTED", "REBOOT_ISSUED", "POWERING_DOWN", "POWERING_UP",
                       "POWER_DOWN", "POWERED_DOWN", "PLANNED", "FAIL", "RESERVED"})
#: Flags of a reboot that Slurm (or the local scheduler) has not finished.
REBOOTING = frozenset({"REBOOT_REQUESTED", "REBOOT_ISSUED"})


def rebooting(node: Any) -> bool:
    """A reboot was asked for and the node has not registered again since."""
    return bool(set(getattr(node, "flags", ()) or ()) & REBOOTING)


def _owner(node: Any) -> str:
    who = f" by {node.reason_user}" if getattr(node, "reason_user", None) else ""
    if node.reason:
        return f"{node.state} with reason {node.reason!r}{who}: not spikeops', left alone"
    return f"{node.state}{who}: not spikeops', left alone"


def drain_verdict(node: Any) -> tuple[str, str] | None:
    """Drain only a node in a state spikeops understands, never over someone else's reason."""
    if node.drained_by_spikeops:
        return "nothing-to-do", f"already drained by spikeops ({node.reason})"
    if node.drained or node.down:
        return "refused", _owner(node)
    if node.base_state not in DRAINABLE or set(node.flags) & HANDS_OFF:
        return "refused", f"state {node.state} is not one spikeops changes"
    return None


def release_verdict(node: Any) -> tuple[str, str] | None:
    """Resume only what spikeops drained, and never a node in the middle of a reboot (it is
    DOWN until its slurmd registers again; a resume would cancel nothing and hide the boot)."""
    if not node.drained and not node.down:
        return "nothing-to-do", f"not drained ({node.state})"
    if not node.drained_by_spikeops:
        return "refused", _owner(node)
    if rebooting(node):
        return "refused", f"a reboot is in progress ({node.state}): release it once it has booted and passed validation"
    return None


def reboot_verdict(node: Any) -> tuple[str, str] | None:
    """Reboot only a node spikeops drained (so the reboot lands in a drained state it owns),
    never one someone else drained or downed, never one in a state spikeops does not know."""
    if rebooting(node):
        return "nothing-to-do", f"a reboot is already pending ({node.state})"
    if not node.drained_by_spikeops:
        if node.drained or node.down:
            return "refused", _owner(node)
        return "refused", f"not drained by spikeops ({node.state}): drain it first, so it cannot take a job while it reboots"
    if node.down or set(node.flags) & HANDS_OFF:
        return "refused", f"state {node.state} is not one spikeops reboots from (not responding, or someone's workflow owns it)"
    return None

"""The safety rules for touching nodes, shared by every scheduler (NHC's rules).

Pure functions over a node's state, so the Slurm and local schedulers cannot drift apart and
the rules are testable without a cluster. A verdict of ``None`` means "go ahead"; otherwise
it is the outcome (``nothing-to-do`` or ``refused``) and the reason a person will read.
"""

from __future__ import annotations

from typing import Any

__all__ = ["drain_verdict", "release_verdict", "DRAINABLE", "HANDS_OFF"]

#: Base states spikeops may drain from; anything else is someone else's business.
DRAINABLE = frozenset({"IDLE", "ALLOCATED", "MIXED", "COMPLETING"})
#: Flags that mean a person or a power/reboot workflow owns the node right now.
HANDS_OFF = frozenset({"MAINTENANCE", "REBOOT_REQUESTED", "REBOOT_ISSUED", "POWERING_DOWN", "POWERING_UP",
                       "POWER_DOWN", "POWERED_DOWN", "PLANNED", "FAIL", "RESERVED"})


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
    """Resume only what spikeops drained."""
    if not node.drained and not node.down:
        return "nothing-to-do", f"not drained ({node.state})"
    if not node.drained_by_spikeops:
        return "refused", _owner(node)
    return None

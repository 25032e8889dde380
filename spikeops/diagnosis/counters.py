"""Which NIC and HCA counters the communication rules judge, and from what value.

Two places need these: the communication rules (is this growth congestion?) and the bundle
loader (is a counter high enough now that its baseline is worth parsing?). They live here,
apart from both, so the loader does not import a rule module and the rules do not import the
loader back: the core has no import circle.
"""

from __future__ import annotations

import re

__all__ = [
    "PAUSE_GROWTH",
    "DROP_GROWTH",
    "PAUSE_ABSOLUTE",
    "DROP_ABSOLUTE",
    "RETRANSMIT_COUNTERS",
    "IB_WATCHED",
    "is_pause",
    "is_drop",
    "ignored",
    "congestion_counter_high",
]

#: Growth since the baseline that is congestion, not background.
PAUSE_GROWTH = 1_000
DROP_GROWTH = 100
#: Without a baseline, absolute values this large (and the finding stays weak).
PAUSE_ABSOLUTE = 10_000_000
DROP_ABSOLUTE = 1_000_000
#: IB retransmission counters (hw_counters) whose growth is the spec's "retransmits".
RETRANSMIT_COUNTERS = ("roce_adp_retrans", "local_ack_timeout_err", "rnr_nak_retry_err", "packet_seq_err",
                       "implied_nak_seq_err", "out_of_sequence", "duplicate_request")
#: IB counters whose growth some rule judges (link flaps, discards, retransmits).
IB_WATCHED = ("link_downed", "link_error_recovery", "port_xmit_discards", "excessive_buffer_overrun_errors",
              "out_of_buffer", *RETRANSMIT_COUNTERS)

_PAUSE = re.compile(r"pause", re.I)
_DROP = re.compile(r"discard|drop|out_of_buffer|buffer_overrun|no_buf|rx_missed|fifo_err", re.I)
_IGNORE = re.compile(r"xdp|csum|lro|tpa_", re.I)  # XDP drops are a program's choice, not congestion


def is_pause(name: str) -> bool:
    """A pause-frame counter (flow control: the switch or the peer asked us to wait)."""
    return bool(_PAUSE.search(name))


def is_drop(name: str) -> bool:
    """A discard / out-of-buffer counter (packets lost for lack of room)."""
    return bool(_DROP.search(name))


def ignored(name: str) -> bool:
    """Counters that look like drops but are a program's choice or offload bookkeeping."""
    return bool(_IGNORE.search(name))


def congestion_counter_high(name: str, value: int) -> bool:
    """Is this NIC counter high enough now that its growth could count as congestion?"""
    if ignored(name):
        return False
    if is_pause(name):
        return value >= PAUSE_GROWTH
    if is_drop(name):
        return value >= DROP_GROWTH
    return False

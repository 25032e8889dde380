"""The event rules: which NCCL or PyTorch-distributed message is which kind of event, and
the details each kind carries."""

from __future__ import annotations

import re
from typing import Any
from spikeops.probes.base import to_number
from spikeops.probes.nccl_log.version import (
    normalise_version,
)
from spikeops.probes.nccl_log.lines import (
    _ANY_VERSION,
)

__all__ = []


# --------------------------------------------------------------------------------------
# Event rules
# --------------------------------------------------------------------------------------

_DIST_CONTEXT = re.compile(
    r"NCCL|nccl|c10d|ProcessGroup|torch\.distributed|Dist\w*Error|WorkNCCL|[Gg]loo|TCPStore|"
    r"[Rr]endezvous|\[(?:PG [^\]]*)?Rank \d+\]"
)
_RULES: tuple[tuple[str, re.Pattern[str], bool], ...] = (
    # (kind, pattern, needs a distributed context on a non-NCCL line); first match wins.
    ("cuda_error", re.compile(r"\bCUDA error: |\bCuda failure\b|\bCUDA failure\b"), False),
    (
        "ib_completion_error",
        re.compile(r"Got completion from peer|Got CQE with error|\bIBV_WC_[A-Z_]*ERR\b"),
        False,
    ),
    (
        # The HCA's own asynchronous events: the port (the cable, the switch port) went bad.
        "ib_port_error",
        re.compile(
            r"Got async event\s*:\s*(?:port error|link (?:down|error)|port (?:down|inactive))"
            r"|\bIBV_EVENT_(?:PORT_ERR|LINK_DOWN)\b"
        ),
        False,
    ),
    (
        "abort",
        re.compile(
            r"NCCL communicator was aborted|\bncclCommAbort\b|[Aa]borting (?:the )?(?:NCCL )?communicator"
            r"|taking the entire process down|watchdog thread terminated with exception"
        ),
        False,
    ),
    ("watchdog_timeout", re.compile(r"[Cc]aught collective operation timeout"), False),
    ("system_error", re.compile(r"unhandled system error|\bncclSystemError\b"), False),
    (
        "remote_error",
        re.compile(r"\bncclRemoteError\b|remote process exited or there was a network error"),
        False,
    ),
    (
        "invalid_usage",
        re.compile(
            r"\bncclInvalidUsage\b|\bncclInvalidArgument\b|NCCL error.{0,300}?\binvalid (?:usage|argument)\b"
        ),
        False,
    ),
    (
        "internal_error",
        re.compile(
            r"unhandled cuda error|\bncclUnhandledCudaError\b|\bncclInternalError\b"
            r"|NCCL error.{0,300}?\binternal error\b"
        ),
        False,
    ),
    (
        "connection_error",
        re.compile(
            r"\bConnect to \S+ failed|Connection refused|Connection reset by peer"
            r"|[Cc]onnection closed by (?:remote )?peer|\bNo route to host\b|Broken pipe"
        ),
        True,
    ),
    (
        "timeout",
        re.compile(
            r"\bNCCL timeout\b|\b[Tt]imed out\b|\bTIMED OUT\b|\bSocket Timeout\b|\bTimeout at NCCL work\b"
            r"|\b[Tt]imeout waiting\b"
        ),
        True,
    ),
)

_RANK_IN_TEXT = re.compile(r"\[(?:PG [^\[\]]{0,80}?)?Rank (\d+)\]|\bon rank (\d+)\b")
_WORK = re.compile(r"WorkNCCL\(((?:[^()]|\([^()]*\))*)\)")
_WORK_FIELD = re.compile(r"(\w+(?:\(\w+\))?)=(\[[^\]]*\]|[^,\s)]+)")
_RAN_FOR = re.compile(r"ran for (\d+) milliseconds")
_WORK_KEYS = {
    "SeqNum": "seq",
    "OpType": "op",
    "NumelIn": "numel_in",
    "NumelOut": "numel_out",
    "Timeout(ms)": "timeout_ms",
    "TensorShape": "tensor_shape",
}
_WORK_PROGRESS = re.compile(
    r"Timeout at NCCL work: (\d+), last enqueued NCCL work: (-?\d+), last completed NCCL work: (-?\d+)"
)

#: ``enum ibv_wc_status`` from libibverbs' verbs.h, for lines that print only the number.
_IBV_WC_STATUS = (
    "IBV_WC_SUCCESS", "IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR", "IBV_WC_LOC_EEC_OP_ERR",
    "IBV_WC_LOC_PROT_ERR", "IBV_WC_WR_FLUSH_ERR", "IBV_WC_MW_BIND_ERR", "IBV_WC_BAD_RESP_ERR",
    "IBV_WC_LOC_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR", "IBV_WC_REM_ACCESS_ERR",
    "IBV_WC_REM_OP_ERR", "IBV_WC_RETRY_EXC_ERR", "IBV_WC_RNR_RETRY_EXC_ERR",
    "IBV_WC_LOC_RDD_VIOL_ERR", "IBV_WC_REM_INV_RD_REQ_ERR", "IBV_WC_REM_ABORT_ERR",
    "IBV_WC_INV_EECN_ERR", "IBV_WC_INV_EEC_STATE_ERR", "IBV_WC_FATAL_ERR",
    "IBV_WC_RESP_TIMEOUT_ERR", "IBV_WC_GENERAL_ERR", "IBV_WC_TM_ERR", "IBV_WC_TM_RNDV_INCOMPLETE",
)
_IB_PEER = re.compile(r"from peer\s+(?!with\b)(\S+?)(?:<(\d+)>)?,?\s+with\b")
_IB_STATUS = re.compile(r"with error (\d+)|\bstatus=(?:(\w+)\()?(\d+)\)?")
_IB_OPCODE = re.compile(r"\bopcode[ =](?:(\w+)\()?(\d+)\)?")
_IB_LEN = re.compile(r"\blen[ =](\d+)")
_IB_VENDOR = re.compile(r"\bvendor[ _]err[ =](0x[0-9a-fA-F]+|\d+)(?:\s+\((\w+)\))?")
_IB_HCA = re.compile(r"\bhca (\S+)")
_IB_LOCAL_GID = re.compile(r"\blocalGid\s+(\S+)")
_IB_REMOTE_GID = re.compile(r"\bremoteGids?\s*(\S+)")
_IB_QP = re.compile(r"\bqp_num=(\d+)")
_IB_NAME = re.compile(r"\bIBV_WC_[A-Z_]*ERR\b")

_CUDA_ERROR = re.compile(r"\bCUDA error: (.+?)\s*$")
_CUDA_FAILURE = re.compile(r"\bCuda failure (?:(\d+) )?'([^']*)'")
_NCCL_ERROR_IN = re.compile(r"NCCL error in: (\S+?:\d+)")
_ERROR_TYPE = re.compile(r"^([\w.]+(?:Error|Exception)):")
_CONNECT_PEER = re.compile(
    r"\b(?:Connect to|from|to|peer)\s+(\[?[\w.:%-]{1,255}?\]?)<(\d{1,5})>|\bConnect to (\S{1,255}?) failed"
)
_FAILED_REASON = re.compile(r"failed\s*:\s*(.+?)\s*$")
_TIMEOUT_AFTER = re.compile(r"after (\d+(?:\.\d+)?)\s*(?:s\b|sec|seconds)")

_DESYNC_AT = re.compile(r"(?:\[(\d+)\]\s+)?Timeout at collective: (\w+), #(\d+)")
_DESYNC_NOT_FINISHED = re.compile(r"\[([\d,\s]+)\] joined but didn't finish collective #(\d+)")
_DESYNC_NOT_JOINED = re.compile(
    r"\[([\d,\s]+)\] finished collective #(\d+), but didn't join collective #(\d+)"
)
_DESYNC_NEVER = re.compile(r"ranks \[([\d,\s]+)\] are the lagging ranks that caused this timeout")

_COMM = re.compile(r"\bcomm (0x[0-9a-fA-F]{1,32}) rank (\d{1,9}) nranks (\d{1,9})\b", re.I)
#: A process may open a communicator per parallel group; thousands would only cost memory.
_MAX_COMMS = 256
_EXPLANATION = re.compile(r"^(nccl[A-Z]\w*(?:Error|Usage|Argument)):\s*(.*)$")
_TERMINATE = re.compile(r"terminate called after throwing an instance of '([^']+)'")
_FRAME = re.compile(r"^\s*(?:frame #\d+:|Exception raised from\s+(.+?)\s*(?:\(most recent call first\):?)?$)")
_WATCHDOG_FRAME = re.compile(
    r"ProcessGroupNCCL::(?:workCleanupLoop|ncclCommWatchdog|watchdogHandler|Watchdog)|ncclCommWatchdog"
)
_STACK_LIKE = re.compile(r"^\s*(?:\[|\+ |Traceback|File \"|[\w.]+(?:Error|Exception)\b|frame #)")


def _ranks(text: str) -> list[int]:
    return [int(part) for part in re.findall(r"\d+", text)]


def _work_details(message: str) -> dict[str, Any]:
    """Fields of ``WorkNCCL(SeqNum=2, OpType=ALLREDUCE, ..., Timeout(ms)=8000)`` by our names."""
    details: dict[str, Any] = {}
    work = _WORK.search(message)
    if work:
        for key, value in _WORK_FIELD.findall(work[1]):
            name = _WORK_KEYS.get(key)
            if name is None:
                continue
            number = to_number(value) if name != "op" and not value.startswith("[") else None
            details[name] = number if number is not None else value
    ran = _RAN_FOR.search(message)
    if ran:
        details["ran_ms"] = int(ran[1])
    progress = _WORK_PROGRESS.search(message)
    if progress:
        details["seq"] = int(progress[1])
        details["last_enqueued"] = int(progress[2])
        details["last_completed"] = int(progress[3])
    return details


def _ib_details(message: str) -> dict[str, Any]:
    """Peer, verbs status, opcode, length, vendor error and direction of a failed completion."""
    details: dict[str, Any] = {}
    peer = _IB_PEER.search(message)
    if peer:
        details["peer"] = peer[1]
        if peer[2]:
            details["peer_port"] = int(peer[2])
    status = _IB_STATUS.search(message)
    if status:
        code = int(status[1] or status[3])
        details["status"] = code
        name = status[2]
        if name is None and 0 <= code < len(_IBV_WC_STATUS):
            name = _IBV_WC_STATUS[code]
        if name is not None:
            details["status_name"] = name
    else:
        named = _IB_NAME.search(message)
        if named:
            details["status_name"] = named[0]
    opcode = _IB_OPCODE.search(message)
    if opcode:
        details["opcode"] = int(opcode[2])
        if opcode[1]:
            details["opcode_name"] = opcode[1]
    length = _IB_LEN.search(message)
    if length:
        details["len"] = int(length[1])
    vendor = _IB_VENDOR.search(message)
    if vendor:
        raw_vendor = vendor[1]
        details["vendor_err"] = (
            int(raw_vendor, 16) if raw_vendor.lower().startswith("0x") else int(raw_vendor)
        )
        if vendor[2]:
            details["direction"] = vendor[2]
    for name, pattern in (
        ("hca", _IB_HCA), ("local_gid", _IB_LOCAL_GID), ("remote_gid", _IB_REMOTE_GID),
    ):
        found = pattern.search(message)
        if found:
            details[name] = found[1]
    qp = _IB_QP.search(message)
    if qp:
        details["qp_num"] = int(qp[1])
    return details


def _nccl_error_details(message: str, phrase: str) -> dict[str, Any]:
    details: dict[str, Any] = {"reason": phrase}
    version = _ANY_VERSION.search(message)
    if version:
        details["nccl_version"] = normalise_version(version[1])
    where = _NCCL_ERROR_IN.search(message)
    if where:
        details["where"] = where[1]
    error_type = _ERROR_TYPE.match(message.strip())
    if error_type:
        details["error_type"] = error_type[1]
    return details


def _connection_details(message: str, phrase: str) -> dict[str, Any]:
    details: dict[str, Any] = {}
    peer = _CONNECT_PEER.search(message)
    if peer:
        details["peer"] = peer[1] or peer[3]
        if peer[2]:
            details["peer_port"] = int(peer[2])
    reason = _FAILED_REASON.search(message)
    details["reason"] = reason[1] if reason else phrase
    return details


def _details_for(kind: str, message: str, phrase: str) -> dict[str, Any]:
    """The values a person would read off a line of this kind, by stable names."""
    if kind == "ib_completion_error":
        return _ib_details(message)
    if kind == "cuda_error":
        failure = _CUDA_FAILURE.search(message)
        if failure:
            details: dict[str, Any] = {"error": failure[2]}
            if failure[1]:
                details["code"] = int(failure[1])
            return details
        error = _CUDA_ERROR.search(message)
        return {"error": error[1].rstrip(".") if error else phrase}
    if kind in ("system_error", "internal_error", "invalid_usage", "remote_error"):
        return _nccl_error_details(message, phrase)
    if kind == "connection_error":
        return _connection_details(message, phrase)
    details = _work_details(message)
    details["reason"] = phrase
    if kind == "timeout":
        after = _TIMEOUT_AFTER.search(message)
        if after:
            details["after_s"] = to_number(after[1])
    return details


def _classify(message: str, context: bool) -> tuple[str, dict[str, Any]] | None:
    """First rule that matches; generic phrases (timeouts, refused connections) count only
    where the line is about distributed communication, so a wandb retry is not an NCCL fault."""
    for kind, pattern, needs_context in _RULES:
        match = pattern.search(message)
        if match is None or (needs_context and not context):
            continue
        return kind, _details_for(kind, message, match[0].strip())
    return None


def _text_rank(message: str) -> int | None:
    match = _RANK_IN_TEXT.search(message)
    if match is None:
        return None
    return int(match[1] or match[2])

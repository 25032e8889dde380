"""NCCL_DEBUG=INFO logs, PyTorch distributed errors and the NCCL version file."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from spikeops.probes import get_kind, kind_names, nccl_log
from tests.conftest import REAL, SYNTHETIC, real_text, synthetic, synthetic_text

A100 = "nccl/init-a100-4nodes-32ranks-nccl2.10.3-omnipath_bigscience.txt"
V100 = "nccl/init-v100-1node-4ranks-nccl2.7.8-nvlink-p2p_bigscience.txt"
IB = "nccl/net-ib-error12-vendor129-azure_ml-engineering.txt"
SOCKET = "nccl/socket-connect-refused-warn_ml-engineering.txt"
CUDA = "nccl/torch-processgroupnccl-cuda-unknown-error-gpu-crash_bigscience.txt"
WATCHDOG = "nccl/torch-watchdog-timeout-allreduce-desync_ml-engineering.txt"
SYSTEM = "nccl/unhandled-system-error-2.7.8_ml-engineering.txt"
FSDP = "training-logs/fsdp-llama3-8b-p5-srun-prefixed-with-nccl-lines_awsome-distributed-training.txt"
REAL_NCCL = (A100, V100, IB, SOCKET, CUDA, WATCHDOG, SYSTEM)


# -- real fixtures -------------------------------------------------------------------------


def test_a100_init_32_ranks_on_4_nodes():
    log = nccl_log.parse(real_text(A100))
    assert log.lines == 508
    assert len(log.processes) == 32
    assert sorted({p.host for p in log.processes.values()}) == [
        "jean-zay-iam37", "jean-zay-iam40", "jean-zay-iam41", "jean-zay-iam52",
    ]
    assert sorted(p.rank for p in log.processes.values()) == list(range(32))
    assert {p.nranks for p in log.processes.values()} == {32}
    # The bare "NCCL version 2.10.3+cuda11.3" (line 5) follows rank 0's lines.
    assert log.versions == {"2.10.3": {"jean-zay-iam37:261379"}}
    assert log.versions_by_host() == {"jean-zay-iam37": {"2.10.3"}}
    rank0 = log.processes["jean-zay-iam37:261379"]
    assert (rank0.rank, rank0.cuda_dev, rank0.bus_id, rank0.version_raw) == (0, 0, "7000", "2.10.3+cuda11.3")
    rank28 = log.processes["jean-zay-iam52:263019"]
    assert (rank28.rank, rank28.cuda_dev, rank28.bus_id) == (28, 4, "88000")
    assert {p.network for p in log.processes.values()} == {"IB"}
    assert rank0.net_devices == ["hfi1_1:1/IB", "hfi1_0:1/IB", "hfi1_2:1/IB", "hfi1_3:1/IB"]
    assert rank0.bootstrap == "ib0:10.148.8.203<0>"
    assert "NET/IB" in rank0.transports and "P2P/IPC/read" in rank0.transports
    assert log.events == []
    assert log.gaps == []


def test_v100_single_node_bare_version_goes_to_rank0():
    log = nccl_log.parse(real_text(V100))
    assert len(log.processes) == 4
    assert {p.host for p in log.processes.values()} == {"r7i4n1"}
    assert {p.pid: p.rank for p in log.processes.values()} == {63120: 0, 63121: 1, 63122: 2, 63123: 3}
    assert log.versions == {"2.7.8": {"r7i4n1:63120"}}
    rank2 = log.processes["r7i4n1:63122"]
    assert (rank2.cuda_dev, rank2.bus_id, rank2.nranks) == (2, "88000", 4)
    assert rank2.net_devices == ["hfi1_2:1/IB", "hfi1_0:1/IB", "hfi1_3:1/IB", "hfi1_1:1/IB"]
    assert rank2.transports == ["P2P/IPC"]
    assert log.events == [] and log.gaps == []


def test_ib_completion_error_wrapped_over_two_lines():
    log = nccl_log.parse(real_text(IB))
    assert [e.kind for e in log.events] == ["ib_completion_error"]  # the "-> 6" INFO lines are not events
    event = log.events[0]
    assert (event.line, event.host, event.pid, event.cuda_dev) == (1, "node-2", 5776, 0)
    assert event.details["peer"] == "10.2.0.5"
    assert event.details["peer_port"] == 33092
    assert event.details["status"] == 12
    assert event.details["status_name"] == "IBV_WC_RETRY_EXC_ERR"
    assert event.details["opcode"] == 0
    assert event.details["len"] == 0  # "len" ends line 1, its value starts line 2
    assert event.details["vendor_err"] == 129
    assert event.details["direction"] == "Recv"
    assert event.details["source"] == "transport/net_ib.cc:1296"
    assert "vendor err 129 (Recv)" in event.text
    assert list(log.processes) == ["node-2:5776"]
    assert log.gaps == []


def test_socket_connect_refused():
    log = nccl_log.parse(real_text(SOCKET))
    (event,) = log.events
    assert event.kind == "connection_error"
    assert (event.host, event.pid, event.cuda_dev, event.line) == ("r11i6n2", 486514, 1, 1)
    assert event.details["peer"] == "10.148.3.247"
    assert event.details["peer_port"] == 56821
    assert event.details["reason"] == "Connection refused"
    assert event.details["source"] == "include/socket.h:403"


def test_unhandled_system_error_version_and_explanation():
    log = nccl_log.parse(real_text(SYSTEM))
    (event,) = log.events  # ncclSystemError's explanation line joins the RuntimeError
    assert event.kind == "system_error"
    assert event.line == 2
    assert event.details["nccl_version"] == "2.7.8"
    assert event.details["where"].endswith("ProcessGroupNCCL.cpp:825")
    assert event.details["error_type"] == "RuntimeError"
    assert event.details["nccl_error"] == "ncclSystemError"
    assert event.details["explanation"].startswith("System call (socket, malloc, munmap, etc) failed")
    assert log.versions == {"2.7.8": {""}}  # no process printed it
    assert log.processes == {}


def test_watchdog_timeout_and_desync_report():
    log = nccl_log.parse(real_text(WATCHDOG))
    assert [(e.kind, e.line) for e in log.events] == [("watchdog_timeout", 1), ("desync", 4)]
    watchdog, desync = log.events
    assert watchdog.rank == 0
    assert {k: watchdog.details[k] for k in ("op", "seq", "numel_in", "numel_out", "timeout_ms", "ran_ms", "rank")} == {
        "op": "ALLREDUCE", "seq": 2, "numel_in": 4, "numel_out": 4, "timeout_ms": 8000, "ran_ms": 8097, "rank": 0,
    }
    assert desync.details["lagging_ranks"] == [1]
    assert desync.details["collective"] == 3
    assert desync.details["finished"] == 2
    assert desync.details["op"] == "ALLREDUCE"
    assert desync.details["reporting_rank"] == 0
    assert "didn't join collective #3" in desync.text


def test_cuda_error_raised_in_nccl_watchdog_thread():
    log = nccl_log.parse(real_text(CUDA))
    (event,) = log.events
    assert event.kind == "cuda_error"
    assert event.line == 2
    assert event.details["error"] == "unknown error"
    assert event.details["exception"] == "c10::CUDAError"
    assert event.details["local_rank"] == 3  # [default3]: is torchrun's local rank tag
    assert event.details["thread"] == "watchdog"  # workCleanupLoop frame
    assert event.details["raised_from"] == "query at ../aten/src/ATen/cuda/CUDAEvent.h:95"
    assert log.gaps == []


def test_srun_prefixed_training_log_yields_its_nccl_lines():
    log = nccl_log.parse(real_text(FSDP))
    assert set(log.processes) == {"p5-dy-gpu-3:47930", "p5-dy-gpu-3:47936", "p5-dy-gpu-4:930643"}
    assert log.versions == {"2.26.2": {"p5-dy-gpu-3:47930"}}
    ofi = log.processes["p5-dy-gpu-4:930643"]
    assert (ofi.network, ofi.net_plugin, ofi.cuda_dev) == ("OFI", "aws-ofi-nccl 1.13.2-aws", 7)
    assert log.processes["p5-dy-gpu-3:47936"].cuda_dev == 6
    assert log.events == [] and log.gaps == []  # loss lines and bash traces are not ours
    assert nccl_log.detect(real_text(FSDP)) == 0.5  # the training parser owns this file


@pytest.mark.parametrize("name", REAL_NCCL)
def test_detect_every_real_nccl_fixture(name):
    text = real_text(name)
    assert nccl_log.detect(text) >= 0.9
    assert nccl_log.detect_version(text) == 0.0


def test_detect_claims_no_other_real_fixture():
    for path in sorted(Path(REAL).rglob("*")):
        if not path.is_file() or path.name == "SOURCES.md" or path.parent.name == "nccl":
            continue
        sample = path.read_text(encoding="utf-8", errors="replace")[:65536]
        assert nccl_log.detect(sample) <= 0.5, path
        assert nccl_log.detect_version(sample) < 0.5, path


# -- synthetic formats ---------------------------------------------------------------------


def test_mixed_versions_across_hosts():
    log = nccl_log.parse(synthetic_text("nccl/multinode-mixed-version.log"))
    assert log.versions_by_host() == {"gpu-a": {"2.18.5"}, "gpu-b": {"2.20.5"}}
    assert log.versions == {"2.18.5": {"gpu-a:20001"}, "2.20.5": {"gpu-b:31001"}}
    # The world communicator (nranks 4) decides the rank, whatever order the comms came in.
    assert {k: (p.rank, p.nranks) for k, p in log.processes.items()} == {
        "gpu-a:20001": (0, 4), "gpu-a:20002": (1, 4), "gpu-b:31001": (2, 4), "gpu-b:31002": (3, 4),
    }
    assert log.processes["gpu-b:31001"].comms == {"0x5611f3c7a010": (0, 2), "0x5611f2b09e80": (2, 4)}
    assert log.processes["gpu-b:31002"].transports == ["P2P/CUMEM/read", "NET/IB"]
    summary = "\n".join(nccl_log.summarize(log))
    assert "MIXED NCCL VERSIONS" in summary and "2.18.5 on gpu-a" in summary
    assert "ranks 0-3 of 4" in summary


def test_ib_error_nccl_2_19_text():
    (event,) = nccl_log.parse(synthetic_text("nccl/ib-completion-2.19.log")).events
    assert event.kind == "ib_completion_error"
    assert event.line == 2  # NCCL prints an empty line before each WARN
    assert (event.details["status"], event.details["vendor_err"], event.details["direction"]) == (12, 129, "Recv")
    assert event.details["peer"] == "10.20.0.14"
    assert event.details["local_gid"] == "::ffff:10.20.0.13"
    assert event.details["remote_gid"] == "::ffff:10.20.0.14"
    assert event.time is None


def test_ib_error_nccl_2_23_timestamped_warn():
    (event,) = nccl_log.parse(synthetic_text("nccl/ib-completion-2.23-timestamped.log")).events
    assert event.time == datetime(2026, 11, 29, 18, 3, 11, tzinfo=UTC)
    assert (event.host, event.pid, event.cuda_dev) == ("gpu-d", 52017, 1)
    assert event.details["status"] == 4
    assert event.details["status_name"] == "IBV_WC_LOC_PROT_ERR"
    assert event.details["direction"] == "Send"
    assert event.details["hca"] == "mlx5_1"
    assert event.details["remote_gid"] == "::ffff:10.20.0.16"


def test_ib_error_named_status_and_cqe():
    log = nccl_log.parse(synthetic_text("nccl/ib-completion-named-status.log"))
    cqe, completion = log.events_of("ib_completion_error")
    assert cqe.details["qp_num"] == 26257
    assert completion.details["status"] == 12
    assert completion.details["status_name"] == "IBV_WC_RETRY_EXC_ERR"
    assert completion.details["opcode"] == 129
    assert completion.details["opcode_name"] == "IBV_WC_RECV_RDMA_WITH_IMM"
    assert completion.details["vendor_err"] == 129
    assert completion.details["source"] == "transport/net_ib/p2p.cc:648"


def test_torch2_glog_watchdog_without_and_with_year():
    text = synthetic_text("nccl/torch2-watchdog-glog.log")
    log = nccl_log.parse(text)
    assert [(e.kind, e.line) for e in log.events] == [
        ("watchdog_timeout", 1), ("timeout", 2), ("timeout", 3), ("abort", 4), ("abort", 5),
    ]
    watchdog = log.events[0]
    assert watchdog.time is None and watchdog.stamp == "1129 18:01:02.123456"  # glog has no year
    assert watchdog.rank == 0
    assert (watchdog.details["seq"], watchdog.details["timeout_ms"], watchdog.details["ran_ms"]) == (1234, 600000, 600123)
    assert watchdog.details["numel_in"] == 268435456
    assert watchdog.details["severity"] == "E"
    assert watchdog.details["logger"] == "ProcessGroupNCCL.cpp:616"
    progress = log.events[1].details
    assert (progress["seq"], progress["last_enqueued"], progress["last_completed"]) == (1234, 1235, 1233)
    died = log.events[4]
    assert died.details["thread"] == "watchdog" and died.details["seq"] == 1234
    dated = nccl_log.parse(text, year=2026)
    assert dated.events[0].time == datetime(2026, 11, 29, 18, 1, 2, 123456, tzinfo=UTC)


def test_connection_reset_from_nccl_and_torch():
    log = nccl_log.parse(synthetic_text("nccl/connection-reset.log"))
    nccl, torch = log.events_of("connection_error")
    assert (nccl.host, nccl.cuda_dev, nccl.details["peer"], nccl.details["peer_port"]) == ("gpu-f", 5, "10.20.0.21", 43817)
    assert nccl.details["reason"] == "Connection reset by peer"
    assert torch.line == 9 and torch.rank == 13  # from torchrun's [rank13]: tag
    assert torch.details["reason"] == "Connection reset by peer"
    assert len(log.events) == 2  # traceback lines are not events


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_binary_junk_keeps_good_lines(encoding):
    raw = synthetic("nccl/binary-junk-latin1.log").read_bytes()
    log = nccl_log.parse(raw.decode(encoding, errors="replace"))
    proc = log.processes["gpu-g:7001"]
    assert (proc.rank, proc.nranks, proc.network, proc.net_devices) == (10, 16, "IB", ["mlx5_2:1/IB"])
    (event,) = log.events
    assert event.kind == "ib_completion_error" and event.line == 9
    assert (event.details["status"], event.details["vendor_err"]) == (5, 249)
    assert "\x00" not in event.text  # the binary line after the WARN is not its continuation
    assert any(gap.line == 7 and "unreadable NCCL line" in gap.reason for gap in log.gaps)
    assert any("binary" in gap.reason for gap in log.gaps)


# -- rules on inline inputs ----------------------------------------------------------------


def test_launcher_prefixes_and_stamps_are_peeled():
    text = "\n".join([
        "3: [default2]:[2026-11-29 18:01:02,123] n1:10:11 [2] NCCL INFO comm 0xa rank 10 nranks 16 cudaDev 2 busId 3b000 - Init COMPLETE",
        "2026-11-29T18:05:00Z n1:10:12 [2] include/socket.h:403 NCCL WARN Connect to 10.0.0.9<1234> failed : No route to host",
        "E1129 18:06:00.000001  4321 ProcessGroupNCCL.cpp:616] [Rank 10] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=7, OpType=BROADCAST, Timeout(ms)=1800000) ran for 1800321 milliseconds before timing out.",
        "[E ProcessGroupNCCL.cpp:475] [Rank 10] NCCL watchdog thread terminated with exception: CUDA error: an illegal memory access was encountered",
    ])
    log = nccl_log.parse(text, year=2026)
    assert log.processes["n1:10"].rank == 10
    refused, watchdog, cuda = log.events
    assert refused.kind == "connection_error" and refused.rank == 10  # back-filled from its process
    assert refused.time == datetime(2026, 11, 29, 18, 5, tzinfo=UTC)
    assert refused.details["reason"] == "No route to host"
    assert watchdog.kind == "watchdog_timeout" and watchdog.details["op"] == "BROADCAST"
    assert watchdog.time == datetime(2026, 11, 29, 18, 6, 0, 1, tzinfo=UTC)
    assert cuda.kind == "cuda_error" and cuda.details["error"] == "an illegal memory access was encountered"
    assert cuda.rank == 10


def test_c10_logger_month_without_leading_zero():
    line = "[rank1]:[E105 07:08:09.123456789 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for 5 milliseconds before timing out."
    (event,) = nccl_log.parse(line, year=2026).events
    assert event.time == datetime(2026, 1, 5, 7, 8, 9, 123456, tzinfo=UTC)


def test_warn_tail_does_not_swallow_other_lines():
    text = "\n".join([
        "h:1:2 [0] transport/net_ib.cc:1 NCCL WARN NET/IB : Got completion from peer 10.0.0.2<5> with error 12, opcode 0, len",
        "0, vendor err 129 (Recv)",
        "2026-11-29 18:00:00 I [train.py:103] Batch 7 Loss: 11.7",
        "h:1:2 [0] misc/socket.cc:1 NCCL WARN something odd",
        "[default0]: Traceback (most recent call last):",
    ])
    log = nccl_log.parse(text)
    ib, warn = log.events
    assert ib.details["vendor_err"] == 129 and "Loss" not in ib.text
    assert warn.kind == "warn" and warn.details["message"] == "something odd"
    assert warn.text.endswith("something odd")


def test_generic_phrases_need_a_distributed_context():
    text = "\n".join([
        "wandb: Network error (ConnectionError): Connection refused, entering retry loop.",
        "requests.exceptions.ReadTimeout: Read timed out. (read timeout=10)",
        "[E socket.cpp:957] [c10d] The client socket has timed out after 900s while trying to connect to (10.0.0.1, 29500).",
    ])
    log = nccl_log.parse(text)
    (event,) = log.events
    assert event.kind == "timeout" and event.line == 3 and event.details["after_s"] == 900


def test_event_limit_is_counted_in_a_gap(monkeypatch):
    monkeypatch.setattr(nccl_log.reader, "MAX_EVENTS", 3)
    text = "\n".join(f"h:1:2 [0] x.cc:1 NCCL WARN odd {i}" for i in range(10))
    log = nccl_log.parse(text)
    assert len(log.events) == 3
    assert any("7 more warn events" in gap.reason for gap in log.gaps)


def test_streams_an_iterable_once():
    text = real_text(V100)
    lines = iter(text.splitlines(keepends=True))
    log = nccl_log.parse(lines)
    assert len(log.processes) == 4 and log.lines == 150
    assert next(lines, None) is None


def test_not_nccl_at_all_is_one_gap():
    log = nccl_log.parse("iteration 10 | lm loss: 3.2\nhello\n")
    assert log.processes == {} and log.events == []
    assert [gap.reason for gap in log.gaps] == ["no NCCL or PyTorch distributed lines found"]


def test_detect_refuses_kernel_logs_and_yields_to_training_logs():
    kernel = "\n".join([
        "[ 1234.567890] NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
        "[ 1234.567900] NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.",
        "[ 1234.600000] python[1234]: segfault at 0 ip 0 sp 0 error 4 in libnccl.so.2",
    ])
    assert nccl_log.detect(kernel) == 0.0
    training = "\n".join(
        [f"iteration {i}/ 1000 | lm loss: 3.{i} | loss scale: 4096.0 |" for i in range(30)]
        + ["n1:10:11 [0] NCCL INFO Using network IB"]
    )
    assert nccl_log.detect(training) == 0.5
    assert nccl_log.detect("NCCL version 2.18.5+cuda12.2\n") < nccl_log.detect_version("NCCL version 2.18.5+cuda12.2\n")


# -- the version file ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, version",
    [
        ("version-torch-tuple.txt", "2.18.5"),
        ("version-torch-int-2.18.txt", "2.18.5"),
        ("version-old-torch-int.txt", "2.7.8"),
        ("version-nccl-header.txt", "2.18.5"),
        ("version-libnccl-symlink.txt", "2.18.5"),
        ("version-plain.txt", "2.18.5"),
    ],
)
def test_version_file_forms(name, version):
    text = synthetic_text(f"nccl/{name}")
    result = nccl_log.parse_version(text)
    assert (result.version, result.line, result.gaps) == (version, 1, [])
    assert result.raw == text.strip()
    assert nccl_log.detect_version(text) > nccl_log.detect(text)


def test_version_file_without_a_version_is_a_gap():
    result = nccl_log.parse_version(synthetic_text("nccl/version-no-torch.txt"))
    assert result.version is None and result.line is None
    assert "No module named 'torch'" in result.gaps[0].reason


def test_version_file_with_two_versions_keeps_the_first_and_says_so():
    result = nccl_log.parse_version("2.18.5\nNCCL version 2.19.3+cuda12.3\n")
    assert result.version == "2.18.5"
    assert result.gaps and result.gaps[0].line == 2


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2.18.5", "2.18.5"),
        ("2.18.5+cuda12.2", "2.18.5"),
        ("(2, 18, 5)", "2.18.5"),
        ("NCCL version 2.18.5+cuda12.2", "2.18.5"),
        ("libnccl.so.2.18.5", "2.18.5"),
        ("21805", "2.18.5"),
        ("2708", "2.7.8"),
        ("20903", "2.9.3"),
        ("2.18.5-1+cuda12.2", "2.18.5"),
        ("12345", None),
        ("10.148.3.247", None),
        ("cuda12.2", None),
        ("", None),
    ],
)
def test_normalise_version(text, expected):
    assert nccl_log.normalise_version(text) == expected


def test_log_and_file_versions_compare_equal():
    log = nccl_log.parse(real_text(A100))
    assert set(log.versions) == {nccl_log.parse_version("(2, 10, 3)\n").version}
    assert set(log.versions) == {nccl_log.parse_version("21003\n").version}


def test_detect_version_is_strict():
    assert nccl_log.detect_version("(2, 18, 5)\n") >= 0.9
    assert nccl_log.detect_version("21805\n") < 0.5  # a bare number is a weak guess
    assert nccl_log.detect_version("12345\n") == 0.0
    assert nccl_log.detect_version("28.39.1002\n") == 0.0  # an HCA firmware version
    assert nccl_log.detect_version("2.18.5\n" * 10) == 0.0  # not a tiny file


# -- registration and summaries ------------------------------------------------------------


def test_kinds_registered():
    assert {"nccl-log", "nccl-version"} <= set(kind_names())
    log_kind, version_kind = get_kind("nccl-log"), get_kind("nccl-version")
    assert log_kind is not None and log_kind.streaming and log_kind.parse is nccl_log.parse
    assert version_kind is not None and "torch.cuda.nccl.version()" in (version_kind.command or "")


def test_summaries_name_what_matters():
    lines = nccl_log.summarize(nccl_log.parse(real_text(WATCHDOG)))
    assert any("watchdog_timeout: 1 (lines 1)" in line for line in lines)
    assert any("desync: 1 (lines 4)" in line for line in lines)
    assert nccl_log.summarize_version(nccl_log.parse_version("(2, 18, 5)")) == ["NCCL 2.18.5 (line 1: (2, 18, 5))"]
    assert "32 NCCL processes on 4 hosts, ranks 0-31 of 32" in nccl_log.summarize(nccl_log.parse(real_text(A100)))[0]


def test_synthetic_readme_names_every_file():
    readme = (SYNTHETIC / "nccl" / "README.md").read_text(encoding="utf-8")
    for path in (SYNTHETIC / "nccl").iterdir():
        if path.name != "README.md":
            assert f"`{path.name}`" in readme, path.name


# -- never raises --------------------------------------------------------------------------

GOOD_BEFORE = "h1:11:12 [0] NCCL INFO comm 0x1 rank 0 nranks 2 cudaDev 0 busId 1000 - Init COMPLETE"
GOOD_AFTER = "h2:21:22 [1] NCCL INFO comm 0x2 rank 1 nranks 2 cudaDev 1 busId 2000 - Init COMPLETE"


@given(st.text(max_size=3000), st.one_of(st.none(), st.integers(min_value=-5, max_value=20000)))
def test_parse_never_raises(text, year):
    log = nccl_log.parse(text, year=year)
    assert isinstance(log.events, list) and isinstance(log.processes, dict)
    nccl_log.summarize(log)


@given(st.text(max_size=500))
def test_good_lines_around_a_bad_one_survive(bad):
    log = nccl_log.parse([GOOD_BEFORE, bad, GOOD_AFTER])
    assert log.processes["h1:11"].rank == 0
    assert log.processes["h2:21"].rank == 1
    assert log.lines == 3


@given(st.text(max_size=300))
def test_warn_followed_by_anything_keeps_the_warn(bad):
    warn = "h1:11:12 [0] x.cc:1 NCCL WARN NET/IB : Got completion from peer 10.0.0.2<5> with error 12, opcode 0"
    log = nccl_log.parse([warn, bad, GOOD_AFTER])
    assert log.events[0].line == 1 and log.events[0].kind == "ib_completion_error"
    assert log.processes["h2:21"].rank == 1


@given(st.text(max_size=2000))
def test_version_parsing_and_detection_never_raise(text):
    result = nccl_log.parse_version(text)
    assert result.version is None or nccl_log.normalise_version(result.version) == result.version
    assert 0.0 <= nccl_log.detect(text) <= 1.0
    assert 0.0 <= nccl_log.detect_version(text) <= 1.0
    nccl_log.summarize_version(result)


def test_last_error_line_is_read_in_context():
    text = "\n".join([
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
        "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3",
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. ",
        "Last error:",
        "socketStartConnect: Connect to 10.0.0.2<43523> failed : Software caused connection abort",
    ])
    log = nccl_log.parse(text)
    system, connection = log.events
    assert system.kind == "system_error" and system.details["nccl_version"] == "2.19.3"
    assert system.details["error_type"] == "torch.distributed.DistBackendError"
    assert connection.kind == "connection_error" and connection.line == 4
    assert connection.details["reason"] == "Software caused connection abort"
    assert connection.details["peer"] == "10.0.0.2"
    assert log.versions == {"2.19.3": {""}}

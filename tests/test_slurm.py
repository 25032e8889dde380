"""Slurm: scontrol show node (indented, stripped, one-line) and sinfo -R (fixed-width columns)."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given, strategies as st

from spikeops.probes import slurm
from tests.conftest import real_text, synthetic_text

IRUSH = "slurm/scontrol-show-node-gpu-allocated-and-idle-drain-reason_irush-cs.txt"
BAMBOO = "slurm/scontrol-show-node-rtx5090-idle-drain-health-blocked_unige-bamboo.txt"
TWCC = "slurm/scontrol-show-node-8gpu-idle-drain-node-switch_twcc.txt"
BAOBAB = "slurm/sinfo-R-gpu-gres-mismatch-drains_unige-baobab.txt"
ONE_LINE = "slurm/scontrol-o-show-node-3-nodes-spikeops-drain.txt"


def test_irush_allocated_gpu_node_and_drained_node():
    result = slurm.parse_show_node(real_text(IRUSH))
    assert [n.name for n in result.nodes] == ["dumfries-002", "oxygen-04"]
    busy, drained = result.nodes
    assert busy.state == "ALLOCATED" and busy.base_state == "ALLOCATED" and busy.flags == frozenset()
    assert busy.gres == "gpu:rtx2080:4"
    assert busy.gres_used == "gpu:rtx2080:4(IDX:0-3)"
    assert (busy.cpus_total, busy.cpus_alloc) == (32, 32)
    assert (busy.real_memory_mb, busy.alloc_memory_mb) == (128586, 69632)
    assert busy.partitions == ["short", "medium", "killable"]
    assert busy.reason is None and busy.reason_line is None
    assert busy.version == "17.11"
    assert busy.boot_time == datetime(2019, 1, 28, 15, 51, 33, tzinfo=UTC)
    assert busy.slurmd_start_time == datetime(2019, 1, 28, 15, 57, 24, tzinfo=UTC)
    # a value with spaces and '#' stays whole; the trailing space Slurm prints is dropped
    assert busy.fields["OS"] == "Linux 4.14.61-aufs-1 #1 SMP Tue Aug 7 18:13:22 IDT 2018"
    assert busy.fields["AllocTRES"] == "cpu=32,mem=68G,gres/gpu=4"
    assert busy.fields["CPULoad"] == "24.95"
    assert busy.line == 1

    assert drained.state == "IDLE+DRAIN"
    assert (drained.base_state, drained.flags) == ("IDLE", frozenset({"DRAIN"}))
    assert drained.drained and not drained.down and not drained.drained_by_spikeops
    assert drained.reason == "memory issues?"
    assert drained.reason_user == "root"
    assert drained.reason_time == datetime(2019, 1, 29, 10, 42, 12, tzinfo=UTC)
    assert drained.gres is None  # Gres=(null)
    assert drained.gres_used == "gpu:0"
    assert drained.cpus_total == 48 and drained.real_memory_mb == 257855
    assert drained.fields["AllocTRES"] == ""
    assert drained.fields["Reason"] == "memory issues? [root@2019-01-29T10:42:12]"
    assert (drained.line, drained.reason_line) == (22, 41)
    assert result.gaps == []
    assert [n.name for n in result.unavailable()] == ["oxygen-04"]


def test_bamboo_stripped_indentation_and_prompts():
    result = slurm.parse_show_node(real_text(BAMBOO))
    assert result.gaps == []  # the two prompt lines are not nodes and not gaps
    assert [n.name for n in result.nodes] == ["gpu010", "gpu009"]
    gpu010, gpu009 = result.nodes
    assert gpu010.line == 2 and gpu009.line == 20
    for node in result.nodes:
        assert node.state == "IDLE+DRAIN"
        assert node.reason == "health_ps___blocked"
        assert node.reason_user == "root"
        assert node.gres == "gpu:nvidia_geforce_rtx_5090:4(S:0-3),VramPerGpu:no_consume:32G"
        assert node.partitions == ["private-kalousis-gpu", "shared-gpu"]
        assert (node.cpus_total, node.cpus_alloc) == (96, 0)
        assert node.fields["CPUEfctv"] == "94"
        assert node.real_memory_mb == 384000
        assert node.version == "25.11.3"
        assert node.fields["ResumeAfterTime"] == "None"
        assert node.fields["CfgTRES"] == "cpu=94,mem=375G,billing=231,gres/gpu=4,gres/gpu:nvidia_geforce_rtx_5090=4"
    assert gpu010.reason_time == datetime(2026, 4, 29, 3, 6, 18, tzinfo=UTC)
    assert gpu009.reason_time == datetime(2026, 4, 29, 3, 0, 18, tzinfo=UTC)
    assert gpu009.slurmd_start_time == datetime(2026, 3, 31, 13, 59, 24, tzinfo=UTC)
    summary = slurm.summarize_show_node(result)
    assert summary[0] == "2 nodes: IDLE+DRAIN gpu[009-010]"
    assert "gpu[009-010] IDLE+DRAIN: 'health_ps___blocked' by root" in summary[1]
    assert "2026-04-29T03:00:18Z..2026-04-29T03:06:18Z" in summary[1]


def test_twcc_8gpu_node_after_prompt():
    result = slurm.parse_show_node(real_text(TWCC))
    assert result.gaps == []
    (node,) = result.nodes
    assert node.name == "gn0101.twcc.ai" and node.line == 2
    assert node.gres == "gpu:8"
    assert (node.cpus_total, node.cpus_alloc) == (36, 0)
    assert node.real_memory_mb == 772437
    assert node.partitions == ["SlurmDefault"]
    assert node.reason == "node-switch"
    assert node.reason_time == datetime(2018, 11, 23, 12, 49, 3, tzinfo=UTC)
    assert node.reason_line == 19
    assert node.fields["OS"] == "Linux 3.10.0-862.el7.x86_64 #1 SMP Fri Apr 20 16:44:24 UTC 2018"
    assert node.fields["CPUSpecList"] == "0-1"
    assert node.fields["ExtSensorsJoules"] == "n/s"


def test_one_line_form_with_spikeops_drain():
    result = slurm.parse_show_node(synthetic_text(ONE_LINE))
    assert result.gaps == []
    nodes = result.by_name()
    assert list(nodes) == ["gpu-001", "gpu-002", "gpu-003"]
    mine = nodes["gpu-001"]
    assert (mine.base_state, mine.flags) == ("MIXED", frozenset({"DRAIN"}))
    assert mine.reason == "spikeops: gpu_xid inc-20261129T180312Z-4412"
    assert mine.reason_time == datetime(2026, 11, 29, 18, 4, 10, tzinfo=UTC)
    assert mine.drained_by_spikeops
    assert mine.fields["OS"] == "Linux 5.15.0-119-generic #129-Ubuntu SMP Fri Aug 2 19:25:20 UTC 2024"
    assert mine.partitions == ["train", "debug"]
    assert (mine.cpus_alloc, mine.alloc_memory_mb) == (64, 1048576)
    assert mine.reason_line == mine.line == 1
    down = nodes["gpu-002"]
    assert (down.base_state, down.flags) == ("DOWN", frozenset({"NOT_RESPONDING"}))
    assert down.down and not down.drained
    assert (down.reason, down.reason_user) == ("Not responding", "slurm")
    assert down.fields["FreeMem"] == "N/A"
    busy = nodes["gpu-003"]
    assert busy.state == "ALLOCATED" and busy.reason is None and busy.fields["AllocTRES"].endswith("gres/gpu=8")
    summary = slurm.summarize_show_node(result)
    assert any("gpu-001 MIXED+DRAIN" in line and line.endswith("[spikeops]") for line in summary)


def test_reason_may_contain_key_like_text_and_comment_follows():
    line = ("NodeName=n1 CPUAlloc=0 CPUTot=8 State=IDLE+DRAIN Partitions=p "
            "Reason=NHC: Check=mounts failed [admin@2026-01-02T03:04:05] Comment=Ticket=42 see wiki")
    (node,) = slurm.parse_show_node(line).nodes
    assert node.reason == "NHC: Check=mounts failed"
    assert node.reason_user == "admin"
    assert node.fields["Comment"] == "Ticket=42 see wiki"


def test_multi_line_reason_continues_on_deeper_indent():
    text = ("NodeName=n2 Arch=x86_64 CoresPerSocket=4\n"
            "   CPUAlloc=0 CPUTot=8 CPULoad=0.00\n"
            "   State=DOWN+DRAIN ThreadsPerCore=1\n"
            "   Reason=first line [root@2026-01-02T03:04:05]\n"
            "          second line\n")
    (node,) = slurm.parse_show_node(text).nodes
    assert node.reason == "first line\nsecond line"
    assert node.reason_time == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_error_lines_become_gaps_and_nodes_survive():
    text = "Node gpu999 not found\n" + real_text(TWCC)
    result = slurm.parse_show_node(text)
    assert [n.name for n in result.nodes] == ["gn0101.twcc.ai"]
    assert result.gaps[0].line == 1 and "gpu999" in result.gaps[0].reason


def test_baobab_sinfo_reasons():
    result = slurm.parse_sinfo_reasons(real_text(BAOBAB))
    assert result.gaps == []
    assert len(result.rows) == 10
    first = result.rows[0]
    assert (first.reason, first.truncated, first.user) == ("issue-5894", False, "root")
    assert first.time == datetime(2025, 4, 2, 16, 1, 38, tzinfo=UTC)
    assert first.nodes == ["cpu242"] and first.line == 3
    gres = result.rows[5]
    assert gres.reason == "gres/gpu GRES core s" and gres.truncated and gres.user == "slurm"
    assert gres.nodelist == "gpu[004-009]"
    assert gres.nodes == ["gpu004", "gpu005", "gpu006", "gpu007", "gpu008", "gpu009"]
    big = result.rows[8]
    assert big.nodelist == "gpu[013-017,021-026,034-044,046-049]"
    assert len(big.nodes) == 26 and big.nodes[0] == "gpu013" and big.nodes[-1] == "gpu049"
    assert "gpu030" not in big.nodes
    assert len(result.rows[9].nodes) == 10
    assert sum(row.reason == "gres/gpu count repor" for row in result.rows) == 2
    assert len(result.nodes()) == 49
    summary = slurm.summarize_sinfo_reasons(result)
    assert summary[0] == "10 reasons over 49 nodes"
    assert any(line.startswith("  gres/gpu GRES core s… by slurm") and "gpu[004-009,011,013-049] (44 nodes)" in line
               for line in summary)


def test_sinfo_spikeops_reason_and_unknown_time():
    result = slurm.parse_sinfo_reasons(synthetic_text("slurm/sinfo-R-spikeops-drain.txt"))
    assert result.gaps == []
    mine = result.rows[0]
    assert mine.reason == "spikeops: gpu_xid in" and mine.truncated
    assert slurm.is_spikeops_reason(mine.reason)
    assert [slurm.is_spikeops_reason(r.reason) for r in result.rows] == [True, False, False, False]
    assert result.rows[2].nodes == ["gpu-017", "gpu-018", "gpu-019", "gpu-023"]
    unknown = result.rows[3]
    assert unknown.time is None and unknown.reason == "rack power work" and not unknown.truncated
    assert len(unknown.nodes) == 8


def test_sinfo_custom_widths_by_header():
    result = slurm.parse_sinfo_reasons(synthetic_text("slurm/sinfo-R-o-wide-reason-state.txt"))
    assert result.gaps == []
    mine, gres = result.rows
    assert mine.reason == "spikeops: gpu_xid inc-20261129T180312Z-4412" and not mine.truncated
    assert (mine.user, mine.state) == ("root(0)", "drng")
    assert gres.reason == "gres/gpu count reported lower than configured (7 <" and gres.truncated
    assert gres.user == "slurm(64030)" and gres.state == "drain"
    assert gres.nodes == ["gpu-005", "gpu-006"]


def test_sinfo_without_header_uses_default_layout():
    text = "\n".join(real_text(BAOBAB).splitlines()[2:])  # as printed by sinfo -R -h
    result = slurm.parse_sinfo_reasons(text)
    assert len(result.rows) == 10 and result.rows[3].truncated


def test_huge_or_bad_node_lists_are_gaps_not_crashes():
    nodes, problem = slurm.expand_nodelist("gpu[0-999999999]")
    assert nodes == [] and problem is not None and "expands past" in problem
    nodes, problem = slurm.expand_nodelist("gpu[013-")
    assert nodes == [] and problem is not None
    assert slurm.expand_nodelist("a[1-3],b[1-2]") == (["a1", "a2", "a3", "b1", "b2"], None)


def test_is_spikeops_reason():
    assert slurm.REASON_PREFIX == "spikeops:"
    assert slurm.is_spikeops_reason("spikeops: gpu_xid inc-1")
    assert slurm.is_spikeops_reason("  spikeops:x")
    assert not slurm.is_spikeops_reason("Spikeops: x")
    assert not slurm.is_spikeops_reason("drained by spikeops: x")
    assert not slurm.is_spikeops_reason(None)


def test_detect():
    for name in (IRUSH, BAMBOO, TWCC):
        assert slurm.detect_show_node(real_text(name)) > 0.9
        assert slurm.detect_sinfo_reasons(real_text(name)) == 0.0
    assert slurm.detect_show_node(synthetic_text(ONE_LINE)) > 0.9
    assert slurm.detect_sinfo_reasons(real_text(BAOBAB)) > 0.9
    assert slurm.detect_show_node(real_text(BAOBAB)) == 0.0
    assert slurm.detect_show_node("NodeName=gpu[001-010] CPUs=64 RealMemory=500000\n") < 0.5  # slurm.conf


@given(st.text(max_size=2000))
def test_show_node_never_raises(text):
    result = slurm.parse_show_node(text)
    assert isinstance(result.nodes, list)
    slurm.summarize_show_node(result)


@given(st.text(max_size=2000))
def test_sinfo_never_raises(text):
    result = slurm.parse_sinfo_reasons(text)
    assert isinstance(result.rows, list)
    slurm.summarize_sinfo_reasons(result)


_LINE = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"), max_size=120)


@given(_LINE)
def test_bad_line_keeps_the_nodes_around_it(junk):
    text = real_text(IRUSH).rstrip("\n") + "\n" + junk + "\n\n" + real_text(TWCC)
    names = [n.name for n in slurm.parse_show_node(text).nodes]
    assert names[0] == "dumfries-002" and names[-1] == "gn0101.twcc.ai"


@given(_LINE)
def test_bad_row_keeps_the_sinfo_rows_around_it(junk):
    lines = real_text(BAOBAB).splitlines()
    result = slurm.parse_sinfo_reasons("\n".join(lines[:5] + [junk] + lines[5:]))
    reasons = [(r.line, r.nodelist) for r in result.rows]
    assert (3, "cpu242") in reasons and (13, "gpu[018-020,027-029,031-033,045]") in reasons


def test_show_job_one_line_form_with_every_kind_of_key():
    from spikeops.probes.slurm import parse_show_job

    text = ("JobId=3 JobName=j.sh UserId=root(0) JobState=RUNNING Reason=None Requeue=1 BatchFlag=1 "
            "NodeList=node[001-002] Partition=debug AllocNode:Sid=localhost:27100 ReqNodeList=(null) "
            "ExcNodeList=node004 Socks/Node=* WorkDir=/tmp Comment=spikeops-resume:3:ab12 Command=/tmp/j.sh")
    job = parse_show_job(text)[0]
    assert (job.job_id, job.state, job.partition, job.nodes) == ("3", "RUNNING", "debug", ["node001", "node002"])
    assert job.fields["AllocNode:Sid"] == "localhost:27100" and job.fields["ExcNodeList"] == "node004"
    assert job.comment == "spikeops-resume:3:ab12" and job.requeue and job.batch and not job.finished
    assert parse_show_job("JobId=4 JobState=CANCELLED Reason=None NodeList=(null)")[0].finished

"""Reading hostile evidence files: binary, empty, gzip, mixed encodings, NULs, huge lines."""

from __future__ import annotations

import gzip

import pytest

from spikeops.errors import InputError
from spikeops.textio import MAX_LINE_BYTES, ReadReport, iter_lines, read_text, sniff


def test_binary_file_is_refused_with_one_line(tmp_path):
    path = tmp_path / "core"
    path.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(InputError) as info:
        sniff(path)
    assert "binary" in str(info.value)
    assert "\n" not in str(info.value)


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    with pytest.raises(InputError, match="empty"):
        sniff(empty)
    with pytest.raises(InputError, match="no such file"):
        sniff(tmp_path / "absent.log")
    with pytest.raises(InputError, match="directory"):
        sniff(tmp_path)


def test_gzip_is_read_transparently(tmp_path):
    path = tmp_path / "kern.log.gz"
    path.write_bytes(gzip.compress(b"line one\nline two\n"))
    head, report = sniff(path)
    assert head.startswith("line one")
    assert report.compressed
    assert list(iter_lines(path)) == ["line one", "line two"]


def test_latin1_lines_are_kept_and_counted(tmp_path):
    path = tmp_path / "mixed.log"
    path.write_bytes("ok ü\n".encode() + b"caf\xe9 latin-1\n" + b"last\n")
    report = ReadReport(path=str(path))
    lines = list(iter_lines(path, report))
    assert lines == ["ok ü", "café latin-1", "last"]
    assert report.recoded_lines == 1
    assert any("Latin-1" in gap.reason for gap in report.gaps())


def test_nul_runs_from_a_crash_are_dropped_and_reported(tmp_path):
    path = tmp_path / "crashed.log"
    path.write_bytes(b"before\n" + b"\x00" * 100 + b"after\n")
    report = ReadReport(path=str(path))
    assert list(iter_lines(path, report)) == ["before", "after"]
    assert report.nul_lines == 1


def test_overlong_line_is_cut_and_following_lines_survive(tmp_path):
    path = tmp_path / "long.log"
    path.write_bytes(b"a" * (MAX_LINE_BYTES * 2 + 10) + b"\nnext\n")
    report = ReadReport(path=str(path))
    lines = list(iter_lines(path, report))
    assert lines[-1] == "next"
    assert len(lines) == 2
    assert report.long_lines == 1


def test_truncated_last_line_is_still_read(tmp_path):
    path = tmp_path / "cut.log"
    path.write_bytes(b"one\ntwo half")
    report = ReadReport(path=str(path))
    assert list(iter_lines(path, report)) == ["one", "two half"]
    assert report.unterminated_last_line


def test_document_size_cap_is_reported(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"x" * 99 + b"\n" + b"y" * 99 + b"\n" + b"z\n")
    report = ReadReport(path=str(path))
    text = read_text(path, report, max_bytes=150)
    assert text.startswith("x" * 99)
    assert "z" not in text
    assert report.truncated_at is not None
    assert any("first" in gap.reason for gap in report.gaps())


def test_progress_callback_is_called_for_long_files(tmp_path, monkeypatch):
    import spikeops.textio as textio

    monkeypatch.setattr(textio, "PROGRESS_EVERY", 10)
    path = tmp_path / "many.log"
    path.write_bytes(b"line\n" * 35)
    seen = []
    list(textio.iter_lines(path, progress=lambda report: seen.append(report.lines)))
    assert seen == [10, 20, 30]

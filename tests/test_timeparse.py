"""Timestamps as tools print them, on one UTC clock."""

from __future__ import annotations

from datetime import UTC, datetime

from spikeops.timeparse import iso, parse_any, parse_ctime, parse_iso, parse_syslog


def test_dmesg_iso_with_comma_fraction_and_offset():
    assert parse_iso("2025-01-21T02:21:33,498559+00:00") == datetime(2025, 1, 21, 2, 21, 33, 498559, tzinfo=UTC)
    assert parse_iso("2025-01-21T04:21:33+02:00") == datetime(2025, 1, 21, 2, 21, 33, tzinfo=UTC)
    assert parse_iso("2026-11-29T18:01:02.5+0000") == datetime(2026, 11, 29, 18, 1, 2, 500000, tzinfo=UTC)


def test_zoneless_times_are_utc():
    assert parse_iso("2026-11-29 18:01:02") == datetime(2026, 11, 29, 18, 1, 2, tzinfo=UTC)


def test_ctime_and_syslog():
    assert parse_ctime("Sun Feb 23 16:24:18 2025") == datetime(2025, 2, 23, 16, 24, 18, tzinfo=UTC)
    assert parse_syslog("Jan  3 07:39:44", None) is None  # no year: unknown, not guessed
    assert parse_syslog("Jan  3 07:39:44", 2025) == datetime(2025, 1, 3, 7, 39, 44, tzinfo=UTC)


def test_bundle_time_field_accepts_iso_and_unix():
    assert parse_any(1764439262) == datetime(2025, 11, 29, 18, 1, 2, tzinfo=UTC)
    assert parse_any("1764439262.5") == datetime(2025, 11, 29, 18, 1, 2, 500000, tzinfo=UTC)
    assert parse_any("2026-11-29T18:01:02Z") == datetime(2026, 11, 29, 18, 1, 2, tzinfo=UTC)
    assert parse_any("yesterday") is None
    assert parse_any(True) is None


def test_iso_writes_z():
    assert iso(datetime(2026, 11, 29, 18, 1, 2, tzinfo=UTC)) == "2026-11-29T18:01:02Z"
    assert iso(None) is None


def test_invalid_dates_are_none_not_errors():
    assert parse_iso("2026-02-30T00:00:00") is None
    assert parse_ctime("Sun Feb 30 16:24:18 2025") is None


def test_calendar_edges_are_none_not_overflow():
    assert parse_iso("9999-12-31T23:59:59-01:00") is None
    assert parse_iso("0001-01-01T00:00:00+01:00") is None

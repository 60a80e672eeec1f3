"""Byte sizes: exact decimal parsing and the shortest exact formatting."""

import pytest

from actplan.planning.planner import parse_budget
from actplan.sizes import format_bytes, parse_bytes, rounding_note


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("2.01KB", 2010),  # 2.01 * 1000 is 2009.9999999999998 in binary floats
        ("0.29KB", 290),
        ("1.1MB", 1_100_000),
        ("4.35GB", 4_350_000_000),
        ("1.5GB", 1_500_000_000),
        ("0.5KiB", 512),
        ("64KiB", 65536),
        ("40GiB", 40 * 2**30),
        (".5KB", 500),
        ("7.", 7),
        (" 12 B ", 12),
        ("3tb", 3 * 10**12),
    ],
)
def test_parse_bytes_is_exact(text, nbytes):
    assert parse_bytes(text) == nbytes


def test_parse_bytes_ints_and_whole_floats():
    assert parse_bytes(0) == 0
    assert parse_bytes(65536) == 65536
    assert parse_bytes(1024.0) == 1024


@pytest.mark.parametrize("text", ["1.5B", "0.1KiB", "2.0001KB"])
def test_fractions_of_a_byte_are_refused(text):
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_bytes(text)


def test_a_budget_that_comes_to_a_fraction_of_a_byte_is_rounded_down_and_said():
    # 71.96 GiB is 77,266,461,655.04 bytes: a user means about that much.
    assert parse_bytes("71.96GiB", round_down=True) == 77_266_461_655
    assert parse_bytes(1.5, round_down=True) == 1
    assert rounding_note("71.96GiB") == (
        "71.96GiB is 77,266,461,655.04 bytes; taken as 77,266,461,655, rounded down to whole bytes"
    )
    assert rounding_note("40GiB") is None and rounding_note(1024) is None
    assert rounding_note("nonsense") is None
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_bytes("71.96GiB")  # where whole bytes are the rule (offload sizes), still refused
    assert parse_budget("71.96GiB") == 77_266_461_655


@pytest.mark.parametrize("value", [-1.0, 1.5, float("inf"), float("nan")])
def test_bad_floats_are_refused_with_the_rule(value):
    with pytest.raises(ValueError, match="not a whole, non-negative number of bytes"):
        parse_bytes(value)


@pytest.mark.parametrize("value", ["12 parsecs", "-5KB", "KB", ""])
def test_unreadable_text_names_the_units(value):
    with pytest.raises(ValueError, match="KiB, MiB, GiB, TiB"):
        parse_bytes(value)


def test_negative_int_and_other_types():
    with pytest.raises(ValueError, match="negative"):
        parse_bytes(-3)
    with pytest.raises(ValueError, match="got True"):
        parse_bytes(True)
    with pytest.raises(ValueError, match="got list"):
        parse_bytes([1])


def test_format_round_trips():
    for nbytes in (0, 1000, 65536, 3 * 2**30, 5 * 2**40 + 2**20):
        assert parse_bytes(str(format_bytes(nbytes))) == nbytes

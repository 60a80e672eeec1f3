import pytest

from actplan.units import (
    UNIT_DESCRIPTIONS,
    MarkerInterval,
    RecomputeIntervalMap,
    RecomputeUnit,
    parse_unit,
)


def test_every_unit_is_documented():
    assert set(UNIT_DESCRIPTIONS) == set(RecomputeUnit)
    assert all(len(text) > 40 for text in UNIT_DESCRIPTIONS.values())


def test_unit_round_trips_through_its_string():
    for unit in RecomputeUnit:
        assert parse_unit(unit.value) is unit
        assert str(unit) == unit.value


def test_unknown_unit_lists_valid_units():
    with pytest.raises(ValueError, match="unknown recompute unit 'attn_cor'") as err:
        parse_unit("attn_cor")
    assert "attn_core" in str(err.value) and "mlp_up" in str(err.value)


@pytest.mark.parametrize("start,end", [("a", "a"), ("", "b"), ("a", None)])
def test_bad_intervals_are_rejected(start, end):
    with pytest.raises(ValueError):
        MarkerInterval(start, end)


def test_interval_map_accepts_strings_and_lists():
    imap = RecomputeIntervalMap(
        {
            "attn_core": MarkerInterval("a", "b"),
            RecomputeUnit.MLP_ACT: [MarkerInterval("c", "d"), MarkerInterval("e", "f")],
        }
    )
    assert imap.units == (RecomputeUnit.ATTN_CORE, RecomputeUnit.MLP_ACT)
    assert imap["mlp_act"] == (MarkerInterval("c", "d"), MarkerInterval("e", "f"))
    assert imap.markers == frozenset("abcdef")
    assert imap.intervals_of(["attn_core"]) == frozenset({MarkerInterval("a", "b")})
    assert imap.unit_of(MarkerInterval("e", "f")) is RecomputeUnit.MLP_ACT
    assert hash(imap) == hash(RecomputeIntervalMap(dict(imap)))


def test_interval_map_rejects_shared_interval_and_empty():
    with pytest.raises(ValueError, match="declared for both"):
        RecomputeIntervalMap({"attn_core": MarkerInterval("a", "b"), "mlp_act": MarkerInterval("a", "b")})
    with pytest.raises(ValueError, match="at least one unit; declare one"):
        RecomputeIntervalMap({})
    with pytest.raises(ValueError, match="no intervals; give it at least one MarkerInterval"):
        RecomputeIntervalMap({"attn_core": []})
    with pytest.raises(ValueError, match="unknown recompute unit"):
        RecomputeIntervalMap({"bogus": MarkerInterval("a", "b")})

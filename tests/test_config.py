"""RecomputeConfig: selectors, presets, validation errors and file round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from actplan.config import (
    PRESETS,
    ConfigError,
    LayerOverride,
    LayerSelector,
    RecomputeConfig,
)
from actplan.config._errors import format_field_path
from actplan.units import RecomputeUnit

ALL_UNIT_NAMES = [u.value for u in RecomputeUnit]


def config_error(data: object) -> str:
    with pytest.raises(ConfigError) as info:
        RecomputeConfig.from_dict(data)  # type: ignore[arg-type]
    return str(info.value)


# ---------------------------------------------------------------------------------------
# Layer selectors


@pytest.mark.parametrize(
    ("selector", "num_layers", "expected"),
    [
        ("all", 4, (0, 1, 2, 3)),
        ("none", 4, ()),
        (2, 4, (2,)),
        (0, 1, (0,)),
        ("0-3", 8, (0, 1, 2, 3)),
        ("5", 8, (5,)),
        ("0-3,8,10-11", 12, (0, 1, 2, 3, 8, 10, 11)),
        (" 1 - 2 , 4 ", 5, (1, 2, 4)),
        ([7, "0-1", 3, 1], 8, (0, 1, 3, 7)),
        (["2-3,5"], 6, (2, 3, 5)),
        ({"every": 3}, 10, (0, 3, 6, 9)),
        ({"every": 3, "offset": 1}, 10, (1, 4, 7)),
        ({"every": 1}, 3, (0, 1, 2)),
        ({"first": 2}, 5, (0, 1)),
        ({"last": 2}, 5, (3, 4)),
        ({"last": 5}, 5, (0, 1, 2, 3, 4)),
    ],
)
def test_selector_resolves_to_sorted_unique_indices(selector, num_layers, expected):
    assert LayerSelector(selector).resolve(num_layers) == expected


@pytest.mark.parametrize(
    ("selector", "message_parts"),
    [
        ("5-2", ["'5-2'", "reversed", "write '2-5'"]),
        ("-1", ["'-1'", "negative", "last: K"]),
        (-3, ["-3", "negative"]),
        ("0-3,,5", ["''", "not a layer index or range", "'0-11'"]),
        ("1:3", ["'1:3'", "not a layer index or range"]),
        ("everything", ["'everything'", "not a layer index"]),
        ([], ["selects no layers", "'none'"]),
        ([1, "x"], ["'x'", "not a layer index"]),
        ([1, -2], ["-2", "negative"]),
        ([1, 2.5], ["2.5", "neither a layer index nor a range string"]),
        (True, ["True", "unsupported form", "{every: N}"]),
        (1.5, ["1.5", "unsupported form"]),
        ({"every": 0}, ["every: 0", "at least 1", "layers: none"]),
        ({"every": -2}, ["every: -2", "at least 1"]),
        ({"every": 2, "offset": -1}, ["offset: -1", "negative"]),
        ({"every": "2"}, ["every: '2'", "integer"]),
        ({"first": 0}, ["first: 0", "selects no layers"]),
        ({"last": 0}, ["last: 0", "selects no layers"]),
        ({"every": 2, "first": 1}, ["['every', 'first']", "{first: K}"]),
        ({"each": 2}, ["['each']", "{every: N}"]),
    ],
)
def test_malformed_selector_is_rejected_at_parse_time(selector, message_parts):
    message = config_error({"layers": selector})
    assert message.splitlines()[1].lstrip().startswith("layers:")
    for part in message_parts:
        assert part in message


@pytest.mark.parametrize(
    ("selector", "num_layers", "message_parts"),
    [
        (8, 8, ["layer index 8", "8 layers", "0-7"]),
        ("0-3,12", 12, ["layer index 12", "12 layers", "0-11"]),
        ("2-40", 32, ["layer index 40", "32 layers"]),
        ([1, 9], 4, ["layer index 9", "4 layers"]),
        ({"every": 2, "offset": 6}, 6, ["offset 6", "6 layers"]),
        ({"first": 9}, 8, ["first: 9", "(8)", "first: 8 or less"]),
        ({"last": 9}, 8, ["last: 9", "(8)"]),
    ],
)
def test_out_of_range_selector_is_rejected_at_resolve_time(selector, num_layers, message_parts):
    selector = LayerSelector(selector)  # parses fine: the model size is not known yet
    with pytest.raises(ConfigError) as info:
        selector.resolve(num_layers)
    for part in message_parts:
        assert part in str(info.value)


def test_selector_resolving_to_nothing_is_an_error_unless_it_is_none():
    assert LayerSelector("none").resolve(0) == ()
    with pytest.raises(ConfigError, match="selects no layers of a model with 0"):
        LayerSelector("all").resolve(0)


def test_selector_keeps_the_form_the_user_wrote():
    assert LayerSelector((3, "0-1")).root == [3, "0-1"]
    assert RecomputeConfig.from_dict({"layers": "0-3,8"}).to_dict() == {"layers": "0-3,8"}
    assert RecomputeConfig.from_dict({"layers": {"every": 2, "offset": 0}}).to_dict() == {
        "layers": {"every": 2, "offset": 0}
    }


# ---------------------------------------------------------------------------------------
# Modes, presets, keep and recompute


def test_defaults_are_full_checkpointing_of_every_layer():
    config = RecomputeConfig.from_dict({})
    assert (config.mode, config.preset, config.keep, config.recompute) == ("full", None, None, None)
    assert config.layers.root == "all"
    assert config.overrides == ()


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_sets_its_mode(name):
    config = RecomputeConfig.from_preset(name)
    assert config.preset == name
    assert config.mode == PRESETS[name].mode
    assert config.to_dict() == {"preset": name}


def test_preset_contents():
    U = RecomputeUnit
    assert PRESETS["none"].mode == "none"
    assert PRESETS["full"].mode == "full"
    assert PRESETS["attn"].kept_units == (U.ATTN_CORE,)
    assert set(PRESETS["matmuls"].kept_units or ()) == {
        U.QKV_PROJ,
        U.ATTN_CORE,
        U.ATTN_PROJ,
        U.MLP_UP,
        U.MOE_EXPERTS,
        U.SHARED_EXPERTS,
        U.MOE_ROUTER,
    }
    assert U.MLP_DOWN not in (PRESETS["matmuls"].kept_units or ())
    assert PRESETS["megatron-selective"].recomputed_units == (U.ATTN_CORE,)
    assert PRESETS["megatron-selective"].kept_units is None
    for name, spec in PRESETS.items():
        assert spec.description, name
        if spec.mode == "selective":
            assert (spec.kept_units is None) != (spec.recomputed_units is None), name


def test_preset_with_agreeing_mode_is_accepted_and_dumped_minimally():
    config = RecomputeConfig.from_dict({"preset": "attn", "mode": "selective"})
    assert config == RecomputeConfig.from_preset("attn")
    assert config.to_dict() == {"preset": "attn"}


def test_unknown_preset_lists_valid_presets():
    with pytest.raises(ConfigError) as info:
        RecomputeConfig.from_preset("fast")
    assert "'fast'" in str(info.value)
    for name in PRESETS:
        assert name in str(info.value)
    message = config_error({"preset": "fast"})
    assert "preset:" in message and "'megatron-selective'" in message


def test_keep_is_parsed_into_units_in_the_order_given():
    config = RecomputeConfig.from_dict({"mode": "selective", "keep": ["mlp_up", "attn_core"]})
    assert config.keep == (RecomputeUnit.MLP_UP, RecomputeUnit.ATTN_CORE)
    assert config.recompute is None


def test_keep_or_recompute_without_mode_implies_selective():
    assert RecomputeConfig.from_dict({"keep": ["attn_core"]}).mode == "selective"
    assert RecomputeConfig.from_dict({"recompute": ["attn_core"]}).mode == "selective"


@pytest.mark.parametrize(
    ("data", "start"),
    [
        ({"mode": "selective"}, "mode: selective with no keep, recompute or preset keeps nothing"),
        ({"keep": []}, "keep: [] keeps nothing"),
        ({"mode": "selective", "keep": []}, "keep: [] keeps nothing"),
        ({"overrides": [{"layers": 0, "mode": "selective"}]}, "mode: selective with no keep"),
    ],
)
def test_selective_that_keeps_nothing_is_an_error(data, start):
    with pytest.raises(ConfigError, match="invalid recompute config") as info:
        RecomputeConfig.from_dict(data)
    message = str(info.value)
    assert start in message
    assert "keep: [units]" in message and "mode: full" in message


def test_recompute_of_nothing_is_allowed_and_keeps_everything():
    config = RecomputeConfig.from_dict({"recompute": []})
    assert (config.mode, config.recompute) == ("selective", ())


@pytest.mark.parametrize(
    ("data", "message_parts"),
    [
        ({"keep": ["attn_core"], "recompute": ["mlp_up"]}, ["keep and recompute are both given", "give one"]),
        ({"preset": "attn", "keep": ["mlp_up"]}, ["preset 'attn' and keep", "remove keep"]),
        ({"preset": "matmuls", "recompute": []}, ["preset 'matmuls' and recompute", "remove recompute"]),
        ({"preset": "attn", "mode": "full"}, ["mode 'full' disagrees with preset 'attn'", "'selective'"]),
        ({"preset": "none", "mode": "selective"}, ["mode 'selective' disagrees with preset 'none'"]),
        ({"mode": "full", "keep": ["attn_core"]}, ["keep is given with mode 'full'", "mode: selective"]),
        ({"mode": "none", "recompute": ["attn_core"]}, ["recompute is given with mode 'none'", "do nothing"]),
        ({"mode": "none", "layers": "0-3"}, ["mode 'none'", "would do nothing", "remove layers"]),
        ({"preset": "none", "layers": [1]}, ["mode 'none'", "would do nothing"]),
        ({"mode": "fast"}, ["mode:", "'fast'", "'none', 'full' or 'selective'"]),
        ({"keep": "attn_core"}, ["keep:", "string 'attn_core'", "[attn_core]"]),
        ({"keep": ["mlp_up", "mlp_up"]}, ["mlp_up", "more than once"]),
        ({"keep": [3]}, ["keep[0]", "unit name string"]),
    ],
)
def test_inconsistent_fields_are_errors(data, message_parts):
    message = config_error(data)
    for part in message_parts:
        assert part in message


def test_unknown_unit_error_lists_every_valid_unit_and_the_field_path():
    message = config_error({"overrides": [{"layers": 0, "mode": "full"}, {"layers": 1, "keep": ["attn"]}]})
    assert "overrides[1].keep[0]" in message
    assert "'attn'" in message
    for name in ALL_UNIT_NAMES:
        assert name in message
    assert "https://" not in message


def test_unknown_field_is_an_error_listing_valid_fields():
    message = config_error({"mode": "full", "budget": "40GiB"})
    assert "unknown field 'budget'" in message
    assert "mode, preset, keep, recompute, layers, overrides, save_collectives, offload" in message
    message = config_error({"overrides": [{"layers": 0, "mode": "full", "budget": 3}]})
    assert "overrides[0].budget" in message
    assert "mode, preset, keep, recompute, layers" in message
    assert "overrides" not in message.split("valid fields here:")[1]


def test_several_problems_are_all_reported():
    message = config_error({"mode": "fast", "keep": ["nope"], "layers": "3-1"})
    assert "mode:" in message
    assert "keep[0]:" in message
    assert "layers:" in message


def test_non_mapping_config_is_an_error():
    assert "got list" in config_error(["full"])
    assert "preset: <name>" in config_error("matmuls")


def test_format_field_path():
    assert format_field_path(("overrides", 1, "keep", 0)) == "overrides[1].keep[0]"
    assert format_field_path(("mode",)) == "mode"
    assert format_field_path(()) == ""


# ---------------------------------------------------------------------------------------
# Overrides


def test_override_keeps_its_own_choice_and_selector():
    config = RecomputeConfig.from_dict(
        {
            "preset": "matmuls",
            "overrides": [{"layers": "0-1", "mode": "full"}, {"layers": {"last": 2}, "keep": ["qkv_proj"]}],
        }
    )
    first, second = config.overrides
    assert (first.mode, first.layers.root) == ("full", "0-1")
    assert (second.mode, second.keep, second.layers.root) == (
        "selective",
        (RecomputeUnit.QKV_PROJ,),
        {"last": 2},
    )


@pytest.mark.parametrize(
    ("override", "message_parts"),
    [
        ({"layers": "0-3"}, ["overrides[0]", "none of mode, preset, keep, recompute", "do nothing"]),
        ({"mode": "full"}, ["overrides[0].layers", "required field 'layers' is missing"]),
        ({"layers": "none", "mode": "full"}, ["overrides[0].layers", "layers: none would do nothing"]),
        ({"layers": 0, "preset": "attn", "keep": []}, ["overrides[0]", "preset 'attn' and keep"]),
        ({"layers": 0, "mode": "full", "recompute": ["rope"]}, ["recompute is given with mode 'full'"]),
        ({"layers": 0, "keep": ["x"], "recompute": []}, ["overrides[0].keep[0]", "'x'"]),
    ],
)
def test_override_errors(override, message_parts):
    message = config_error({"overrides": [override]})
    for part in message_parts:
        assert part in message


def test_override_constructed_directly():
    override = LayerOverride(layers="2-3", preset="attn")
    assert override.mode == "selective"
    assert override.to_dict() == {"layers": "2-3", "preset": "attn"}
    config = RecomputeConfig(overrides=(override,))
    assert RecomputeConfig.from_dict(config.to_dict()) == config


def test_override_mode_is_always_written_when_it_is_the_only_choice():
    config = RecomputeConfig.from_dict({"mode": "none", "overrides": [{"layers": 1, "mode": "full"}]})
    assert config.to_dict() == {"mode": "none", "overrides": [{"layers": 1, "mode": "full"}]}


# ---------------------------------------------------------------------------------------
# Loading, saving, round trips


def unit_lists():
    return st.lists(st.sampled_from(ALL_UNIT_NAMES), unique=True, max_size=5)


def range_strings():
    def render(pairs):
        return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in pairs)

    pair = st.tuples(st.integers(0, 40), st.integers(0, 10)).map(lambda p: (p[0], p[0] + p[1]))
    return st.lists(pair, min_size=1, max_size=4).map(render)


def selectors(allow_none: bool):
    forms = [
        st.just("all"),
        st.integers(0, 64),
        range_strings(),
        st.lists(st.one_of(st.integers(0, 64), range_strings()), min_size=1, max_size=4),
        st.builds(lambda n: {"every": n}, st.integers(1, 8)),
        st.builds(lambda n, k: {"every": n, "offset": k}, st.integers(1, 8), st.integers(0, 8)),
        st.builds(lambda k: {"first": k}, st.integers(1, 16)),
        st.builds(lambda k: {"last": k}, st.integers(1, 16)),
    ]
    if allow_none:
        forms.append(st.just("none"))
    return st.one_of(forms)


def choices():
    presets = st.sampled_from(list(PRESETS))
    return st.one_of(
        st.sampled_from(["none", "full"]).map(lambda m: {"mode": m}),
        presets.map(lambda p: {"preset": p}),
        presets.map(lambda p: {"preset": p, "mode": PRESETS[p].mode}),
        unit_lists().filter(bool).map(lambda units: {"keep": units}),
        unit_lists().map(lambda units: {"mode": "selective", "recompute": units}),
    )


@st.composite
def config_dicts(draw):
    data = {} if draw(st.booleans()) else draw(choices())
    config_mode = data.get("mode") or (PRESETS[data["preset"]].mode if "preset" in data else "full")
    if config_mode != "none" and draw(st.booleans()):
        data["layers"] = draw(selectors(allow_none=True))
    overrides = draw(
        st.lists(st.tuples(selectors(allow_none=False), choices()), max_size=3),
    )
    if overrides:
        data["overrides"] = [{"layers": layers, **choice} for layers, choice in overrides]
    elif data.get("layers") == "none":
        del data["layers"]  # 'none' without overrides checkpoints nothing: an error
    return data


@settings(max_examples=150, deadline=None)
@given(config_dicts())
def test_round_trip_through_dict_yaml_and_json(data):
    config = RecomputeConfig.from_dict(data)
    assert RecomputeConfig.from_dict(config.to_dict()) == config
    assert RecomputeConfig.from_yaml(config.to_yaml()) == config
    assert RecomputeConfig.from_json(config.to_json()) == config
    # The dumped form is canonical: dumping again changes nothing.
    assert RecomputeConfig.from_dict(config.to_dict()).to_dict() == config.to_dict()


def test_to_dict_is_minimal_and_plain():
    config = RecomputeConfig.from_dict(
        {"mode": "selective", "keep": ["attn_core"], "layers": "all", "overrides": []}
    )
    dumped = config.to_dict()
    assert dumped == {"keep": ["attn_core"]}
    assert type(dumped["keep"][0]) is str


def test_to_dict_does_not_alias_the_selector():
    config = RecomputeConfig.from_dict({"layers": [1, 2]})
    config.to_dict()["layers"].append(3)
    assert config.layers.root == [1, 2]


def test_from_yaml_reads_a_full_example():
    text = """
mode: selective
keep: [qkv_proj, attn_core]
layers: 0-11
overrides:
  - layers: {every: 4}
    mode: full
  - layers: [10, 11]
    preset: megatron-selective
"""
    config = RecomputeConfig.from_yaml(text)
    assert config.keep == (RecomputeUnit.QKV_PROJ, RecomputeUnit.ATTN_CORE)
    assert config.layers.resolve(12) == tuple(range(12))
    assert [o.mode for o in config.overrides] == ["full", "selective"]
    assert config.overrides[1].preset == "megatron-selective"


def test_yaml_validation_error_names_file_field_and_line():
    text = "mode: selective\noverrides:\n  - layers: 0-3\n    keep: [attn_core,\n      bogus_unit]\n"
    with pytest.raises(ConfigError) as info:
        RecomputeConfig.from_yaml(text, source="model.yaml")
    message = str(info.value)
    assert "model.yaml" in message
    assert "overrides[0].keep[1] (line 5)" in message
    assert "'bogus_unit'" in message


def test_yaml_unknown_field_names_its_line():
    with pytest.raises(ConfigError) as info:
        RecomputeConfig.from_yaml("mode: full\n\nbudget_gib: 40\n", source="c.yaml")
    assert "budget_gib (line 3): unknown field 'budget_gib'" in str(info.value)


def test_yaml_unknown_field_whose_value_starts_below_it_names_the_key_line():
    # The value of a misspelt `overrides` is a list starting on the next line; the key is on 2.
    text = "preset: full\noverides:\n  - layers: 0\n    mode: none\n"
    with pytest.raises(ConfigError) as info:
        RecomputeConfig.from_yaml(text, source="c.yaml")
    assert "overides (line 2): unknown field 'overides'; did you mean 'overrides'?" in str(info.value)


def test_a_misspelt_key_in_an_override_is_named_with_the_nearest_valid_one():
    text = "preset: full\noverrides:\n  - layers: 0\n    mdoe: none\n"
    with pytest.raises(ConfigError) as info:
        RecomputeConfig.from_yaml(text, source="c.yaml")
    message = str(info.value)
    assert "overrides[0].mdoe (line 4): unknown field 'mdoe'; did you mean 'mode'?" in message
    assert "sets none of" not in message


def test_malformed_yaml_file_names_file_line_and_column(tmp_path: Path):
    path = tmp_path / "broken.yaml"
    path.write_text("mode: selective\nkeep: [attn_core, qkv_proj\nlayers: all\n")
    with pytest.raises(ConfigError) as info:
        RecomputeConfig.from_file(path)
    message = str(info.value)
    assert "malformed YAML" in message
    assert str(path) in message
    assert "line 3" in message
    assert "column" in message


def test_malformed_json_file_names_file_line_and_column(tmp_path: Path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "mode": "selective",\n  "keep": ["attn_core",]\n}\n')
    with pytest.raises(ConfigError) as info:
        RecomputeConfig.from_file(path)
    message = str(info.value)
    assert "malformed JSON" in message
    assert str(path) in message
    assert "line 3, column 24" in message


def test_json_validation_error_names_file_and_field(tmp_path: Path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"overrides": [{"layers": "4-1", "mode": "full"}]}))
    with pytest.raises(ConfigError) as info:
        RecomputeConfig.from_file(path)
    assert str(path) in str(info.value)
    assert "overrides[0].layers" in str(info.value)
    assert "reversed" in str(info.value)


def test_empty_yaml_is_an_error():
    with pytest.raises(ConfigError, match=r"empty\.yaml is empty"):
        RecomputeConfig.from_yaml("", source="empty.yaml")
    assert RecomputeConfig.from_yaml("{}") == RecomputeConfig()


def test_yaml_loading_is_safe():
    with pytest.raises(ConfigError, match="malformed YAML"):
        RecomputeConfig.from_yaml("mode: !!python/object/apply:os.system ['true']\n")


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json", ".YAML"])
def test_dump_and_from_file_round_trip(tmp_path: Path, suffix: str):
    config = RecomputeConfig.from_dict(
        {"recompute": ["attn_core"], "layers": {"every": 2}, "overrides": [{"layers": 0, "mode": "none"}]}
    )
    path = tmp_path / f"plan{suffix}"
    config.dump(path)
    assert RecomputeConfig.from_file(path) == config
    assert RecomputeConfig.from_file(str(path)) == config


def test_dumped_yaml_and_json_are_plain(tmp_path: Path):
    config = RecomputeConfig.from_dict({"keep": ["attn_core"], "layers": "0-3"})
    assert yaml.safe_load(config.to_yaml()) == {"keep": ["attn_core"], "layers": "0-3"}
    assert json.loads(config.to_json()) == {"keep": ["attn_core"], "layers": "0-3"}


def test_unsupported_suffix_names_supported_ones(tmp_path: Path):
    path = tmp_path / "plan.toml"
    path.write_text("mode = 'full'\n")
    with pytest.raises(ConfigError) as info:
        RecomputeConfig.from_file(path)
    assert "'.toml'" in str(info.value)
    assert ".yaml, .yml, .json" in str(info.value)
    with pytest.raises(ConfigError, match=r"'\.txt'.*\.yaml, \.yml, \.json"):
        RecomputeConfig().dump(tmp_path / "plan.txt")


def test_missing_file_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        RecomputeConfig.from_file(tmp_path / "absent.yaml")


def test_parse_accepts_every_input_form(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: attn\n")
    expected = RecomputeConfig.from_preset("attn")
    assert RecomputeConfig.parse("attn") == expected
    assert RecomputeConfig.parse(path) == expected
    assert RecomputeConfig.parse(str(path)) == expected
    assert RecomputeConfig.parse({"preset": "attn"}) == expected
    assert RecomputeConfig.parse(expected) is expected


def test_parse_rejects_unknown_names_and_types(tmp_path: Path):
    with pytest.raises(ConfigError) as info:
        RecomputeConfig.parse("matmul")
    assert "'matmul' is neither a preset name nor an existing config file" in str(info.value)
    assert "matmuls" in str(info.value)
    with pytest.raises(ConfigError, match="cannot make a RecomputeConfig from int"):
        RecomputeConfig.parse(3)  # type: ignore[arg-type]


def test_duplicate_yaml_key_names_the_file_and_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("mode: selective\nkeep: [attn_core]\nkeep: [mlp_up]\n")
    with pytest.raises(ConfigError) as err:
        RecomputeConfig.from_file(path)
    message = str(err.value)
    assert "twice.yaml, line 3" in message and "'keep' appears twice (first on line 2)" in message


def test_layers_none_without_overrides_is_an_error():
    for data in ({"layers": "none"}, {"preset": "matmuls", "layers": "none"}):
        with pytest.raises(ConfigError, match=r"checkpoints nothing.*preset: none"):
            RecomputeConfig.from_dict(data)


def test_save_collectives_round_trips_and_rejects_no_effect():
    config = RecomputeConfig.from_dict({"mode": "full", "save_collectives": True})
    assert config.to_dict() == {"save_collectives": True}
    assert RecomputeConfig.from_yaml(config.to_yaml()) == config
    assert RecomputeConfig.from_dict({}).save_collectives == "auto"
    with pytest.raises(ConfigError, match="save_collectives: False is given with mode 'none'"):
        RecomputeConfig.from_dict({"mode": "none", "save_collectives": False})
    for bad in ("sometimes", 3, None):
        with pytest.raises(ConfigError) as err:
            RecomputeConfig.from_dict({"save_collectives": bad})
        # One line naming the choices, not pydantic's union members (save_collectives.bool, ...).
        message = str(err.value)
        assert f"save_collectives: expected true, false or 'auto', got {bad!r}" in message
        assert "literal" not in message and ".bool" not in message


def test_no_invariant_is_an_assert_statement():
    # `python -O` strips assert statements, so a check made with one silently stops checking.
    import ast

    import actplan

    package = Path(actplan.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assert):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not found, f"assert statements in actplan (raise a real error instead): {found}"


def test_json_rejects_a_key_given_twice():
    with pytest.raises(ConfigError, match=r"malformed JSON in twice\.json: key 'mode' appears twice"):
        RecomputeConfig.from_json(
            '{"mode": "full", "mode": "selective", "keep": ["attn_core"]}', "twice.json"
        )
    with pytest.raises(ConfigError, match="key 'layers' appears twice"):
        RecomputeConfig.from_json('{"overrides": [{"layers": "0", "layers": "1", "mode": "none"}]}')


def test_non_utf8_config_file_names_the_file_and_the_fix(tmp_path):
    path = tmp_path / "latin.yaml"
    path.write_bytes("# caf\xe9\nmode: full\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin\.yaml' is not UTF-8 text .*save it as UTF-8"):
        RecomputeConfig.from_file(path)


def test_unit_list_of_another_type_asks_for_a_list_of_unit_names():
    with pytest.raises(ConfigError, match="keep: expected a list of unit names, got 5") as info:
        RecomputeConfig.from_dict({"keep": 5})
    assert "tuple" not in str(info.value)
    with pytest.raises(
        ConfigError, match=r"offload\.units: expected a list of unit names or 'kept', got 5"
    ) as info:
        RecomputeConfig.from_dict({"mode": "full", "offload": {"units": 5}})
    assert "tuple" not in str(info.value)


@pytest.mark.parametrize(
    ("suffix", "text", "line", "message"),
    [
        (".yaml", "preset: matmuls\noverrides:\n  - layers: '0-9'\n    mode: full\n", 3,
         "overrides[0].layers: layer index 9 is out of range for a model with 2 layers"),
        (".yaml", "preset: matmuls\nlayers: [0, 7]\n", 2, "layers: layer index 7 is out of range"),
        (".yaml", "preset: matmuls\noverrides:\n  - layers: 1\n    keep: [moe_experts]\n", 4,
         "overrides[0].keep lists unit moe_experts"),
        (".json", '{"preset": "matmuls",\n "overrides": [\n  {"layers": [5], "mode": "full"}\n ]\n}\n', 3,
         "overrides[0].layers: layer index 5 is out of range"),
        (".yaml", "preset: matmuls\noffload:\n  layer_input: true\n  layers: [4]\n", 4,
         "offload.layers: layer index 4 is out of range"),
    ],
)
def test_errors_found_against_the_model_name_the_file_and_line(tmp_path, suffix, text, line, message):
    # Layer indices and declared units are checked only when the config meets a model; the
    # error still says where in the file the field is, as parse errors do.
    from actplan._install.apply import plan_for
    from actplan.models import build_model

    path = tmp_path / f"plan{suffix}"
    path.write_text(text)
    config = RecomputeConfig.from_file(path)
    with pytest.raises(ConfigError) as err:
        plan_for(build_model("dense", "tiny").model, config)
    assert str(err.value).startswith(f"in {path} (line {line}): {message}")
    # A config built in code has no file: the message is unchanged.
    in_code = RecomputeConfig.from_dict({"layers": [7], "preset": "full"})
    with pytest.raises(ConfigError) as plain:
        plan_for(build_model("dense", "tiny").model, in_code)
    assert str(plain.value).startswith("layers: layer index 7 is out of range")


def test_field_paths_parse_back():
    from actplan.config._errors import format_field_path, parse_field_path

    for loc in (("overrides", 1, "keep", 0), ("offload", "layers"), ("layers",)):
        assert parse_field_path(format_field_path(loc)) == loc

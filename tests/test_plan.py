"""resolve_plan: a config against fake layers, precedence, presets and errors."""

from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actplan._install.plan import LayerPlan, LayerSpec, Plan, format_indices, resolve_plan
from actplan.config import ConfigError, RecomputeConfig
from actplan.units import MarkerInterval, RecomputeIntervalMap, RecomputeUnit

U = RecomputeUnit


def chain_map(units: list[str]) -> RecomputeIntervalMap:
    """Each unit spans from its own marker to the next unit's marker, like a real layer."""
    markers = [*units, "end"]
    return RecomputeIntervalMap(
        {unit: MarkerInterval(markers[i], markers[i + 1]) for i, unit in enumerate(units)}
    )


DENSE_UNITS = ["attn_norm", "qkv_proj", "attn_core", "attn_proj", "mlp_norm", "mlp_up", "mlp_act", "mlp_down"]
MOE_UNITS = [
    "attn_norm",
    "qkv_proj",
    "attn_core",
    "attn_proj",
    "mlp_norm",
    "moe_router",
    "moe_dispatch",
    "moe_experts",
    "moe_act",
    "moe_combine",
    "shared_experts",
]
DENSE_MAP = chain_map(DENSE_UNITS)
MOE_MAP = chain_map(MOE_UNITS)


def dense_layers(count: int) -> list[LayerSpec]:
    return [LayerSpec(i, f"layers.{i}", "DenseLayer", DENSE_MAP) for i in range(count)]


def mixed_layers() -> list[LayerSpec]:
    """Two dense layers then two MoE layers."""
    return [
        LayerSpec(0, "layers.0", "DenseLayer", DENSE_MAP),
        LayerSpec(1, "layers.1", "DenseLayer", DENSE_MAP),
        LayerSpec(2, "layers.2", "MoELayer", MOE_MAP),
        LayerSpec(3, "layers.3", "MoELayer", MOE_MAP),
    ]


def plan_for(data: dict, specs: list[LayerSpec]) -> Plan:
    return resolve_plan(RecomputeConfig.from_dict(data), specs)


def units(*names: str) -> tuple[RecomputeUnit, ...]:
    return tuple(RecomputeUnit(name) for name in names)


def resolution_error(data: dict, specs: list[LayerSpec]) -> str:
    with pytest.raises(ConfigError) as info:
        plan_for(data, specs)
    return str(info.value)


# ---------------------------------------------------------------------------------------
# Modes and presets


def test_default_config_checkpoints_every_layer_fully():
    plan = plan_for({}, dense_layers(3))
    assert [layer.mode for layer in plan.layers] == ["full", "full", "full"]
    assert all(layer.kept_units == () and layer.kept_intervals == frozenset() for layer in plan.layers)
    assert [layer.source for layer in plan.layers] == ["top level"] * 3
    assert plan.checkpointed == plan.layers


def test_layer_plan_copies_the_spec_identity():
    plan = plan_for({}, mixed_layers())
    assert [(p.index, p.name, p.class_name) for p in plan.layers] == [
        (0, "layers.0", "DenseLayer"),
        (1, "layers.1", "DenseLayer"),
        (2, "layers.2", "MoELayer"),
        (3, "layers.3", "MoELayer"),
    ]


def test_preset_none_checkpoints_nothing():
    plan = plan_for({"preset": "none"}, dense_layers(2))
    assert [layer.mode for layer in plan.layers] == ["none", "none"]
    assert plan.checkpointed == ()
    assert plan.layers[0].source == "top level, preset none"


def test_preset_full():
    plan = plan_for({"preset": "full"}, dense_layers(2))
    assert [layer.mode for layer in plan.layers] == ["full", "full"]
    assert plan.layers[0].kept_units == ()


def test_preset_attn_keeps_only_the_attention_kernel():
    layer = plan_for({"preset": "attn"}, dense_layers(1)).layers[0]
    assert layer.mode == "selective"
    assert layer.kept_units == (U.ATTN_CORE,)
    assert layer.kept_intervals == frozenset({MarkerInterval("attn_core", "attn_proj")})
    assert layer.source == "top level, preset attn"


def test_preset_matmuls_intersects_with_each_layers_declared_units():
    plan = plan_for({"preset": "matmuls"}, mixed_layers())
    dense, moe = plan.layers[0], plan.layers[2]
    # Dense layers declare no MoE units; MoE layers declare no mlp_up: both silently dropped.
    assert dense.kept_units == units("qkv_proj", "attn_core", "attn_proj", "mlp_up")
    assert moe.kept_units == units(
        "qkv_proj", "attn_core", "attn_proj", "moe_router", "moe_experts", "shared_experts"
    )
    assert U.MLP_DOWN not in dense.kept_units
    assert dense.kept_intervals == DENSE_MAP.intervals_of(dense.kept_units)
    assert len(moe.kept_intervals) == 6


def test_preset_megatron_selective_recomputes_only_attention_core():
    plan = plan_for({"preset": "megatron-selective"}, mixed_layers())
    assert plan.layers[0].kept_units == tuple(u for u in units(*DENSE_UNITS) if u is not U.ATTN_CORE)
    assert plan.layers[3].kept_units == tuple(u for u in units(*MOE_UNITS) if u is not U.ATTN_CORE)


def test_preset_units_absent_from_a_layer_are_not_an_error():
    attention_only = RecomputeIntervalMap({"qkv_proj": MarkerInterval("qkv", "end")})
    layer = plan_for({"preset": "attn"}, [LayerSpec(0, "blk", "Tiny", attention_only)]).layers[0]
    assert (layer.mode, layer.kept_units, layer.kept_intervals) == ("selective", (), frozenset())


# ---------------------------------------------------------------------------------------
# keep / recompute


def test_keep_follows_declaration_order_not_the_order_written():
    layer = plan_for({"keep": ["mlp_up", "qkv_proj"]}, dense_layers(1)).layers[0]
    assert layer.kept_units == (U.QKV_PROJ, U.MLP_UP)
    assert layer.kept_intervals == frozenset(
        {MarkerInterval("qkv_proj", "attn_core"), MarkerInterval("mlp_up", "mlp_act")}
    )


def test_recompute_is_the_complement_of_keep():
    recompute = ["attn_core", "mlp_act", "attn_norm"]
    by_recompute = plan_for({"recompute": recompute}, dense_layers(1)).layers[0]
    kept = [name for name in DENSE_UNITS if name not in recompute]
    by_keep = plan_for({"keep": kept}, dense_layers(1)).layers[0]
    assert by_recompute.kept_units == units("qkv_proj", "attn_proj", "mlp_norm", "mlp_up", "mlp_down")
    assert by_recompute.kept_units == by_keep.kept_units
    assert by_recompute.kept_intervals == by_keep.kept_intervals


def test_a_preset_with_none_of_its_units_in_a_layer_keeps_nothing_there():
    # Presets skip what a layer lacks: 'attn' on a layer without attn_core keeps nothing.
    specs = [LayerSpec(0, "layers.0", "MLPOnly", chain_map(["mlp_norm", "mlp_up", "mlp_act", "mlp_down"]))]
    layer = plan_for({"preset": "attn"}, specs).layers[0]
    assert (layer.mode, layer.kept_units, layer.kept_intervals) == ("selective", (), frozenset())


def test_recompute_of_nothing_keeps_every_declared_unit():
    layer = plan_for({"recompute": []}, mixed_layers()).layers[2]
    assert layer.kept_units == units(*MOE_UNITS)
    assert layer.kept_intervals == frozenset(MOE_MAP.intervals_of(MOE_MAP.units))


def test_explicit_keep_of_an_undeclared_unit_is_an_error_listing_declared_units():
    message = resolution_error({"keep": ["attn_core", "moe_router"]}, mixed_layers())
    assert "keep lists unit moe_router" in message
    assert "'layers.0' (DenseLayer)" in message
    assert "declares: " + ", ".join(DENSE_UNITS) in message
    assert "error, not a no-op" in message
    assert "attn_core," not in message.split("declares:")[0]


def test_explicit_recompute_of_undeclared_units_names_them_all():
    moe_layers = [LayerSpec(0, "blocks.0", "MoELayer", MOE_MAP)]
    message = resolution_error({"recompute": ["mlp_up", "mlp_down", "rope"]}, moe_layers)
    assert "recompute lists units mlp_up, mlp_down, rope" in message
    assert "'blocks.0' (MoELayer)" in message
    assert "declares: " + ", ".join(MOE_UNITS) in message


def test_undeclared_unit_error_names_the_override_field():
    data = {"preset": "matmuls", "overrides": [{"layers": "2-3", "keep": ["mlp_up"]}]}
    message = resolution_error(data, mixed_layers())
    assert message.startswith("overrides[0].keep lists unit mlp_up")
    assert "'layers.2' (MoELayer)" in message


def test_explicit_unit_is_checked_only_on_layers_it_applies_to():
    # The top level keeps moe_router; the dense layers are overridden, so no error.
    data = {"keep": ["moe_router"], "overrides": [{"layers": "0-1", "keep": ["mlp_up"]}]}
    plan = plan_for(data, mixed_layers())
    assert [layer.kept_units for layer in plan.layers] == [
        (U.MLP_UP,),
        (U.MLP_UP,),
        (U.MOE_ROUTER,),
        (U.MOE_ROUTER,),
    ]


# ---------------------------------------------------------------------------------------
# Layer selection and overrides


def test_layers_not_selected_are_not_checkpointed():
    plan = plan_for({"preset": "attn", "layers": {"every": 2}}, dense_layers(5))
    assert [layer.mode for layer in plan.layers] == ["selective", "none", "selective", "none", "selective"]
    assert plan.layers[1].source == "not selected"
    assert plan.layers[1].kept_units == ()
    assert [layer.index for layer in plan.checkpointed] == [0, 2, 4]


def test_later_overrides_win_over_earlier_ones_and_the_top_level():
    data = {
        "preset": "matmuls",
        "layers": "0-5",
        "overrides": [
            {"layers": "2-7", "mode": "full"},
            {"layers": [3, 7], "keep": ["attn_core"]},
            {"layers": {"first": 1}, "mode": "none"},
        ],
    }
    plan = plan_for(data, dense_layers(9))
    assert [layer.mode for layer in plan.layers] == [
        "none",
        "selective",
        "full",
        "selective",
        "full",
        "full",
        "full",
        "selective",
        "none",
    ]
    assert [layer.source for layer in plan.layers] == [
        "overrides[2]",
        "top level, preset matmuls",
        "overrides[0]",
        "overrides[1]",
        "overrides[0]",
        "overrides[0]",
        "overrides[0]",
        "overrides[1]",
        "not selected",
    ]
    assert plan.layers[1].kept_units == units("qkv_proj", "attn_core", "attn_proj", "mlp_up")
    assert plan.layers[3].kept_units == (U.ATTN_CORE,)
    assert plan.layers[7].kept_units == (U.ATTN_CORE,)


def test_override_preset_shows_in_source():
    plan = plan_for({"overrides": [{"layers": 1, "preset": "attn"}]}, dense_layers(2))
    assert plan.layers[1].source == "overrides[0], preset attn"
    assert plan.layers[0].source == "top level"


def test_top_level_none_layers_with_overrides_checkpoints_only_overridden_layers():
    data = {"layers": "none", "overrides": [{"layers": "1-2", "mode": "full"}]}
    plan = plan_for(data, dense_layers(4))
    assert [layer.mode for layer in plan.layers] == ["none", "full", "full", "none"]


def test_out_of_range_top_level_selector_names_field_index_and_layer_count():
    message = resolution_error({"layers": "0-4"}, dense_layers(4))
    assert message.startswith("layers: ")
    assert "layer index 4" in message
    assert "4 layers" in message


def test_out_of_range_override_selector_names_the_override():
    message = resolution_error(
        {"overrides": [{"layers": 0, "mode": "none"}, {"layers": [9], "mode": "none"}]}, dense_layers(3)
    )
    assert message.startswith("overrides[1].layers: ")
    assert "layer index 9" in message
    assert "3 layers" in message


def test_no_layers_is_an_error_that_says_how_to_declare_them():
    message = resolution_error({}, [])
    assert "no checkpointable layers" in message
    assert "recompute_intervals" in message


def test_layer_specs_must_be_in_model_order():
    specs = [
        LayerSpec(1, "layers.1", "DenseLayer", DENSE_MAP),
        LayerSpec(0, "layers.0", "DenseLayer", DENSE_MAP),
    ]
    message = resolution_error({}, specs)
    assert "'layers.1' has index 1 at position 0" in message


@settings(max_examples=60, deadline=None)
@given(
    top=st.sampled_from(["all", "none", {"every": 3}, "0-2", {"last": 2}]),
    override_layers=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4), max_size=3),
)
def test_each_layer_is_decided_by_the_last_entry_that_selects_it(top, override_layers):
    if top == "none" and not override_layers:
        with pytest.raises(ConfigError, match="checkpoints nothing"):
            RecomputeConfig.from_dict({"layers": top})
        return
    data = {"layers": top, "overrides": [{"layers": ids, "mode": "none"} for ids in override_layers]}
    config = RecomputeConfig.from_dict(data)
    shadowed = [
        position
        for position, ids in enumerate(override_layers)
        if set(ids) <= {i for later in override_layers[position + 1 :] for i in later}
    ]
    if shadowed:
        with pytest.raises(ConfigError, match=rf"overrides\[{shadowed[0]}\].*decides no layer"):
            resolve_plan(config, dense_layers(8))
        return
    plan = resolve_plan(config, dense_layers(8))
    top_selected = set(config.layers.resolve(8))
    for layer in plan.layers:
        deciders = [i for i, ids in enumerate(override_layers) if layer.index in ids]
        if deciders:
            expected = (f"overrides[{deciders[-1]}]", "none")
        elif layer.index in top_selected:
            expected = ("top level", "full")
        else:
            expected = ("not selected", "none")
        assert (layer.source, layer.mode) == expected


# ---------------------------------------------------------------------------------------
# Reporting


def test_summary_groups_layers_by_choice():
    data = {"keep": ["attn_core"], "layers": "0-5", "overrides": [{"layers": "4-5", "mode": "full"}]}
    summary = plan_for(data, dense_layers(8)).summary()
    assert summary.splitlines() == [
        "plan for 8 layers (6 checkpointed):",
        "  layers 0-3: selective, keep attn_core",
        "  layers 4-5: full",
        "  layers 6-7: none",
    ]


def test_summary_and_rows_show_offload():
    data = {
        "preset": "full",
        "overrides": [{"layers": [2], "keep": ["mlp_up"]}],
        "offload": {"layers": "1-2", "layer_input": True},
    }
    plan = plan_for(data, dense_layers(4))
    assert plan.summary().splitlines() == [
        "plan for 4 layers (4 checkpointed, 2 offloading):",
        "  layers 0,3: full",
        "  layers 1: full; offload layer input",
        "  layers 2: selective, keep mlp_up; offload layer input",
    ]
    with_units = plan_for({**data, "offload": {"layers": [2], "units": "kept"}}, dense_layers(4))
    assert [row["offload"] for row in with_units.to_rows()] == ["", "", "mlp_up", ""]
    assert with_units.layers[2].offload_intervals == with_units.layers[2].kept_intervals


def test_summary_says_when_selective_keeps_nothing():
    specs = [LayerSpec(0, "layers.0", "MLPOnly", chain_map(["mlp_norm", "mlp_up", "mlp_act", "mlp_down"]))]
    assert "layers 0: selective, keep nothing" in plan_for({"preset": "attn"}, specs).summary()


def test_to_rows_gives_plain_values_per_layer():
    rows = plan_for({"preset": "attn", "layers": [1]}, dense_layers(2)).to_rows()
    assert rows == [
        {
            "index": 0,
            "name": "layers.0",
            "class_name": "DenseLayer",
            "mode": "none",
            "kept_units": "",
            "kept_intervals": 0,
            "source": "not selected",
            "routing_saved": False,
            "offload": "",
        },
        {
            "index": 1,
            "name": "layers.1",
            "class_name": "DenseLayer",
            "mode": "selective",
            "kept_units": "attn_core",
            "kept_intervals": 1,
            "source": "top level, preset attn",
            "routing_saved": True,
            "offload": "",
        },
    ]


def test_plan_keeps_the_config_and_is_immutable():
    config = RecomputeConfig.from_preset("attn")
    plan = resolve_plan(config, dense_layers(1))
    assert plan.config is config
    assert isinstance(plan.layers[0], LayerPlan)
    with pytest.raises(AttributeError):
        plan.layers[0].mode = "full"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("indices", "expected"),
    [([0, 1, 2, 5, 7, 8], "0-2,5,7-8"), ([3], "3"), ([4, 2, 3, 3], "2-4"), ([], "")],
)
def test_format_indices(indices, expected):
    assert format_indices(indices) == expected


def test_an_override_that_later_overrides_fully_cover_is_an_error():
    message = resolution_error(
        {"overrides": [{"layers": [0], "mode": "none"}, {"layers": "all", "mode": "full"}]}, dense_layers(4)
    )
    assert "overrides[0] (layers: [0]) decides no layer" in message


def test_a_top_level_choice_that_overrides_fully_cover_is_an_error():
    message = resolution_error(
        {"preset": "matmuls", "layers": "0-1", "overrides": [{"layers": "0-3", "mode": "full"}]},
        dense_layers(4),
    )
    assert "top-level choice (layers: '0-1') decides no layer" in message
    # Without a top-level preset/keep/recompute there is nothing to lose.
    plan = plan_for({"layers": "none", "overrides": [{"layers": "1", "mode": "full"}]}, dense_layers(4))
    assert [layer.mode for layer in plan.layers] == ["none", "full", "none", "none"]


def test_a_plain_dict_declaration_says_to_wrap_it_in_a_recompute_interval_map():
    from torch import nn

    import actplan

    class Block(nn.Module):
        recompute_intervals: ClassVar = {"mlp_up": actplan.MarkerInterval("up", "act")}  # not wrapped

        def __init__(self):
            super().__init__()
            self.up = nn.Linear(2, 2)

        def forward(self, x):
            return self.up(x)

    with pytest.raises(ConfigError, match=r"Block set recompute_intervals to a plain dict.*IntervalMap\("):
        actplan.apply(nn.Sequential(Block(), Block()), "full")

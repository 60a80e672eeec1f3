"""Plans that know their model: the ``made_for`` block (load, dump, strict validation), the
layer count and class check when a config meets a model, and the header and per-layer
comments of the file ``actplan plan`` writes."""

from __future__ import annotations

import pytest

import actplan
from actplan.cli import main
from actplan.config import ConfigError, RecomputeConfig
from actplan.config._made_for import MadeFor
from actplan.models import build_model

MADE_FOR = {
    "model": "dense",
    "size": "tiny",
    "layers": 2,
    "layer_classes": {"DecoderLayer": "0-1"},
    "batch": 2,
    "seq": 16,
    "layer_input": [2, 16, 64],
    "dtype": "float32",
    "device": "cpu",
    "budget": "80%",
    "budget_bytes": 1234567,
    "actplan_version": "0.1.0",
}


def _config(**made_for) -> RecomputeConfig:
    return RecomputeConfig.from_dict({"made_for": {**MADE_FOR, **made_for}, "preset": "matmuls"})


def _wrapped(model) -> list[str]:
    """The layers that carry an instance-level forward (a wrapper was installed)."""
    return [name for name, layer in actplan.lowlevel.find_layers(model) if "forward" in layer.__dict__]


def test_made_for_round_trips_through_dict_yaml_json_and_files(tmp_path):
    config = _config()
    assert list(config.to_dict()) == ["made_for", "preset"]  # the header comes first
    assert config.to_dict()["made_for"] == MADE_FOR
    assert RecomputeConfig.from_dict(config.to_dict()) == config
    assert RecomputeConfig.from_yaml(config.to_yaml()) == config
    assert RecomputeConfig.from_json(config.to_json()) == config
    for suffix in (".yaml", ".json"):
        path = tmp_path / f"plan{suffix}"
        config.dump(path, comment="made by hand\nfor this test")
        assert RecomputeConfig.from_file(path) == config
    assert (tmp_path / "plan.yaml").read_text().startswith("# made by hand\n# for this test\nmade_for:\n")
    # Only what is known is written; a bare byte budget reads back as text.
    minimal = RecomputeConfig.from_dict({"made_for": {"model": "m:f", "layers": 3, "budget": 1000}})
    assert minimal.to_dict() == {"made_for": {"model": "m:f", "layers": 3, "budget": "1000"}}
    assert minimal.made_for == MadeFor(model="m:f", layers=3, budget="1000")
    hash(config)  # configs stay hashable


@pytest.mark.parametrize(
    ("made_for", "message_parts"),
    [
        ({"colour": "red"}, ["made_for.colour", "unknown field", "layer_classes", "actplan_version"]),
        ({"model": None}, ["made_for.model"]),
        ({"layer_classes": {"DecoderLayer": "0"}}, ["made_for", "no class for layers 1"]),
        ({"layer_classes": {"A": "0-1", "B": "1"}}, ["layer 1 is given to both A and B"]),
        ({"layer_classes": {"A": "0-2"}}, ["layers 2 are past the last of 2"]),
        ({"layer_classes": ["DecoderLayer"]}, ["made_for.layer_classes", "{DecoderLayer: '0-7'}"]),
        ({"layer_classes": {"A": "0-x"}}, ["'0-x'", "range"]),
        ({"layers": 0, "layer_classes": None}, ["layers: 0", "at least 1"]),
        ({"seq": -4}, ["seq: -4 is not positive"]),
        ({"layer_input": []}, ["layer_input: [] is not a shape", "[2, 512, 256]"]),
        ({"layer_input": [2, 0, 64]}, ["layer_input: [2, 0, 64] is not a shape"]),
    ],
)
def test_made_for_is_validated_strictly(made_for, message_parts):
    data = {**MADE_FOR, **made_for}
    data = {key: value for key, value in data.items() if value is not None or key != "layer_classes"}
    with pytest.raises(ConfigError) as err:
        RecomputeConfig.from_dict({"made_for": data})
    for part in message_parts:
        assert part in str(err.value)


def test_made_for_requires_the_model_and_the_layer_count():
    with pytest.raises(ConfigError, match=r"made_for\.layers"):
        RecomputeConfig.from_dict({"made_for": {"model": "dense"}})


def test_a_config_made_for_this_model_applies():
    bundle = build_model("dense", "tiny")
    plan = actplan.apply(bundle.model, _config())
    assert [layer.mode for layer in plan.layers] == ["selective", "selective"]
    assert len(_wrapped(bundle.model)) == 2
    # Without the block nothing is checked, as before.
    other = build_model("dense", "tiny", n_layers=3)
    assert len(actplan.plan_for(other.model, "matmuls").layers) == 3


def test_a_config_made_for_another_layer_count_is_an_error_naming_both(tmp_path):
    path = tmp_path / "plan.yaml"
    _config().dump(path)
    bundle = build_model("dense", "tiny", n_layers=3)
    with pytest.raises(ConfigError) as err:
        actplan.apply(bundle.model, path)
    message = str(err.value)
    assert "2 layers (DecoderLayer 0-1)" in message and "3 layers (DecoderLayer 0-2)" in message
    assert "layer counts differ" in message and "--model dense --size tiny" in message
    assert f"in {path} (line 1): made_for" in message  # the file and the block's line
    assert "delete the made_for block" in message
    assert _wrapped(bundle.model) == []  # raised before anything was wrapped


def test_a_config_made_for_other_layer_classes_is_an_error_naming_both():
    config = _config(layer_classes={"LlamaDecoderLayer": "0", "MistralDecoderLayer": "1"})
    bundle = build_model("dense", "tiny")
    with pytest.raises(ConfigError) as err:
        actplan.apply(bundle.model, config)
    message = str(err.value)
    assert "(LlamaDecoderLayer 0, MistralDecoderLayer 1)" in message
    assert "2 layers (DecoderLayer 0-1)" in message and "layer classes differ" in message
    assert _wrapped(bundle.model) == []


def test_a_plan_made_for_a_factory_model_is_refused_on_the_default_model(tmp_path, capsys):
    # Once, `actplan explain/bench --config plan.yaml` without --model resolved a plan made for
    # a 2-layer factory model onto the default dense model without a word.
    path = tmp_path / "plan.yaml"
    _config(model="model_factories:dense_long", size=None).dump(path)
    assert main(["explain", "--size", "tiny", "--model", "moe", "--config", str(path)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "model 'model_factories:dense_long': 2 layers (DecoderLayer 0-1)" in out
    assert "(on the command line: --model model_factories:dense_long)" in out
    assert main(["explain", "--model", "model_factories:dense_long", "--config", str(path)]) == 0


@pytest.mark.slow
def test_the_file_actplan_plan_writes_states_its_model_and_every_layers_choice(
    dense, cache, tmp_path, capsys
):
    bundle, _ = dense
    out = tmp_path / "plan.yaml"
    args = ["plan", "--model", "model_factories:dense_long", "--budget", "80%", "--min-bytes", "0"]
    args += ["--cache-dir", str(cache), "--out", str(out), "--plot", "", "--no-run", "--quiet"]
    assert main(args) == 0
    capsys.readouterr()
    text = out.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert header[0].startswith("# Made by actplan plan for model 'model_factories:dense_long': 2 layers")
    assert "budget 80% (" in header[0] and header[1].startswith("# Predicted peak ")
    layers = [line for line in header if line.startswith("#   layer ")]
    assert [line.split(" (")[0] for line in layers] == ["#   layer 0", "#   layer 1"]
    config = RecomputeConfig.from_file(out)
    plan = actplan.plan_for(bundle.model, config)
    for line, layer in zip(layers, plan.layers, strict=True):
        assert (
            line == f"#   layer {layer.index} ({layer.name}, {layer.class_name}): {layer.describe_choice()}"
        )
    made = config.made_for
    assert (made.model, made.size, made.layers) == ("model_factories:dense_long", None, 2)
    assert made.layer_classes == (("DecoderLayer", "0-1"),)
    assert (made.batch, made.seq, made.dtype, made.device) == (16, 64, "float32", "cpu")
    assert made.layer_input == (16, 64, 64)  # dense tiny's width
    assert made.budget == "80%" and made.budget_bytes > 0
    assert made.actplan_version == "0.1.0"


def test_the_first_forward_checks_the_width_and_the_tokens_the_plan_was_made_for():
    import copy
    import warnings

    # Another width with the same layers is another model: an error naming both shapes, on
    # every call until the plan is removed; deepcopy keeps the check.
    wide = build_model("dense", "tiny", dim=128)
    actplan.apply(wide.model, _config())
    copied = copy.deepcopy(wide.model)
    for model in (wide.model, wide.model, copied):
        with pytest.raises(ConfigError) as err:
            model(**wide.batch(0))
        message = " ".join(str(err.value).split())
        assert "first layer's input is [2, 16, 64] (width 64), but this model's is [2, 16, 128]" in message
        assert "delete made_for's layer_input" in message
    actplan.remove(copied)
    copied(**wide.batch(0))["loss"].backward()
    # More tokens than planned: one warning, at the user's line; as many or fewer: nothing.
    for batch_size, seq_len, warned in ((2, 16, False), (1, 8, False), (4, 16, True)):
        bundle = build_model("dense", "tiny", batch_size=batch_size, seq_len=seq_len)
        actplan.apply(bundle.model, _config())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                bundle.model(**bundle.batch(0))["loss"].backward()
        notes = [str(w.message) for w in caught if "tokens per layer call" in str(w.message)]
        assert len(notes) == int(warned), (batch_size, seq_len, notes)
        if warned:
            assert "made for 32 tokens per layer call (first layer's input [2, 16, 64])" in notes[0]
            assert "runs 64 ([4, 16, 64]), 2.00x" in notes[0]
            assert caught[0].filename == __file__
    # A config without layer_input is not checked.
    unrecorded = build_model("dense", "tiny", dim=128)
    actplan.apply(unrecorded.model, _config(layer_input=None))
    unrecorded.model(**unrecorded.batch(0))["loss"].backward()

"""The installer itself: layers found through registered integrations, the order of
declarations, and what ``apply`` leaves on a model and ``remove`` takes away."""

from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch
from torch import nn

import actplan
from actplan import integrations
from actplan._install.apply import (
    interval_map_of,
    layer_specs,
    offload_engine,  # the model's own engine slot
)
from actplan.config import ConfigError
from actplan.markers import checkpoint_record
from actplan.models import build_model
from actplan.units import MarkerInterval, RecomputeIntervalMap, RecomputeUnit

WIDTH = 8


class ToyBlock(nn.Module):
    """A layer of a pretend framework: no ``recompute_intervals``, no markers in its code."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class ToyNet(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ToyBlock() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# What the pretend integration knows about its blocks: each submodule call is one unit.
TOY_MAP = RecomputeIntervalMap(
    {
        "mlp_up": MarkerInterval("up:enter", "up:exit"),
        "mlp_down": MarkerInterval("down:enter", "down:exit"),
    }
)


class ToySource:
    """A third-party ``LayerSource`` for ``ToyBlock``: it gives the map and, once prepared,
    makes the blocks emit the markers by hooks on their submodules."""

    name = "toy-for-tests"

    def __init__(self, gives_maps: bool = True) -> None:
        self.gives_maps = gives_maps
        self.calls: list[tuple[str, nn.Module]] = []  # ("prepare" | "release", model), in order
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    def recognises(self, model: nn.Module) -> bool:
        return any(isinstance(m, ToyBlock) for m in model.modules())

    def interval_map(self, module: nn.Module) -> RecomputeIntervalMap | None:
        return TOY_MAP if self.gives_maps and isinstance(module, ToyBlock) else None

    def layer_maps(self, model: nn.Module, layouts: object) -> dict[int, RecomputeIntervalMap | None]:
        if not self.gives_maps:
            return {}
        return {id(m): TOY_MAP for m in model.modules() if isinstance(m, ToyBlock)}

    def saved_layouts(self, model: nn.Module) -> dict[str, object]:
        return {}

    def prepare(self, model: nn.Module, layouts: object) -> None:
        self.calls.append(("prepare", model))
        for block in (m for m in model.modules() if isinstance(m, ToyBlock)):
            for name in ("up", "down"):
                sub = getattr(block, name)
                self._hooks.append(sub.register_forward_pre_hook(_marker(f"{name}:enter")))
                self._hooks.append(sub.register_forward_hook(_marker(f"{name}:exit")))

    def release(self, model: nn.Module) -> None:
        self.calls.append(("release", model))
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def no_layers_error(self, model: nn.Module, layouts: object) -> Exception:
        return ConfigError("toy blocks found, but this toy source was given no layout for them")


def _marker(marker: str):
    def hook(*_: object) -> None:
        checkpoint_record(marker)

    return hook


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch):
    """A private copy of the integration registry, restored after the test."""
    monkeypatch.setattr(integrations, "_registered", list(integrations._registered))
    monkeypatch.setattr(integrations, "_loaded", integrations._loaded)
    return integrations


@pytest.fixture
def toy_source(registry) -> ToySource:
    source = ToySource()
    registry.register(source)
    return source


def loss_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------
# A registered third-party integration


def test_a_toy_block_is_no_layer_without_its_integration(registry):
    assert actplan.lowlevel.find_layers(ToyNet()) == []
    with pytest.raises(ConfigError, match="declares no checkpointable layers"):
        actplan.plan_for(ToyNet(), "full")


def test_find_layers_uses_a_registered_integration(toy_source):
    model = ToyNet()
    assert [name for name, _ in actplan.lowlevel.find_layers(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(interval_map_of(block) is TOY_MAP for block in model.blocks)
    assert interval_map_of(model.head) is None


def test_apply_prepares_the_integration_once_and_remove_releases_it(toy_source):
    model = ToyNet()
    plan = actplan.apply(model, {"keep": ["mlp_up"]})
    # apply first removes whatever was installed, which releases (a no-op here), then prepares.
    assert toy_source.calls == [("release", model), ("prepare", model)]
    assert len(model.blocks[0].up._forward_pre_hooks) == 1
    assert [(layer.name, layer.class_name, layer.mode) for layer in plan.layers] == [
        (f"blocks.{i}", "ToyBlock", "selective") for i in range(3)
    ]
    assert all(layer.kept_units == (RecomputeUnit.MLP_UP,) for layer in plan.layers)
    assert all(actplan.lowlevel.is_checkpointed(block) for block in model.blocks)

    assert actplan.remove(model) == 3
    assert toy_source.calls[2:] == [("release", model)]
    assert not model.blocks[0].up._forward_pre_hooks
    assert not any(actplan.lowlevel.is_checkpointed(block) for block in model.blocks)


def test_applying_again_releases_then_prepares_again(toy_source):
    model = ToyNet()
    actplan.apply(model, "full")
    actplan.apply(model, {"keep": ["mlp_down"]})
    assert [call for call, _ in toy_source.calls] == ["release", "prepare", "release", "prepare"]
    # The hooks of the first install are gone: one pair per submodule, not two.
    assert len(model.blocks[0].up._forward_pre_hooks) == 1


def test_markers_from_the_integrations_hooks_drive_the_kept_units(toy_source):
    torch.manual_seed(0)
    model, x = ToyNet(), torch.randn(4, WIDTH)
    expected_loss, expected_grads = loss_and_grads(model, x)

    actplan.apply(model, {"keep": ["mlp_up"]})
    loss, grads = loss_and_grads(model, x)
    assert torch.equal(loss, expected_loss)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Only markers from the hooks prepare installed can open the kept interval.
    held = actplan.lowlevel.installed_plan(model).held_by_layer()
    assert set(held) == {"blocks.0", "blocks.1", "blocks.2"}
    assert all(layer["mlp_up"]["held"] > 0 for layer in held.values())


def test_a_recognised_model_without_maps_raises_the_integrations_own_error(registry):
    source = ToySource(gives_maps=False)
    registry.register(source)
    model = ToyNet()
    assert actplan.lowlevel.find_layers(model) == []
    with pytest.raises(ConfigError, match="given no layout"):
        actplan.apply(model, "full")
    assert source.calls == []  # the error comes before the model is touched


def test_registering_the_same_name_again_replaces_the_source(registry):
    first, second = ToySource(gives_maps=False), ToySource()
    registry.register(first)
    registry.register(second)
    assert first not in registry.sources() and second in registry.sources()
    assert len(actplan.lowlevel.find_layers(ToyNet())) == 3


# ---------------------------------------------------------------------------------------
# Declarations


OWN_MAP = RecomputeIntervalMap({"mlp_act": MarkerInterval("act_start", "act_end")})


class DeclaringBlock(ToyBlock):
    """A ``ToyBlock`` whose class declares its own map."""

    recompute_intervals = OWN_MAP


def test_interval_map_of_prefers_the_modules_own_declaration(toy_source):
    assert interval_map_of(DeclaringBlock()) is OWN_MAP
    assert interval_map_of(ToyBlock()) is TOY_MAP


def test_a_declaring_layer_keeps_its_own_map_inside_a_recognised_model(toy_source):
    model = ToyNet(depth=2)
    model.blocks[1] = DeclaringBlock()
    specs = layer_specs(model)
    assert [(spec.class_name, spec.interval_map) for spec in specs] == [
        ("ToyBlock", TOY_MAP),
        ("DeclaringBlock", OWN_MAP),
    ]


def test_interval_map_of_ignores_a_declaration_that_is_not_a_map(registry):
    class PlainDict(nn.Module):
        recompute_intervals = {"mlp_act": MarkerInterval("a", "b")}  # noqa: RUF012

    assert interval_map_of(PlainDict()) is None


# ---------------------------------------------------------------------------------------
# What apply leaves and remove takes


def test_installed_plan_and_remove_round_trip(toy_source):
    model = ToyNet()
    assert actplan.lowlevel.installed_plan(model) is None
    plan = actplan.apply(model, {"keep": ["mlp_up"], "overrides": [{"layers": 2, "mode": "none"}]})
    assert actplan.lowlevel.installed_plan(model) is plan
    assert [layer.mode for layer in plan.layers] == ["selective", "selective", "none"]
    assert [actplan.lowlevel.is_checkpointed(block) for block in model.blocks] == [True, True, False]

    assert actplan.remove(model) == 2
    assert actplan.lowlevel.installed_plan(model) is None
    assert offload_engine(model) is None
    assert not any(actplan.lowlevel.is_checkpointed(m) for m in model.modules())
    # Removed, the model is found and planned as before, and a second remove finds nothing.
    assert len(actplan.lowlevel.find_layers(model)) == 3
    assert actplan.remove(model) == 0


def test_a_failed_apply_leaves_the_installed_plan_in_place(toy_source):
    model = ToyNet()
    plan = actplan.apply(model, "full")
    with pytest.raises(ConfigError, match="out of range"):
        actplan.apply(model, {"layers": 7})
    assert actplan.lowlevel.installed_plan(model) is plan
    assert all(actplan.lowlevel.is_checkpointed(block) for block in model.blocks)
    assert [call for call, _ in toy_source.calls] == ["release", "prepare"]


# ---------------------------------------------------------------------------------------------
# The public face: a small top level, the engine's pieces in actplan.lowlevel, reports on the plan


def test_the_top_level_is_the_small_face_and_every_name_in_it_exists():
    assert set(actplan.__all__) == {
        "PRESETS", "ConfigError", "KeptTensorMutatedError", "MarkerError", "MarkerInterval",
        "OffloadedTensorMutatedError", "Plan", "RecomputeConfig", "RecomputeIntervalMap", "RecomputeUnit",
        "TorchInternalsError", "apply", "apply_gradient_checkpointing", "checkpoint_record", "parallelize",
        "plan_for", "remove",
    }  # fmt: skip
    assert all(hasattr(actplan, name) for name in actplan.__all__)
    assert all(hasattr(actplan.lowlevel, name) for name in actplan.lowlevel.__all__)
    assert set(actplan.config.__all__) == {
        "PRESETS", "ConfigError", "LayerOverride", "LayerSelector", "OffloadConfig", "RecomputeConfig"
    }


@pytest.mark.parametrize(
    "name, where",
    [
        ("IntervalPolicy", "actplan.lowlevel.IntervalPolicy"),
        ("find_layers", "actplan.lowlevel.find_layers"),
        ("ActplanAC", "actplan.torchtitan.ActplanAC"),
        ("apply_to_torchtitan", "actplan.apply(model, config, layouts=...)"),
        ("remove_gradient_checkpointing", "actplan.remove(module)"),
        ("held_by_unit", "plan.held_by_unit(), on the plan actplan.apply returns"),
        ("offload_engine", "plan.offload_engine"),
        ("OffloadConfig", "actplan.config.OffloadConfig"),
    ],
)
def test_a_moved_name_says_where_it_went(name, where):
    with pytest.raises(AttributeError, match=re.escape(f"actplan.{name} has moved: use {where}")):
        getattr(actplan, name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        actplan.nothing_here  # noqa: B018


def test_apply_gradient_checkpointing_takes_no_installer_plumbing():
    with pytest.raises(TypeError, match="owner"):
        actplan.apply_gradient_checkpointing(nn.Linear(2, 2), owner=object())
    layer = actplan.apply_gradient_checkpointing(nn.Linear(2, 2))
    assert actplan.lowlevel.is_checkpointed(layer)
    assert actplan.remove(layer) == 1 and not actplan.lowlevel.is_checkpointed(layer)


def test_the_installed_plan_reports_what_its_layers_hold_until_it_is_removed():
    bundle = build_model("dense", "tiny", n_layers=2)
    model = bundle.model
    offload = {"units": ["mlp_up"], "skip_last": 0, "min_bytes": 0}
    plan = actplan.apply(model, {"keep": ["mlp_up"], "offload": offload})
    model(**bundle.make_batch(0))["loss"].backward()
    held = plan.held_by_unit()
    assert held["mlp_up"]["held"] > 0 and held == _summed(plan.held_by_layer())
    assert plan.offload_engine is not None and plan.offload_engine.stats.tensors_offloaded > 0
    assert copy.deepcopy(plan) == plan and type(pickle.loads(pickle.dumps(plan))) is actplan.Plan
    later = actplan.apply(model, "attn")
    assert later == actplan.plan_for(model, "attn")  # the same layers and config
    with pytest.raises(RuntimeError, match="no longer installed"):
        plan.held_by_unit()  # replaced by the later apply
    actplan.remove(model)
    with pytest.raises(RuntimeError, match="no longer installed"):
        later.offload_engine  # noqa: B018


def _summed(layers: dict) -> dict:
    totals: dict = {}
    for units in layers.values():
        for unit, sizes in units.items():
            entry = totals.setdefault(unit, {"held": 0, "autograd": 0})
            entry["held"] += sizes["held"]
            entry["autograd"] += sizes["autograd"]
    return totals

"""Install a resolved plan on a model: ``apply(model, config)`` and ``remove(model)``.

The torch side of planning: find the checkpointable layers (modules whose class
declares ``recompute_intervals``), resolve the config against them with the
pure ``plan`` module, and wrap each layer with the boundary and its policy.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from actplan import integrations
from actplan._callsite import warn
from actplan._engine.boundary import (
    RuntimeOnly,
    checkpoint_state,
    remove_gradient_checkpointing,
    wrap_for_checkpoint,
)
from actplan._engine.offload import OffloadEngine
from actplan._engine.offload_wrapper import apply_offload, is_offloaded, remove_offload
from actplan._engine.policy import IntervalPolicy, MarkerChecker
from actplan._install.plan import LayerPlan, LayerSpec, Plan, format_indices, resolve_plan
from actplan._torch_internals import tree_leaves
from actplan.config import ConfigError, RecomputeConfig
from actplan.config._made_for import MadeFor
from actplan.units import RecomputeIntervalMap

_PLAN_ATTR = "_actplan_plan"
_ENGINE_ATTR = "_actplan_offload_engine"
_SHAPE_CHECK_ATTR = "_actplan_shape_check"


@dataclass
class _Installed(RuntimeOnly):
    """The installed plan or offload engine, stored on the model; pickling leaves it behind."""

    value: Any


def _installed(model: nn.Module, attr: str) -> Any:
    box = model.__dict__.get(attr)
    return box.value if box is not None else None


def interval_map_of(module: nn.Module) -> RecomputeIntervalMap | None:
    """The ``RecomputeIntervalMap`` a module declares, else the one a registered integration
    gives for it (for a Hugging Face decoder layer, its built-in or derived map), else ``None``."""
    declared = getattr(module, "recompute_intervals", None)
    if isinstance(declared, RecomputeIntervalMap):
        return declared
    for source in integrations.sources():
        found = source.interval_map(module)
        if found is not None:
            return found
    return None


def find_layers(model: nn.Module, layouts: integrations.Layouts | None = None) -> list[tuple[str, nn.Module]]:
    """Checkpointable layers in forward-declaration order, outermost only.

    ``layouts`` (Hugging Face models: decoder-layer class name -> unit -> spans) take
    precedence over declarations and derived layouts for the classes they name."""
    return [(name, module) for name, module, _ in _layers_with_maps(model, layouts)]


def _layers_with_maps(
    model: nn.Module, layouts: integrations.Layouts | None
) -> list[tuple[str, nn.Module, RecomputeIntervalMap]]:
    # Layers of an integration's framework: a layout given here, else a declaration already
    # made (perhaps with other layouts), else the integration's own map.
    from_source: dict[int, RecomputeIntervalMap | None] = {}
    for source in integrations.recognising(model):
        from_source.update(source.layer_maps(model, layouts))
    given = set(layouts or ())
    found: list[tuple[str, nn.Module, RecomputeIntervalMap]] = []
    for name, module in model.named_modules():
        if any(name.startswith(outer + ".") for outer, _, _ in found):
            continue
        declared = getattr(module, "recompute_intervals", None)
        if id(module) in from_source and (type(module).__name__ in given or declared is None):
            interval_map = from_source[id(module)]
        else:
            interval_map = interval_map_of(module)
        if interval_map is not None:
            found.append((name, module, interval_map))
    return found


def layer_specs(model: nn.Module, layouts: integrations.Layouts | None = None) -> list[LayerSpec]:
    return [
        LayerSpec(index=i, name=name or "<root>", class_name=type(m).__name__, interval_map=interval_map)
        for i, (name, m, interval_map) in enumerate(_layers_with_maps(model, layouts))
    ]


def plan_for(
    model: nn.Module,
    config: RecomputeConfig | dict | str | Path,
    layouts: integrations.Layouts | None = None,
) -> Plan:
    """Resolve ``config`` against ``model``'s layers without touching the model.

    ``layouts``: as for ``apply``."""
    specs = layer_specs(model, layouts)
    for source in integrations.recognising(model) if not specs else ():
        # A framework's model with no usable layout: its own error says what was found and
        # how to pass a layout.
        raise source.no_layers_error(model, layouts)
    if not specs:
        _reject_plain_dict_declarations(model)
    try:
        parsed = RecomputeConfig.parse(config)
    except ConfigError as err:
        if "unknown recompute unit" not in str(err):
            raise
        declared = {u.value: None for spec in specs for u in spec.interval_map.units}
        raise ConfigError(f"{err}\nunits this model declares: {', '.join(declared) or 'none'}") from None
    return resolve_plan(parsed, specs)


def _reject_plain_dict_declarations(model: nn.Module) -> None:
    # A plain dict is not a declaration (find_layers ignores it): say how to make it one.
    classes = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if isinstance(getattr(m, "recompute_intervals", None), dict)
        }
    )
    if classes:
        raise ConfigError(
            f"{', '.join(classes)} set recompute_intervals to a plain dict, which actplan does not read, "
            "so the model declares no checkpointable layers; wrap it: recompute_intervals = "
            "RecomputeIntervalMap({...}) (from actplan import RecomputeIntervalMap)"
        )


@dataclass(frozen=True, eq=False)
class InstalledPlan(Plan):
    """The ``Plan`` ``apply`` installed, with what it reports about the model it runs on.

    ``held_by_layer()`` and ``held_by_unit()``: per selective layer (or summed) and kept unit,
    the bytes its latest eager forward held at its end next to what autograd keeps for the
    same ops without checkpointing. ``offload_engine``: the ``OffloadEngine`` of a config with
    ``offload`` (its ``stats``: bytes moved each way, host-pool use), else ``None``. Each
    raises ``RuntimeError`` once the plan is no longer installed (``actplan.remove``, a later
    ``apply``). Pickled or copied, it is a plain ``Plan``."""

    model_ref: Any = field(default=None, compare=False, repr=False)

    def _model(self) -> nn.Module:
        model = self.model_ref() if self.model_ref is not None else None
        if model is None or installed_plan(model) is not self:
            raise RuntimeError(
                "this plan is no longer installed (removed, replaced by a later actplan.apply, or "
                "its model is gone); ask the Plan the latest apply returned"
            )
        return model

    def held_by_layer(self) -> dict[str, dict[str, dict[str, int]]]:
        """See ``held_by_layer(model)``."""
        return held_by_layer(self._model())

    def held_by_unit(self) -> dict[str, dict[str, int]]:
        """See ``held_by_unit(model)``."""
        return held_by_unit(self._model())

    @property
    def offload_engine(self) -> OffloadEngine | None:
        """See ``offload_engine(model)``."""
        return offload_engine(self._model())

    def __reduce__(self) -> tuple:
        return (Plan, (self.layers, self.config))


def apply(
    model: nn.Module,
    config: RecomputeConfig | dict[str, Any] | str | Path,
    layouts: integrations.Layouts | None = None,
) -> InstalledPlan:
    """Resolve ``config`` to a per-layer plan and install it on ``model``'s layers.

    ``config`` is a ``RecomputeConfig``, a dict, a preset name (``"matmuls"``) or
    a path to a YAML/JSON file. A plan installed earlier is removed first. A config
    with ``offload`` also gets an ``OffloadEngine`` (the returned plan's ``offload_engine``).
    ``layouts`` declares the units of Hugging Face decoder layers actplan has no built-in
    or derived layout for, by class name (see ``actplan.integrations.hf``); layouts given
    to an earlier ``actplan.integrations.hf.declare(model, layouts=...)`` are kept.
    Returns the installed plan (``InstalledPlan``: a ``Plan`` that also reports what its
    layers hold).
    """
    sources = integrations.recognising(model)
    layouts = _with_saved_layouts(model, sources, layouts)
    plan = plan_for(model, config, layouts)
    remove(model)
    for source in sources:
        source.prepare(model, layouts)  # markers for its layers (hooks on their submodules)
    layers = [
        (layer_plan, module)
        for layer_plan, (_, module) in zip(plan.layers, find_layers(model, layouts), strict=True)
    ]
    engine = _attach_offload_engine(model, plan)
    policies = _shared_policies(layers, engine)
    for layer_plan, module in layers:
        _install_layer(layer_plan, module, policies, engine, _call_check(sources, module))
    installed = InstalledPlan(plan.layers, plan.config, weakref.ref(model))
    model.__dict__[_PLAN_ATTR] = _Installed(installed)
    made = plan.config.made_for
    if made is not None and made.layer_input is not None and layers:
        model.__dict__[_SHAPE_CHECK_ATTR] = _Installed(_FirstInputCheck(made, layers[0][1]))
    return installed


class _FirstInputCheck:
    """A forward pre-hook on the first layer: on its first eager call, the input against
    ``made.layer_input``. Another width is a ``ConfigError`` (another model); more tokens a
    warning (the planned peak does not hold). Once an input passes it removes itself; a compiled
    forward skips it. Deepcopy copies it with its handle; a pickled model loads a check
    that has passed (its plan is not installed there)."""

    def __init__(self, made: MadeFor | None, first: nn.Module | None = None) -> None:
        self.made = made
        self.handle = None if first is None else first.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.made is None or torch.compiler.is_compiling():
            return
        tensor = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
        shape = () if tensor is None else tuple(tensor.shape)
        if (mismatch := self.made.width_mismatch(shape)) is not None:
            raise ConfigError(mismatch)
        note, self.made = self.made.more_tokens(shape), None
        self.remove()  # passed: later calls pay nothing
        if note is not None:
            warn(note)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()

    def __reduce__(self) -> tuple:
        return (_FirstInputCheck, (None,))

    def __deepcopy__(self, memo: dict[int, Any]) -> _FirstInputCheck:
        new = object.__new__(_FirstInputCheck)
        memo[id(self)] = new
        new.made, new.handle = self.made, copy.deepcopy(self.handle, memo)  # the copy's hook dict
        return new


def _with_saved_layouts(
    model: nn.Module, sources: list[integrations.LayerSource], layouts: integrations.Layouts | None
) -> integrations.Layouts | None:
    """``layouts`` over those an earlier install gave the recognising integrations (None if none)."""
    saved = {name: layout for source in sources for name, layout in source.saved_layouts(model).items()}
    return {**saved, **(layouts or {})} or None


def _attach_offload_engine(model: nn.Module, plan: Plan) -> OffloadEngine | None:
    """The ``OffloadEngine`` for a config with ``offload``, attached to ``model``; else None."""
    offload = plan.config.offload
    if offload is None:
        return None
    engine = OffloadEngine(
        min_bytes=offload.min_bytes, host_cap_bytes=offload.host_cap, prefetch=offload.prefetch
    )
    engine.attach(model)
    model.__dict__[_ENGINE_ATTR] = _Installed(engine)
    return engine


def _install_layer(
    layer_plan: LayerPlan,
    module: nn.Module,
    policies: dict[tuple, IntervalPolicy],
    engine: OffloadEngine | None,
    call_check: Callable[..., None] | None = None,
) -> None:
    """Wrap one layer as its plan says: the checkpoint wrapper, then the offload wrapper."""
    name = f"{layer_plan.name} ({layer_plan.class_name})"
    if layer_plan.checkpointed:
        policy = policies.get(_policy_key(layer_plan, module))
        check = None
        if policy is None and (interval_map := interval_map_of(module)) is not None:
            # Full recompute decides nothing by markers, but wrong ones are still an error.
            check = MarkerChecker(interval_map, name)
        wrap_for_checkpoint(
            module, policy=policy, owner=layer_plan, name=name, marker_check=check, call_check=call_check
        )
    if layer_plan.offloads:
        # Kept units of a selective layer move through its policy; this wrapper owns the
        # layer's group, its input, and the units of a layer that is not checkpointed.
        apply_offload(
            module,
            engine,
            name=name,
            layer_input=layer_plan.offload_input,
            intervals=layer_plan.offload_intervals if not layer_plan.checkpointed else (),
            what=layer_plan.describe_offload(),
            position=layer_plan.index,
        )


def _call_check(sources: list[integrations.LayerSource], module: nn.Module) -> Callable[..., None] | None:
    """The first check an integration gives for ``module``'s checkpointed calls (optional method)."""
    for source in sources:
        check = getattr(source, "call_check", None)
        found = check(module) if check is not None else None
        if found is not None:
            return found
    return None


def offload_engine(model: nn.Module) -> OffloadEngine | None:
    """The ``OffloadEngine`` of the installed plan (``None`` without offload); its
    ``stats`` report bytes moved each way and host-pool usage."""
    return _installed(model, _ENGINE_ATTR)


def held_by_layer(model: nn.Module) -> dict[str, dict[str, dict[str, int]]]:
    """Per selective layer and kept unit (``routing`` for routing and collective outputs):
    ``held``, the bytes the layer's latest eager forward held at its end, and ``autograd``,
    what autograd keeps for the same ops without checkpointing (the tensors they save and
    those of their outputs any op saves). Layers that have not run eagerly are absent."""
    layers: dict[str, dict[str, dict[str, int]]] = {}
    for name, module in find_layers(model):
        state = checkpoint_state(module)
        if state is None or state.policy is None:
            continue
        policy = state.policy
        report = policy.held_reports().get(state.name or policy.layer_name)
        if report is None:
            continue
        units: dict[str, dict[str, int]] = {}
        for interval in set(report.held) | set(report.autograd):
            unit = "routing" if interval is None else policy.interval_map.unit_of(interval).value
            entry = units.setdefault(unit, {"held": 0, "autograd": 0})
            entry["held"] += report.held.get(interval, 0)
            entry["autograd"] += report.autograd.get(interval, 0)
        layers[name] = {unit: sizes for unit, sizes in units.items() if sizes["held"] or sizes["autograd"]}
    return layers


def held_by_unit(model: nn.Module) -> dict[str, dict[str, int]]:
    """``held_by_layer`` summed over the layers, per kept unit."""
    totals: dict[str, dict[str, int]] = {}
    for units in held_by_layer(model).values():
        for unit, sizes in units.items():
            entry = totals.setdefault(unit, {"held": 0, "autograd": 0})
            entry["held"] += sizes["held"]
            entry["autograd"] += sizes["autograd"]
    return totals


def _policy_key(layer: LayerPlan, module: nn.Module) -> tuple | None:
    # Full layers that keep routing outputs run the policy with nothing kept.
    if layer.mode == "none" or (layer.mode == "full" and not layer.routing_saved):
        return None
    offloaded = layer.offload_intervals if layer.mode == "selective" else frozenset()
    return (layer.class_name, interval_map_of(module), layer.kept_intervals, layer.routing_saved, offloaded)


def _shared_policies(
    layers: list[tuple[LayerPlan, nn.Module]], engine: OffloadEngine | None
) -> dict[tuple, IntervalPolicy]:
    """One policy per distinct (layer class, kept intervals), shared by its layers.

    ``torch.compile`` guards on the policy object inside ``context_fn``: one object
    per layer would recompile every layer and, past dynamo's recompile limit, make
    ``fullgraph=True`` fail. Shared, layers with the same plan reuse one graph.
    """
    members: dict[tuple, list[LayerPlan]] = {}
    for layer, module in layers:
        key = _policy_key(layer, module)
        if key is not None:
            members.setdefault(key, []).append(layer)
    policies = {}
    for key, layers in members.items():
        class_name, interval_map, kept, routing_saved, offloaded = key
        where = layers[0].name if len(layers) == 1 else f"layers {format_indices([x.index for x in layers])}"
        policies[key] = IntervalPolicy(
            interval_map,
            kept,
            layer_name=f"{class_name} ({where})",
            save_collectives=routing_saved,
            offload_intervals=offloaded,
            offloader=engine if offloaded else None,
        )
    return policies


def installed_plan(model: nn.Module) -> Plan | None:
    """The plan ``apply`` last installed on ``model``, if it is still installed."""
    return _installed(model, _PLAN_ATTR)


def remove(model: nn.Module) -> int:
    """Remove every actplan checkpoint and offload wrapper under ``model``; returns how many
    layers were checkpointed."""
    removed = 0
    for module in model.modules():
        # The offload wrapper sits outside the checkpoint wrapper: unwrap it first.
        if is_offloaded(module):
            remove_offload(module)
        if checkpoint_state(module) is not None:
            removed += remove_gradient_checkpointing(module)
    model.__dict__.pop(_PLAN_ATTR, None)
    model.__dict__.pop(_ENGINE_ATTR, None)
    if (shape_check := model.__dict__.pop(_SHAPE_CHECK_ATTR, None)) is not None:
        shape_check.value.remove()
    for source in integrations.recognising(model):
        source.release(model)
    return removed

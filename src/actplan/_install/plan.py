"""Resolve a ``RecomputeConfig`` against a model's checkpointable layers into a per-layer plan.

Pure: the torch side reports each layer as a ``LayerSpec``; this module decides, layer by
layer, the mode and the kept units and intervals, and says where each choice came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from actplan.config import ConfigError, LayerOverride, OffloadConfig, RecomputeConfig
from actplan.config._choice import RecomputeChoice
from actplan.config._presets import Mode, preset_kept_units
from actplan.config._selectors import format_indices
from actplan.units import ROUTING_UNITS, MarkerInterval, RecomputeIntervalMap, RecomputeUnit

NOT_SELECTED = "not selected"


@dataclass(frozen=True)
class LayerSpec:
    """What the torch side reports for one checkpointable layer, in model order."""

    index: int
    name: str  # module path, e.g. "layers.3"
    class_name: str  # e.g. "DecoderLayer"
    interval_map: RecomputeIntervalMap


@dataclass(frozen=True)
class LayerPlan:
    """The resolved choice for one layer.

    ``kept_units`` follows the layer's declaration order and is empty unless the mode is
    selective; ``source`` says which part of the config decided it.
    """

    index: int
    name: str
    class_name: str
    mode: Mode
    kept_units: tuple[RecomputeUnit, ...]
    kept_intervals: frozenset[MarkerInterval]
    source: str
    # Routing/collective outputs saved instead of recomputed (see RecomputeConfig.save_collectives).
    routing_saved: bool = False
    # Units whose saved tensors move to host memory, and their intervals.
    offload_units: tuple[RecomputeUnit, ...] = ()
    offload_intervals: frozenset[MarkerInterval] = frozenset()
    # Whether the input the checkpoint saves moves to host memory.
    offload_input: bool = False

    @property
    def checkpointed(self) -> bool:
        return self.mode != "none"

    @property
    def offloads(self) -> bool:
        return self.offload_input or bool(self.offload_units)

    def describe_offload(self) -> str:
        """``'layer input, mlp_up'``: what this layer offloads ('' for nothing)."""
        parts = (["layer input"] if self.offload_input else []) + [u.value for u in self.offload_units]
        return ", ".join(parts)

    def describe_choice(self) -> str:
        """``'selective, keep attn_core, mlp_up; offload layer input'``: mode, kept units, offload."""
        return _describe_choice(self.mode, self.kept_units, self.describe_offload())


@dataclass(frozen=True, eq=False)
class Plan:
    """Every checkpointable layer's resolved choice, and the config it came from. Two plans are
    equal when their layers and config are (an installed plan equals the same plan resolved)."""

    layers: tuple[LayerPlan, ...]
    config: RecomputeConfig

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (self.layers, self.config) == (other.layers, other.config)

    def __hash__(self) -> int:
        return hash((self.layers, self.config))

    @property
    def checkpointed(self) -> tuple[LayerPlan, ...]:
        """The layers that get a checkpoint wrapper (mode full or selective)."""
        return tuple(layer for layer in self.layers if layer.checkpointed)

    def summary(self) -> str:
        """A few lines: layers grouped by identical mode and kept units."""
        groups: dict[tuple[str, tuple[RecomputeUnit, ...], str], list[int]] = {}
        for layer in self.layers:
            groups.setdefault((layer.mode, layer.kept_units, layer.describe_offload()), []).append(
                layer.index
            )
        offloading = sum(layer.offloads for layer in self.layers)
        extra = f", {offloading} offloading" if offloading else ""
        lines = [f"plan for {len(self.layers)} layers ({len(self.checkpointed)} checkpointed{extra}):"]
        for (mode, kept_units, offloaded), indices in groups.items():
            lines.append(
                f"  layers {format_indices(indices)}: {_describe_choice(mode, kept_units, offloaded)}"
            )
        return "\n".join(lines)

    def layer_lines(self) -> list[str]:
        """One line per layer: ``'layer 0 (layers.0, DecoderLayer): selective, keep attn_core'``."""
        return [
            f"layer {layer.index} ({layer.name}, {layer.class_name}): {layer.describe_choice()}"
            for layer in self.layers
        ]

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict of plain values per layer, for a table."""
        return [
            {
                "index": layer.index,
                "name": layer.name,
                "class_name": layer.class_name,
                "mode": layer.mode,
                "kept_units": ", ".join(u.value for u in layer.kept_units),
                "kept_intervals": len(layer.kept_intervals),
                "source": layer.source,
                "routing_saved": layer.routing_saved,
                "offload": layer.describe_offload(),
            }
            for layer in self.layers
        ]


def _describe_choice(mode: str, kept_units: Sequence[RecomputeUnit], offloaded: str) -> str:
    what = mode
    if mode == "selective":
        what += ", keep " + (", ".join(u.value for u in kept_units) if kept_units else "nothing")
    return what + (f"; offload {offloaded}" if offloaded else "")


def resolve_plan(config: RecomputeConfig, layer_specs: Sequence[LayerSpec]) -> Plan:
    """Decide each layer's mode and kept units from ``config``.

    The top level applies to the layers its ``layers`` selects; each override then
    replaces the choice for the layers it selects, later overrides winning. Layers no
    entry selects are not checkpointed. Raises ``ConfigError`` for a model with no
    checkpointable layers, a config made for another model (its ``made_for`` layer count or
    layer classes differ from the model's), an out-of-range selector, or an explicitly listed
    unit that a layer it applies to does not declare; for a config read from a file, the error
    names the file and the line of the field.
    """
    try:
        return _resolve_plan(config, tuple(layer_specs))
    except ConfigError as err:
        raise config.located(err) from None


def _resolve_plan(config: RecomputeConfig, specs: tuple[LayerSpec, ...]) -> Plan:
    if not specs:
        raise ConfigError(
            "the model declares no checkpointable layers; set a `recompute_intervals` class "
            "attribute (a RecomputeIntervalMap) on its layer classes"
        )
    for position, spec in enumerate(specs):
        if spec.index != position:
            raise ConfigError(
                f"layer spec {spec.name!r} has index {spec.index} at position {position}; "
                "report layers in model order with indices 0, 1, 2, ..."
            )
    if config.made_for is not None:
        # Before any selector is resolved: on another model, index errors would mislead.
        mismatch = config.made_for.mismatch([spec.class_name for spec in specs])
        if mismatch is not None:
            raise ConfigError(mismatch)

    # Each layer's deciding entry: (choice, field prefix for errors, label for `source`).
    deciding: list[tuple[RecomputeChoice, str, str] | None] = [None] * len(specs)
    for index in _resolve_selector(config, "layers", len(specs)):
        deciding[index] = (config, "", "top level")
    for position, override in enumerate(config.overrides):
        where = f"overrides[{position}]"
        for index in _resolve_selector(override, f"{where}.layers", len(specs)):
            deciding[index] = (override, f"{where}.", where)

    _reject_entries_that_decide_nothing(config, deciding)
    layers = tuple(
        _with_routing(_plan_layer(spec, deciding[spec.index]), spec, config.save_collectives)
        for spec in specs
    )
    if config.offload is not None:
        layers = _with_offload(layers, specs, config.offload)
    return Plan(layers=layers, config=config)


def _with_offload(
    layers: tuple[LayerPlan, ...], specs: tuple[LayerSpec, ...], offload: OffloadConfig
) -> tuple[LayerPlan, ...]:
    """Add the offload choices; a choice that would move nothing in a layer is an error."""
    selected = _offload_selection(offload, len(specs))
    out = list(layers)
    for index in selected:
        layer, spec = layers[index], specs[index]
        units = _offloaded_units(layer, spec, offload)
        out[index] = replace(
            layer,
            offload_units=units,
            offload_intervals=spec.interval_map.intervals_of(units),
            offload_input=offload.layer_input,
        )
    if (
        offload.units == "kept"
        and not offload.layer_input
        and not any(out[i].offload_units for i in selected)
    ):
        raise ConfigError(
            "offload.units: 'kept' offloads what each selected layer keeps, and none of them keeps a "
            "unit (they are full or not checkpointed), so it would move nothing; select layers with "
            "kept units, list units, or offload layer_input"
        )
    return tuple(out)


def _offload_selection(offload: OffloadConfig, num_layers: int) -> tuple[int, ...]:
    """The layers ``offload.layers`` selects, else every layer but the last ``skip_last``."""
    if offload.layers is not None:
        try:
            return offload.layers.resolve(num_layers)
        except ConfigError as err:
            raise ConfigError(f"offload.layers: {err}") from None
    skip = offload.skipped_last_layers
    selected = tuple(range(num_layers - skip))
    if not selected:
        raise ConfigError(
            f"offload skips the last {skip} layer(s) by default, which leaves none of this model's "
            f"{num_layers} layer(s); set offload.skip_last: 0 or select layers with offload.layers"
        )
    return selected


def _offloaded_units(layer: LayerPlan, spec: LayerSpec, offload: OffloadConfig) -> tuple[RecomputeUnit, ...]:
    """The units one selected layer offloads; an error if what offload asks of it would move nothing."""
    where = f"offload: layer {layer.index} ({layer.name}, {layer.class_name})"
    if offload.layer_input and not layer.checkpointed:
        raise ConfigError(
            f"{where} is not checkpointed, so there is no saved layer input to offload (its first "
            "ops save their own inputs); offload the units that read it instead (e.g. attn_norm), "
            "checkpoint the layer, or narrow offload.layers"
        )
    if offload.units == "kept":
        # Whatever each layer keeps; a layer keeping nothing is fine if another keeps units.
        return layer.kept_units
    _require_declared(offload.units, "offload.units", spec)
    units = tuple(u for u in spec.interval_map.units if u in offload.units)
    if units and layer.mode == "full":
        raise ConfigError(
            f"{where} is fully recomputed: it saves no unit outputs, only its input, so "
            f"offloading {', '.join(u.value for u in units)} would do nothing; use "
            "layer_input: true, keep those units (mode: selective), or narrow offload.layers"
        )
    recomputed = [u.value for u in units if layer.mode == "selective" and u not in layer.kept_units]
    if recomputed:
        raise ConfigError(
            f"{where} recomputes {', '.join(recomputed)}, so nothing of it is saved to offload; "
            "keep those units there or drop them from offload.units"
        )
    return units


def _with_routing(layer: LayerPlan, spec: LayerSpec, save_collectives: bool | str) -> LayerPlan:
    if layer.mode == "none":
        return layer
    if save_collectives == "auto":
        routes = layer.mode == "selective" or bool(ROUTING_UNITS & set(spec.interval_map.units))
    else:
        routes = bool(save_collectives)
    return replace(layer, routing_saved=routes)


def _reject_entries_that_decide_nothing(
    config: RecomputeConfig, deciding: list[tuple[RecomputeChoice, str, str] | None]
) -> None:
    """An entry whose every layer a later override takes over would do nothing."""
    decided = {entry[2] for entry in deciding if entry is not None}
    for position, override in enumerate(config.overrides):
        where = f"overrides[{position}]"
        if where not in decided:
            raise ConfigError(
                f"{where} (layers: {override.layers.root!r}) decides no layer: later overrides "
                "select every layer it selects, so it would do nothing; remove it or narrow the "
                "later overrides"
            )
    states_choice = config.preset is not None or config.keep is not None or config.recompute is not None
    if states_choice and "top level" not in decided:
        raise ConfigError(
            f"the top-level choice (layers: {config.layers.root!r}) decides no layer: overrides "
            "select every layer it selects, so its preset/keep/recompute would do nothing; remove "
            "them or narrow the overrides"
        )


def _resolve_selector(entry: RecomputeConfig | LayerOverride, field: str, num_layers: int) -> tuple[int, ...]:
    try:
        return entry.layers.resolve(num_layers)
    except ConfigError as err:
        raise ConfigError(f"{field}: {err}") from None


def _plan_layer(spec: LayerSpec, decided_by: tuple[RecomputeChoice, str, str] | None) -> LayerPlan:
    if decided_by is None:
        return LayerPlan(spec.index, spec.name, spec.class_name, "none", (), frozenset(), NOT_SELECTED)
    choice, field_prefix, label = decided_by
    source = f"{label}, preset {choice.preset}" if choice.preset is not None else label
    kept_units = _kept_units(choice, field_prefix, spec) if choice.mode == "selective" else ()
    return LayerPlan(
        index=spec.index,
        name=spec.name,
        class_name=spec.class_name,
        mode=choice.mode,
        kept_units=kept_units,
        kept_intervals=spec.interval_map.intervals_of(kept_units),
        source=source,
    )


def _kept_units(choice: RecomputeChoice, field_prefix: str, spec: LayerSpec) -> tuple[RecomputeUnit, ...]:
    declared = spec.interval_map.units
    if choice.preset is not None:
        # A preset names a category; units this layer lacks are simply not there to keep.
        return preset_kept_units(choice.preset, declared)
    if choice.recompute is not None:
        _require_declared(choice.recompute, f"{field_prefix}recompute", spec)
        return tuple(u for u in declared if u not in choice.recompute)
    if choice.keep is not None:
        _require_declared(choice.keep, f"{field_prefix}keep", spec)
        return tuple(u for u in declared if u in choice.keep)
    return ()


def _require_declared(units: tuple[RecomputeUnit, ...], field: str, spec: LayerSpec) -> None:
    missing = [u.value for u in units if u not in spec.interval_map]
    if missing:
        plural = "s" if len(missing) > 1 else ""
        declared = ", ".join(u.value for u in spec.interval_map.units)
        raise ConfigError(
            f"{field} lists unit{plural} {', '.join(missing)}, which layer {spec.name!r} "
            f"({spec.class_name}) does not declare; it declares: {declared}. A unit the layer "
            "does not have is an error, not a no-op: remove it, or narrow the layers this "
            "entry selects to layers that declare it"
        )

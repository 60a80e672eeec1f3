"""What the user asks for: ``RecomputeConfig``, its layer selectors and the named presets.

Pure validation and (de)serialisation from dicts, YAML and JSON; ``plan.py`` resolves a
config against a model's layers. Imports only ``actplan.units``, pydantic, PyYAML and stdlib.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PrivateAttr,
    RootModel,
    ValidationError,
    field_validator,
    model_validator,
)

from actplan.sizes import DEFAULT_HOST_CAP_BYTES, DEFAULT_OFFLOAD_MIN_BYTES, format_bytes, parse_bytes
from actplan.units import RecomputeUnit, parse_unit

Mode = Literal["none", "full", "selective"]
PresetName = Literal["none", "full", "attn", "matmuls", "megatron-selective"]

CONFIG_SUFFIXES: dict[str, str] = {".yaml": "yaml", ".yml": "yaml", ".json": "json"}


class ConfigError(ValueError):
    """A recompute config that is malformed, inconsistent, or does not fit the model."""


class _StrictSafeLoader(yaml.SafeLoader):
    """Safe YAML loading that rejects a key given twice (YAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice (first on line {first_line[key]}); keep one",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _strict_json_object(source: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A ``json.loads`` hook that refuses a key given twice in one object (JSON keeps the last)."""

    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for key, value in pairs:
            if key in data:
                raise ConfigError(
                    f"malformed JSON in {source}: key {key!r} appears twice in one object; keep one"
                )
            data[key] = value
        return data

    return build


@dataclass(frozen=True)
class PresetSpec:
    """A named recompute choice: a mode and, for selective, the units kept or recomputed.

    Exactly one of ``kept_units`` / ``recomputed_units`` is set for a selective preset.
    A preset names a category of units, so resolution silently drops the ones a layer
    does not declare (unlike units a user lists explicitly).
    """

    mode: Mode
    description: str
    kept_units: tuple[RecomputeUnit, ...] | None = None
    recomputed_units: tuple[RecomputeUnit, ...] | None = None


PRESETS: dict[str, PresetSpec] = {
    "none": PresetSpec("none", "no checkpointing: every activation stays resident"),
    "full": PresetSpec("full", "whole-layer checkpointing: keep only the layer input, recompute the rest"),
    "attn": PresetSpec(
        "selective",
        "keep the attention kernel output, recompute everything else",
        kept_units=(RecomputeUnit.ATTN_CORE,),
    ),
    "matmuls": PresetSpec(
        "selective",
        "keep GEMM and attention-kernel outputs, recompute norms and elementwise ops",
        # mlp_down is left out on purpose: its output feeds only the residual add, so
        # backward never reads it and non-reentrant recompute stops before reaching it.
        # Keeping it would hold nothing and save no work.
        kept_units=(
            RecomputeUnit.QKV_PROJ,
            RecomputeUnit.ATTN_CORE,
            RecomputeUnit.ATTN_PROJ,
            RecomputeUnit.MLP_UP,
            RecomputeUnit.MOE_EXPERTS,
            RecomputeUnit.SHARED_EXPERTS,
            RecomputeUnit.MOE_ROUTER,
        ),
    ),
    "megatron-selective": PresetSpec(
        "selective",
        "Megatron-style: recompute only the attention kernel, keep everything else",
        recomputed_units=(RecomputeUnit.ATTN_CORE,),
    ),
}
if set(PRESETS) != set(get_args(PresetName)):  # checked at import, also under python -O
    raise RuntimeError(
        f"internal error: PRESETS ({sorted(PRESETS)}) and PresetName ({sorted(get_args(PresetName))}) "
        "must list the same names; please report it"
    )


def _valid_presets() -> str:
    return ", ".join(PRESETS)


# ---------------------------------------------------------------------------------------
# Layer selectors


_RANGE_PIECE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
_SELECTOR_FORMS = (
    "'all', 'none', a layer index, a range string like '0-11' or '0-3,8,10-11', "
    "a list of indices and range strings, {every: N} (optionally with offset: k), "
    "{first: K} or {last: K}"
)
_DICT_SELECTOR_KEYS: tuple[frozenset[str], ...] = (
    frozenset({"every"}),
    frozenset({"every", "offset"}),
    frozenset({"first"}),
    frozenset({"last"}),
)


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `layers: true` is a mistake, not layer 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_ranges(text: str) -> tuple[tuple[int, int], ...]:
    """Parse ``'0-3,8,10-11'`` into inclusive ``(first, last)`` pairs."""
    ranges: list[tuple[int, int]] = []
    for piece in text.split(","):
        match = _RANGE_PIECE.match(piece)
        if match is None:
            if piece.strip().startswith("-"):
                raise ConfigError(
                    f"layer selector {text!r}: {piece.strip()!r} is negative; layer indices count "
                    "from 0 (to select the last layers use {last: K})"
                )
            raise ConfigError(
                f"layer selector {text!r}: {piece.strip()!r} is not a layer index or range; "
                "write indices like '3' and inclusive ranges like '0-11', separated by commas"
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ConfigError(
                f"layer selector {text!r}: range '{first}-{last}' is reversed; write '{last}-{first}'"
            )
        ranges.append((first, last))
    return tuple(ranges)


def _check_selector(raw: Any) -> Any:
    """Validate a selector in its user form; return it with tuples turned into lists."""
    if isinstance(raw, str):
        if raw not in ("all", "none"):
            _parse_ranges(raw)
        return raw
    if _is_int(raw):
        if raw < 0:
            raise ConfigError(
                f"layer index {raw} is negative; layer indices count from 0 "
                "(to select the last layers use {last: K})"
            )
        return raw
    if isinstance(raw, list | tuple):
        if not raw:
            raise ConfigError(
                "layer selector [] selects no layers; list at least one index, "
                "or write 'none' to turn checkpointing off"
            )
        for item in raw:
            if isinstance(item, str):
                _parse_ranges(item)
            elif _is_int(item):
                _check_selector(item)
            else:
                raise ConfigError(
                    f"layer selector list item {item!r} is neither a layer index nor a range string "
                    "like '0-11'"
                )
        return list(raw)
    if isinstance(raw, Mapping):
        keys = frozenset(raw)
        if keys not in _DICT_SELECTOR_KEYS:
            raise ConfigError(
                f"layer selector {dict(raw)!r} has keys {sorted(map(str, keys))}; use one of "
                "{every: N}, {every: N, offset: k}, {first: K} or {last: K}"
            )
        for key, value in raw.items():
            if not _is_int(value):
                raise ConfigError(f"layer selector {key}: {value!r} must be an integer")
        if "every" in raw and raw["every"] < 1:
            raise ConfigError(
                f"layer selector every: {raw['every']} must be at least 1 "
                "(every: 1 selects all layers; layers: none turns checkpointing off)"
            )
        if raw.get("offset", 0) < 0:
            raise ConfigError(f"layer selector offset: {raw['offset']} is negative; offsets count from 0")
        for key in ("first", "last"):
            if key in raw and raw[key] < 1:
                raise ConfigError(
                    f"layer selector {key}: {raw[key]} selects no layers; use {key}: 1 or more, "
                    "or layers: none to turn checkpointing off"
                )
        return dict(raw)
    raise ConfigError(f"layer selector {raw!r} has an unsupported form; use {_SELECTOR_FORMS}")


class LayerSelector(RootModel[str | int | list[int | str] | dict[str, int]]):
    """Which layers a config entry applies to, kept in the form the user wrote it.

    Forms: ``'all'``, ``'none'``, an index, ``'0-3,8,10-11'`` (inclusive ranges), a list of
    indices and range strings, ``{every: N}`` / ``{every: N, offset: k}``, ``{first: K}``,
    ``{last: K}``. Malformed forms fail at parse time; indices past the model's last
    layer fail in ``resolve``.
    """

    model_config = ConfigDict(frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _validate_form(cls, raw: Any) -> Any:
        return _check_selector(raw)

    @property
    def selects_nothing(self) -> bool:
        """True only for the literal ``'none'``, the explicit way to select no layers."""
        return self.root == "none"

    def resolve(self, num_layers: int) -> tuple[int, ...]:
        """The selected layer indices, sorted and unique, for a model with ``num_layers`` layers."""
        selected = self._indices(self.root, num_layers)
        if not selected and not self.selects_nothing:
            raise ConfigError(
                f"layer selector {self.root!r} selects no layers of a model with {num_layers}; "
                "select at least one layer, or write 'none' to turn checkpointing off"
            )
        return tuple(sorted(set(selected)))

    @classmethod
    def _indices(cls, raw: Any, num_layers: int) -> list[int]:
        if raw == "all":
            return list(range(num_layers))
        if raw == "none":
            return []
        if _is_int(raw):
            _check_in_range(raw, num_layers)
            return [raw]
        if isinstance(raw, str):
            out: list[int] = []
            for first, last in _parse_ranges(raw):
                _check_in_range(last, num_layers)
                out.extend(range(first, last + 1))
            return out
        if isinstance(raw, list):
            return [index for item in raw for index in cls._indices(item, num_layers)]
        if "every" in raw:
            offset = raw.get("offset", 0)
            _check_in_range(offset, num_layers, what=f"offset {offset}")
            return list(range(offset, num_layers, raw["every"]))
        key = "first" if "first" in raw else "last"
        count = raw[key]
        if count > num_layers:
            raise ConfigError(
                f"layer selector {key}: {count} asks for more layers than the model has ({num_layers}); "
                f"use {key}: {num_layers} or less"
            )
        return list(range(count)) if key == "first" else list(range(num_layers - count, num_layers))


def _check_in_range(index: int, num_layers: int, what: str | None = None) -> None:
    if index >= num_layers:
        valid = f"0-{num_layers - 1}" if num_layers else "none"
        raise ConfigError(
            f"{what or f'layer index {index}'} is out of range for a model with {num_layers} layers "
            f"(valid indices: {valid}); select only existing layers"
        )


# ---------------------------------------------------------------------------------------
# Recompute choices: the top level and each override


def _unit_name(value: Any) -> RecomputeUnit:
    if isinstance(value, RecomputeUnit):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"expected a unit name string, got {value!r}; see RecomputeUnit for valid names")
    return parse_unit(value)


_ParsedUnit = Annotated[RecomputeUnit, BeforeValidator(_unit_name)]


class RecomputeChoice(BaseModel):
    """Mode, preset and units: the part shared by the top level and each override.

    ``mode`` is always concrete after validation; when not written it follows from the
    preset, else from ``keep``/``recompute`` (selective), else it is ``'full'``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = "full"
    preset: PresetName | None = None
    keep: tuple[_ParsedUnit, ...] | None = None
    recompute: tuple[_ParsedUnit, ...] | None = None

    @model_validator(mode="before")
    @classmethod
    def _infer_mode(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or data.get("mode") is not None:
            return data
        preset = data.get("preset")
        if isinstance(preset, str) and preset in PRESETS:
            return {**data, "mode": PRESETS[preset].mode}
        if data.get("keep") is not None or data.get("recompute") is not None:
            return {**data, "mode": "selective"}
        return data

    @field_validator("keep", "recompute", mode="before")
    @classmethod
    def _require_unit_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            raise ConfigError(f"expected a list of unit names, got the string {value!r}; write [{value}]")
        if value is not None and not isinstance(value, list | tuple | set | frozenset):
            raise ConfigError(f"expected a list of unit names, got {value!r}; write e.g. [attn_core, mlp_up]")
        return value

    @field_validator("keep", "recompute")
    @classmethod
    def _reject_duplicates(cls, units: tuple[RecomputeUnit, ...] | None) -> tuple[RecomputeUnit, ...] | None:
        if units is not None:
            repeated = sorted({u.value for u in units if units.count(u) > 1})
            if repeated:
                raise ConfigError(f"units listed more than once: {', '.join(repeated)}; list each unit once")
        return units

    @model_validator(mode="after")
    def _check_consistency(self) -> RecomputeChoice:
        listed = "keep" if self.keep is not None else "recompute" if self.recompute is not None else None
        if self.keep is not None and self.recompute is not None:
            raise ConfigError(
                "keep and recompute are both given; give one: keep lists the units to keep, "
                "recompute (Megatron style) lists the units to recompute and keeps the rest"
            )
        if self.preset is not None:
            preset = PRESETS[self.preset]
            if listed is not None:
                raise ConfigError(
                    f"preset {self.preset!r} and {listed} are both given; a preset fixes the units, "
                    f"so remove {listed}, or remove the preset and use mode: selective with {listed}"
                )
            if self.mode != preset.mode:
                raise ConfigError(
                    f"mode {self.mode!r} disagrees with preset {self.preset!r}, whose mode is "
                    f"{preset.mode!r}; remove mode or the preset"
                )
        elif self.mode != "selective" and listed is not None:
            raise ConfigError(
                f"{listed} is given with mode {self.mode!r}, where it would do nothing; "
                f"use mode: selective or remove {listed}"
            )
        elif self.mode == "selective" and (listed is None or self.keep == ()):
            what = (
                "keep: [] keeps"
                if listed is not None
                else "mode: selective with no keep, recompute or preset keeps"
            )
            raise ConfigError(
                f"{what} nothing, so every unit would be recomputed; name what to keep with "
                "keep: [units] (or recompute: [units], Megatron style, to keep the rest), use a preset "
                "such as matmuls, or write mode: full to recompute the whole layer"
            )
        return self

    def _implied_mode(self) -> Mode:
        if self.preset is not None:
            return PRESETS[self.preset].mode
        if self.keep is not None or self.recompute is not None:
            return "selective"
        return "full"

    def _choice_to_dict(self, mode_always: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        states_choice = self.preset is not None or self.keep is not None or self.recompute is not None
        if self.mode != self._implied_mode() or (mode_always and not states_choice):
            out["mode"] = self.mode
        if self.preset is not None:
            out["preset"] = self.preset
        if self.keep is not None:
            out["keep"] = [u.value for u in self.keep]
        if self.recompute is not None:
            out["recompute"] = [u.value for u in self.recompute]
        return out


_CHOICE_FIELDS = ("mode", "preset", "keep", "recompute")


def _byte_size(value: Any) -> int:
    try:
        return parse_bytes(value)
    except ValueError as err:
        raise ConfigError(str(err)) from None


_ByteSize = Annotated[int, BeforeValidator(_byte_size)]


class OffloadConfig(BaseModel):
    """Which saved tensors move to host memory between forward and backward.

    ``units``: units whose saved tensors move: in a selective layer they must be kept
    (``'kept'`` means every unit the layer keeps); in a layer that is not checkpointed,
    whatever autograd saves inside them. ``layer_input``: the input a checkpointed (full or
    selective) layer saves. ``layers`` selects layers as elsewhere; when it is not given,
    every layer except the last ``skip_last`` (default 1: its activations are needed first
    in backward, so moving them cannot overlap anything).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    units: tuple[_ParsedUnit, ...] | Literal["kept"] = ()
    layer_input: bool = False
    layers: LayerSelector | None = None
    skip_last: int | None = None
    min_bytes: _ByteSize = DEFAULT_OFFLOAD_MIN_BYTES
    host_cap: _ByteSize = DEFAULT_HOST_CAP_BYTES
    prefetch: int = 1

    @field_validator("units", mode="before")
    @classmethod
    def _units_form(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "kept":
            raise ConfigError(
                f"offload.units: expected a list of unit names or 'kept', got the string {value!r}; "
                f"write [{value}]"
            )
        if not isinstance(value, str | list | tuple | set | frozenset):
            raise ConfigError(
                f"expected a list of unit names or 'kept', got {value!r}; write e.g. [attn_core] or kept"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> OffloadConfig:
        if not self.units and not self.layer_input:
            raise ConfigError(
                "offload names no units and layer_input is false, so it would move nothing; "
                "add units (or 'kept') or layer_input: true, or remove offload"
            )
        if isinstance(self.units, tuple):
            repeated = sorted({u.value for u in self.units if self.units.count(u) > 1})
            if repeated:
                raise ConfigError(f"offload.units lists {', '.join(repeated)} more than once; list each once")
        if self.layers is not None and self.skip_last is not None:
            raise ConfigError(
                "offload.layers and offload.skip_last are both given; skip_last only shapes the default "
                "selection (all layers but the last few), so give one of them"
            )
        if self.layers is not None and self.layers.selects_nothing:
            raise ConfigError("offload.layers: 'none' would offload nothing; select layers or remove offload")
        if self.skip_last is not None and self.skip_last < 0:
            raise ConfigError(f"offload.skip_last: {self.skip_last} is negative; use 0 or more")
        if self.prefetch < 0:
            raise ConfigError(f"offload.prefetch: {self.prefetch} is negative; use 0 (reload on use) or more")
        if self.host_cap < max(self.min_bytes, 1):
            raise ConfigError(
                f"offload.host_cap ({self.host_cap:,} bytes) is below the smallest tensor offload moves "
                f"(min_bytes: {self.min_bytes:,}), so every tensor would miss the pool; raise host_cap "
                "or lower min_bytes"
            )
        return self

    @property
    def skipped_last_layers(self) -> int:
        return 1 if self.skip_last is None else self.skip_last

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.units:
            out["units"] = self.units if isinstance(self.units, str) else [u.value for u in self.units]
        if self.layer_input:
            out["layer_input"] = True
        if self.layers is not None:
            out["layers"] = copy.deepcopy(self.layers.root)
        if self.skip_last is not None:
            out["skip_last"] = self.skip_last
        if self.min_bytes != DEFAULT_OFFLOAD_MIN_BYTES:
            out["min_bytes"] = format_bytes(self.min_bytes)
        if self.host_cap != DEFAULT_HOST_CAP_BYTES:
            out["host_cap"] = format_bytes(self.host_cap)
        if self.prefetch != 1:
            out["prefetch"] = self.prefetch
        return out


class LayerOverride(RecomputeChoice):
    """A recompute choice for the layers ``layers`` selects; later overrides win."""

    layers: LayerSelector

    @model_validator(mode="before")
    @classmethod
    def _require_a_choice(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and not any(data.get(name) is not None for name in _CHOICE_FIELDS):
            raise ConfigError(
                "this override sets none of mode, preset, keep, recompute, so it would do nothing; "
                "add one of them or remove the override"
            )
        return data

    @field_validator("layers")
    @classmethod
    def _reject_empty_selection(cls, layers: LayerSelector) -> LayerSelector:
        if layers.selects_nothing:
            raise ConfigError("an override with layers: none would do nothing; select layers or remove it")
        return layers

    def to_dict(self) -> dict[str, Any]:
        """Minimal plain-data form; ``LayerOverride(**o.to_dict()) == o``."""
        return {"layers": copy.deepcopy(self.layers.root), **self._choice_to_dict(mode_always=True)}


class RecomputeConfig(RecomputeChoice):
    """What to recompute, for which layers: the user's request, before it meets a model.

    Load with ``from_dict``, ``from_yaml``, ``from_json``, ``from_file``, ``from_preset`` or
    ``parse``; every loader raises ``ConfigError`` naming the bad field and the fix.
    ``plan.resolve_plan`` turns a config and a model's layers into a per-layer plan.
    """

    layers: LayerSelector = LayerSelector("all")
    overrides: tuple[LayerOverride, ...] = ()
    # Whether routing and collective outputs are saved rather than recomputed:
    # "auto" in selective layers and in full layers that declare routing units.
    save_collectives: bool | Literal["auto"] = "auto"
    # Saved tensors moved to host memory (see OffloadConfig); None: nothing is offloaded.
    offload: OffloadConfig | None = None
    # Where the config was read from: (source, text) for errors found when it meets a model.
    _origin: tuple[str, str | None] | None = PrivateAttr(default=None)

    @field_validator("save_collectives", mode="before")
    @classmethod
    def _save_collectives_form(cls, value: Any) -> Any:
        # Checked here so the error names the choices, not pydantic's union members.
        if isinstance(value, bool) or value == "auto":
            return value
        raise ConfigError(
            f"expected true, false or 'auto', got {value!r}; 'auto' (the "
            "default) saves routing and collective outputs in selective layers and in full layers "
            "that declare routing units"
        )

    @model_validator(mode="after")
    def _reject_layers_without_effect(self) -> RecomputeConfig:
        if self.save_collectives != "auto" and self.mode == "none" and not self.overrides:
            raise ConfigError(
                f"save_collectives: {self.save_collectives} is given with mode 'none', where nothing is "
                "recomputed, so it would do nothing; remove it or checkpoint some layers"
            )
        if self.layers.selects_nothing and not self.overrides:
            raise ConfigError(
                "layers: 'none' with no overrides checkpoints nothing; to turn checkpointing off "
                "write `preset: none`, or add overrides that select the layers to checkpoint"
            )
        # Layers left unselected are not checkpointed either, so a selector does nothing here.
        if self.mode == "none" and self.layers.root != "all":
            raise ConfigError(
                f"layers: {self.layers.root!r} is given with mode 'none', where it would do nothing "
                "(unselected layers are not checkpointed either); remove layers, or use overrides "
                "to checkpoint some layers"
            )
        return self

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> RecomputeConfig:
        """Validate plain data (as loaded from YAML/JSON); ``source`` names it in errors."""
        return cls._validate(data, source, yaml_text=None)

    @classmethod
    def from_yaml(cls, text: str, source: str = "<string>") -> RecomputeConfig:
        """Parse YAML text (safe loading only); errors name ``source`` and the line."""
        try:
            data = yaml.load(text, Loader=_StrictSafeLoader)
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark or err.context_mark
            where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark else source
            problem = " ".join(p for p in (err.context, err.problem) if p)
            raise ConfigError(f"malformed YAML in {where}: {problem}; fix the syntax there") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"malformed YAML in {source}: {err}; fix the syntax") from None
        return cls._validate(data, source, yaml_text=text)

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> RecomputeConfig:
        """Parse JSON text; errors name ``source`` and the line."""
        try:
            data = json.loads(text, object_pairs_hook=_strict_json_object(source))
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"malformed JSON in {source}, line {err.lineno}, column {err.colno}: {err.msg}; "
                "fix the syntax there"
            ) from None
        return cls._validate(data, source, yaml_text=None, text=text)

    @classmethod
    def from_file(cls, path: str | Path) -> RecomputeConfig:
        """Load a ``.yaml``/``.yml``/``.json`` file, chosen by suffix."""
        path = Path(path)
        kind = CONFIG_SUFFIXES.get(path.suffix.lower())
        if kind is None:
            raise ConfigError(
                f"config file {str(path)!r} has unsupported suffix {path.suffix!r}; "
                f"use one of {', '.join(CONFIG_SUFFIXES)}"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(
                f"cannot read config file {str(path)!r}: {err.strerror}; check the path"
            ) from None
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"config file {str(path)!r} is not UTF-8 text (byte {err.object[err.start]:#04x} at "
                f"offset {err.start}); save it as UTF-8"
            ) from None
        if kind == "yaml":
            return cls.from_yaml(text, source=str(path))
        return cls.from_json(text, source=str(path))

    @classmethod
    def from_preset(cls, name: str) -> RecomputeConfig:
        """The config that applies preset ``name`` to every layer."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; valid presets: {_valid_presets()}")
        return cls(preset=name)

    @classmethod
    def parse(cls, value: RecomputeConfig | Mapping[str, Any] | str | Path) -> RecomputeConfig:
        """Accept a config, a dict, a preset name, or the path of a config file.

        A string that is a preset name is taken as the preset even if a file of that
        name exists.
        """
        if isinstance(value, RecomputeConfig):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if isinstance(value, Path):
            return cls.from_file(value)
        if isinstance(value, str):
            if value in PRESETS:
                return cls.from_preset(value)
            if Path(value).is_file():
                return cls.from_file(value)
            raise ConfigError(
                f"{value!r} is neither a preset name nor an existing config file; "
                f"valid presets: {_valid_presets()}"
            )
        raise ConfigError(
            f"cannot make a RecomputeConfig from {type(value).__name__}; pass a RecomputeConfig, "
            "a dict, a preset name or a config file path"
        )

    @classmethod
    def _validate(
        cls, data: Any, source: str | None, yaml_text: str | None, text: str | None = None
    ) -> RecomputeConfig:
        where = f" in {source}" if source else ""
        if data is None:
            raise ConfigError(f"recompute config{where} is empty; write at least `mode: full` or a preset")
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"recompute config{where} must be a mapping of fields ({', '.join(cls.model_fields)}), "
                f"got {type(data).__name__}; for a preset alone write `preset: <name>`"
            )
        try:
            config = cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(format_validation_error(err, source, yaml_text)) from None
        if source is not None:
            config._origin = (source, yaml_text if yaml_text is not None else text)
        return config

    def __eq__(self, other: object) -> bool:
        # Equal configs are equal wherever they were read from (the origin is for errors only).
        if type(other) is not type(self):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = RecomputeChoice.__hash__

    def located(self, err: ConfigError) -> ConfigError:
        """``err``, found when this config met a model (a layer index out of range, a unit a
        layer does not declare), naming the file and the line of the field it starts with."""
        if self._origin is None:
            return err
        source, text = self._origin
        message = str(err)
        path = _FIELD_AT_START.match(message)
        loc = parse_field_path(path.group(1)) if path else ()
        named = bool(loc) and loc[0] in type(self).model_fields
        line = _yaml_line(text, loc) if named and text is not None else None
        at = f" (line {line})" if line is not None else ""
        return ConfigError(f"in {source}{at}: {message}")

    # -- serialisation ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Minimal plain-data form: defaults left out, units as strings, selectors as written."""
        out = self._choice_to_dict(mode_always=False)
        if self.layers.root != "all":
            out["layers"] = copy.deepcopy(self.layers.root)
        if self.overrides:
            out["overrides"] = [override.to_dict() for override in self.overrides]
        if self.save_collectives != "auto":
            out["save_collectives"] = self.save_collectives
        if self.offload is not None:
            out["offload"] = self.offload.to_dict()
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def dump(self, path: str | Path) -> None:
        """Write to a ``.yaml``/``.yml``/``.json`` file, chosen by suffix."""
        path = Path(path)
        kind = CONFIG_SUFFIXES.get(path.suffix.lower())
        if kind is None:
            raise ConfigError(
                f"cannot dump to {str(path)!r}: unsupported suffix {path.suffix!r}; "
                f"use one of {', '.join(CONFIG_SUFFIXES)}"
            )
        path.write_text(self.to_yaml() if kind == "yaml" else self.to_json(), encoding="utf-8")


# ---------------------------------------------------------------------------------------
# Error messages


def format_field_path(loc: tuple[int | str, ...]) -> str:
    """``('overrides', 1, 'keep', 0)`` -> ``'overrides[1].keep[0]'``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


# A message that starts with a field path ("overrides[0].layers: ...", "keep lists ...").
_FIELD_AT_START = re.compile(r"^([A-Za-z_]+(?:\[\d+\]|\.[A-Za-z_]+)*)[: ]")


def parse_field_path(path: str) -> tuple[int | str, ...]:
    """``'overrides[1].keep[0]'`` -> ``('overrides', 1, 'keep', 0)`` (``format_field_path``'s inverse)."""
    return tuple(int(part) if part.isdigit() else part for part in re.findall(r"[A-Za-z_]+|\d+", path))


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel]:
    if loc and loc[0] == "overrides":
        return LayerOverride
    return OffloadConfig if loc and loc[0] == "offload" else RecomputeConfig


def _describe_error(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    loc = tuple(error["loc"])
    if kind == "value_error":
        return str(error["ctx"]["error"])
    if kind == "extra_forbidden":
        valid = ", ".join(_model_at(loc).model_fields)
        return f"unknown field {loc[-1]!r}; valid fields here: {valid}"
    if kind == "missing":
        return f"required field {loc[-1]!r} is missing; add it"
    message = error["msg"]
    return f"{message[0].lower()}{message[1:]}, got {error['input']!r}"


def _yaml_line(text: str, loc: tuple[int | str, ...]) -> int | None:
    """1-based line of the deepest YAML node on ``loc``; None if the text does not compose."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    if node is None:
        return None
    for part in loc:
        child = None
        if isinstance(node, yaml.MappingNode):
            # The last duplicate key wins when loading, so point at that one.
            child = next((value for key, value in reversed(node.value) if key.value == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
        if child is None:
            break
        node = child
    return node.start_mark.line + 1


def format_validation_error(
    err: ValidationError, source: str | None = None, yaml_text: str | None = None
) -> str:
    """Turn pydantic's report into one readable line per problem, with field paths and lines."""
    problems = []
    for error in err.errors():
        loc = tuple(error["loc"])
        field = format_field_path(loc) or "(top level)"
        line = _yaml_line(yaml_text, loc) if yaml_text is not None else None
        at = f" (line {line})" if line is not None else ""
        problems.append(f"  {field}{at}: {_describe_error(error)}")
    where = f" in {source}" if source else ""
    return f"invalid recompute config{where}:\n" + "\n".join(problems)

"""The config models around a choice: ``OffloadConfig``, ``LayerOverride`` and
``RecomputeConfig`` with its loaders (dict, YAML, JSON, file, preset) and dumpers. Pure
validation: ``actplan._install.plan`` resolves a config against a model's layers.

Imports only ``actplan.units``, ``actplan.sizes``, the other config modules, pydantic and PyYAML.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from actplan.config._choice import CHOICE_FIELDS, ParsedUnit, RecomputeChoice
from actplan.config._errors import (
    ConfigError,
    file_kind,
    leading_field_path,
    load_json,
    load_yaml,
    read_config_text,
    report_validation_error,
    yaml_line,
)
from actplan.config._made_for import MadeFor
from actplan.config._presets import PRESETS, valid_presets
from actplan.config._selectors import LayerSelector
from actplan.sizes import DEFAULT_HOST_CAP_BYTES, DEFAULT_OFFLOAD_MIN_BYTES, format_bytes, parse_bytes


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

    units: tuple[ParsedUnit, ...] | Literal["kept"] = ()
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
        if not isinstance(data, Mapping) or any(key not in cls.model_fields for key in data):
            return data  # an unknown key (a misspelt `mode`, say) is reported by name instead
        if not any(data.get(name) is not None for name in CHOICE_FIELDS):
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
    # The model a planned config was made for (see MadeFor); checked against the model it meets.
    made_for: MadeFor | None = None
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
        return cls._validate(load_yaml(text, source), source, yaml_text=text)

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> RecomputeConfig:
        """Parse JSON text; errors name ``source`` and the line."""
        return cls._validate(load_json(text, source), source, yaml_text=None, text=text)

    @classmethod
    def from_file(cls, path: str | Path) -> RecomputeConfig:
        """Load a ``.yaml``/``.yml``/``.json`` file, chosen by suffix."""
        path = Path(path)
        kind = file_kind(path, f"config file {str(path)!r} has")
        text = read_config_text(path)
        if kind == "yaml":
            return cls.from_yaml(text, source=str(path))
        return cls.from_json(text, source=str(path))

    @classmethod
    def from_preset(cls, name: str) -> RecomputeConfig:
        """The config that applies preset ``name`` to every layer."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; valid presets: {valid_presets()}")
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
                f"valid presets: {valid_presets()}"
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
        loc = leading_field_path(message)
        named = bool(loc) and loc[0] in type(self).model_fields
        line = yaml_line(text, loc) if named and text is not None else None
        at = f" (line {line})" if line is not None else ""
        return ConfigError(f"in {source}{at}: {message}")

    # -- serialisation ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Minimal plain-data form: defaults left out, units as strings, selectors as written;
        ``made_for`` first, as the file's header."""
        out = {"made_for": self.made_for.to_dict()} if self.made_for is not None else {}
        out.update(self._choice_to_dict(mode_always=False))
        if self.layers.root != "all":
            out["layers"] = copy.deepcopy(self.layers.root)
        if self.overrides:
            out["overrides"] = [override.to_dict() for override in self.overrides]
        if self.save_collectives != "auto":
            out["save_collectives"] = self.save_collectives
        if self.offload is not None:
            out["offload"] = self.offload.to_dict()
        return out

    def to_yaml(self, comment: str | None = None) -> str:
        """The YAML text; ``comment`` (lines of text) goes first as ``#`` comments."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if comment:
            text = "".join(f"# {line}".rstrip() + "\n" for line in comment.splitlines()) + text
        return text

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def dump(self, path: str | Path, comment: str | None = None) -> None:
        """Write to a ``.yaml``/``.yml``/``.json`` file, chosen by suffix; ``comment`` heads a
        YAML file as ``#`` lines (JSON has no comments: it is left out there)."""
        path = Path(path)
        kind = file_kind(path, f"cannot dump to {str(path)!r}:")
        path.write_text(self.to_yaml(comment) if kind == "yaml" else self.to_json(), encoding="utf-8")


# ---------------------------------------------------------------------------------------
# Error messages that name the config's fields


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel]:
    if loc and loc[0] == "overrides":
        return LayerOverride
    if loc and loc[0] == "made_for":
        return MadeFor
    return OffloadConfig if loc and loc[0] == "offload" else RecomputeConfig


def _fields_at(loc: tuple[int | str, ...]) -> list[str]:
    return list(_model_at(loc).model_fields)


def format_validation_error(
    err: ValidationError, source: str | None = None, yaml_text: str | None = None
) -> str:
    """Turn pydantic's report into one readable line per problem, with field paths and lines."""
    return report_validation_error(err, _fields_at, source, yaml_text)

"""A recompute choice, the part shared by a config's top level and each override: mode,
preset, and the units kept (``keep``) or recomputed (``recompute``), checked for consistency.

Imports only ``actplan.units``, the other config modules, pydantic and the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, field_validator, model_validator

from actplan.config._errors import ConfigError
from actplan.config._presets import PRESETS, Mode, PresetName
from actplan.units import RecomputeUnit, parse_unit


def _unit_name(value: Any) -> RecomputeUnit:
    if isinstance(value, RecomputeUnit):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"expected a unit name string, got {value!r}; see RecomputeUnit for valid names")
    return parse_unit(value)


ParsedUnit = Annotated[RecomputeUnit, BeforeValidator(_unit_name)]


class RecomputeChoice(BaseModel):
    """Mode, preset and units: the part shared by the top level and each override.

    ``mode`` is always concrete after validation; when not written it follows from the
    preset, else from ``keep``/``recompute`` (selective), else it is ``'full'``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = "full"
    preset: PresetName | None = None
    keep: tuple[ParsedUnit, ...] | None = None
    recompute: tuple[ParsedUnit, ...] | None = None

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


# The fields that state a choice (an override must set one of them).
CHOICE_FIELDS = ("mode", "preset", "keep", "recompute")

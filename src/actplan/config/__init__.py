"""What the user asks for: ``RecomputeConfig``, its layer selectors and the named presets.

Pure validation and (de)serialisation from dicts, YAML and JSON; ``actplan._install.plan``
resolves a config against a model's layers. The package imports only ``actplan.units``,
``actplan.sizes``, pydantic, PyYAML and the standard library; its modules are private and
this module re-exports their public names.
"""

from __future__ import annotations

from actplan.config._choice import RecomputeChoice
from actplan.config._errors import CONFIG_SUFFIXES, ConfigError, format_field_path, parse_field_path
from actplan.config._made_for import MadeFor, class_ranges
from actplan.config._presets import PRESETS, Mode, PresetName, PresetSpec, preset_kept_units
from actplan.config._schema import LayerOverride, OffloadConfig, RecomputeConfig, format_validation_error
from actplan.config._selectors import LayerSelector, format_indices

__all__ = [
    "CONFIG_SUFFIXES",
    "PRESETS",
    "ConfigError",
    "LayerOverride",
    "LayerSelector",
    "MadeFor",
    "Mode",
    "OffloadConfig",
    "PresetName",
    "PresetSpec",
    "RecomputeChoice",
    "RecomputeConfig",
    "class_ranges",
    "format_field_path",
    "format_indices",
    "format_validation_error",
    "parse_field_path",
    "preset_kept_units",
]

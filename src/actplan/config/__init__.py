"""What the user asks for: ``RecomputeConfig``, its layer selectors and overrides, offload's
settings, the named presets, and ``ConfigError``.

Pure validation and (de)serialisation from dicts, YAML and JSON; ``actplan._install.plan``
resolves a config against a model's layers. The package imports only ``actplan.units``,
``actplan.sizes``, pydantic, PyYAML and the standard library. Its modules are private; this
module exports what a user writes or catches, and the rest of actplan imports the helpers
from the private modules that define them.
"""

from __future__ import annotations

from actplan.config._errors import ConfigError
from actplan.config._presets import PRESETS
from actplan.config._schema import LayerOverride, OffloadConfig, RecomputeConfig
from actplan.config._selectors import LayerSelector

__all__ = ["PRESETS", "ConfigError", "LayerOverride", "LayerSelector", "OffloadConfig", "RecomputeConfig"]

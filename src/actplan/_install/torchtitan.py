"""Plugging actplan in where torchtitan applies activation checkpointing: after tensor
parallelism, before ``torch.compile`` and FSDP.

``apply_to_torchtitan(model, config)`` installs a plan on a torchtitan model's blocks (found and
laid out by ``actplan.integrations.torchtitan``). ``ActplanAC`` (``_torchtitan_ac``) is the same
as a member of torchtitan's ``ActivationCheckpointing`` family, for a trainer config function; it
imports torchtitan, so it is handed out on first use (``import actplan`` never imports
torchtitan). Both are re-exported by ``actplan``. Imports ``apply`` and the integrations.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from actplan._install.apply import apply
from actplan.integrations.blocks import Layouts

__all__ = ["apply_to_torchtitan"]  # and ActplanAC, on first use


def apply_to_torchtitan(
    model: nn.Module,
    config: Any = "matmuls",
    *,
    layouts: Layouts | None = None,
) -> Any:
    """Install an actplan plan on a torchtitan model's blocks; returns the ``actplan.Plan``.

    ``config``: a preset name (``"matmuls"``), a path to a YAML/JSON plan (``actplan plan``
    writes one), a ``RecomputeConfig`` or its dict. ``layouts``: units by block class name, for
    blocks whose layout cannot be derived (``None`` leaves a class alone). Call it where
    torchtitan's ``parallelize_*`` applies activation checkpointing: after tensor parallelism,
    before ``torch.compile`` and FSDP (``ActplanAC`` does exactly that). Raises ``ConfigError``
    for blocks torchtitan already wrapped with its own checkpointing and for a layout it
    cannot derive."""
    return apply(model, config, layouts=layouts)


def __getattr__(name: str) -> Any:
    # ``ActplanAC`` subclasses torchtitan's ActivationCheckpointing: imported on first use only.
    if name == "ActplanAC":
        return importlib.import_module("actplan._install._torchtitan_ac").ActplanAC
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

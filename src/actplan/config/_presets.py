"""The named presets: ``PresetSpec``, ``PRESETS``, and which declared units a preset keeps.

Imports only ``actplan.units``, the config errors and the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, TypeVar, get_args

from actplan.config._errors import ConfigError
from actplan.units import RecomputeUnit

Mode = Literal["none", "full", "selective"]
PresetName = Literal["none", "full", "attn", "matmuls", "megatron-selective"]


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


OFFLOAD_VARIANTS: dict[str, dict] = {
    "full+offload": {"preset": "full", "offload": {"layer_input": True}},
    "matmuls+offload": {"preset": "matmuls", "offload": {"units": "kept"}},
}
"""Named configs that add offload to a preset (``actplan bench`` rows, ``actplan estimate``
presets): the layer inputs of ``full``, the kept units of ``matmuls`` (every layer but the last,
tensors of at least the default ``min_bytes``)."""

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


def valid_presets() -> str:
    """The preset names, comma-separated, for error messages."""
    return ", ".join(PRESETS)


_Unit = TypeVar("_Unit", bound=str)


def preset_kept_units(preset: str, declared: Iterable[_Unit]) -> tuple[_Unit, ...]:
    """The units of ``declared`` (a layer's units, in its order) that selective preset ``preset`` keeps.

    The result keeps ``declared``'s order and element type (``RecomputeUnit`` or its string
    value). A preset names a category of units, so units it names that the layer does not
    declare are simply not there: no error, and possibly an empty result. ``attn`` and
    ``matmuls`` keep the units they list; ``megatron-selective`` keeps every declared unit
    but the ones it recomputes. Raises ``ConfigError`` for an unknown preset and
    ``ValueError`` for ``none`` or ``full``, which choose no units (they keep every output,
    or only the layer input).
    """
    spec = PRESETS.get(preset)
    if spec is None:
        raise ConfigError(f"unknown preset {preset!r}; valid presets: {valid_presets()}")
    if spec.mode != "selective":
        raise ValueError(f"preset {preset!r} is {spec.mode!r}, not selective: it keeps no chosen units")
    if spec.kept_units is not None:
        return tuple(unit for unit in declared if unit in spec.kept_units)
    recomputed = spec.recomputed_units or ()
    return tuple(unit for unit in declared if unit not in recomputed)

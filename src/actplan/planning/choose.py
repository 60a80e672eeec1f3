"""From a solver's choices back to a config: the candidate each layer gets, and the
``RecomputeConfig`` that installs exactly those candidates.

Imports ``actplan.config``, ``actplan._install.plan`` (layer ranges) and the planning records
(a candidate's config entry, the profile types).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from actplan._install.plan import format_indices
from actplan.config import RecomputeConfig
from actplan.planning._records import choice_of

if TYPE_CHECKING:
    from actplan.planning._records import CandidateProfile, ModelProfile


def picked(profile: ModelProfile, choices: list[int] | tuple[int, ...]) -> list[CandidateProfile]:
    """Per layer, the candidate ``choices`` picks for it."""
    return [profile.type_of(index).candidates[choice] for index, choice in enumerate(choices)]


def config_for(profile: ModelProfile, choices: list[int] | tuple[int, ...]) -> RecomputeConfig:
    """The ``RecomputeConfig`` that installs one candidate per layer: the most common choice at
    the top level, the others as overrides, offloaded layers in one offload block."""
    chosen = picked(profile, choices)
    groups: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for index, candidate in enumerate(chosen):
        groups.setdefault((candidate.mode, tuple(candidate.kept_units)), []).append(index)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))
    (top_mode, top_kept), _ = ordered[0]
    data: dict[str, Any] = choice_of(top_mode, top_kept)
    if len(ordered) > 1:
        data["overrides"] = [
            {"layers": format_indices(indices), **choice_of(mode, kept)}
            for (mode, kept), indices in ordered[1:]
        ]
    offloaded = [index for index, candidate in enumerate(chosen) if candidate.offload]
    if offloaded:
        data["offload"] = {
            "layers": format_indices(offloaded),
            "layer_input": True,
            "min_bytes": profile.min_bytes,
        }
        if any(chosen[i].kept_units for i in offloaded):
            data["offload"]["units"] = "kept"
    return RecomputeConfig.from_dict(data, source="planner")

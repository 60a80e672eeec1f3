"""One layer type's candidates, measured: ``none``, ``full``, the presets, the greedy chain of
kept sets, and the offloaded variant of each checkpointed one (see ``profile``'s module doc).

Private to the profiler. Imports torch, the install helpers, ``actplan.config`` (presets),
the offload engine's quiet switch and the isolated-layer measurement.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import nn

from actplan._engine.offload import quiet_empty_offload
from actplan._install.apply import interval_map_of
from actplan.config import PRESETS
from actplan.config._presets import preset_kept_units
from actplan.measure import RooflineClock
from actplan.planning._isolated import IsolatedLayer
from actplan.planning._records import CandidateProfile

_Identity = tuple[str, tuple[str, ...]]


def layer_type_steps(layer: nn.Module) -> int:
    """Progress units of profiling one layer type: presets, one greedy step per declared
    unit, timing, offload."""
    return len(interval_map_of(layer).units) + 3


def _kept_set_name(units: list[str]) -> str:
    return "keep " + "+".join(units) if units else "full"


def _exposed_seconds(candidate: CandidateProfile, bandwidth: dict[str, float], overlap: bool) -> float:
    out = candidate.offloaded_bytes / bandwidth["device_to_host"]
    back = candidate.offloaded_bytes / bandwidth["host_to_device"]
    if not overlap:
        return out + back  # synchronous copies: all of it shows
    # Copies overlap the layer's own compute: copies out its forward, about a third of it;
    # reloads its backward, the rest (a stepped row's copies are timed on the clock's streams).
    return max(out - candidate.layer_seconds / 3, 0.0) + max(back - 2 * candidate.layer_seconds / 3, 0.0)


class _Candidates:
    """The candidates of one layer type as they are measured: every (mode, kept set) measured
    once (``measure``), and those that become candidates (``choose``), in order."""

    def __init__(self, isolated: IsolatedLayer) -> None:
        self.isolated = isolated
        self.measured: dict[_Identity, CandidateProfile] = {}
        self.chosen: dict[_Identity, CandidateProfile] = {}

    def measure(self, name: str, mode: str, kept: list[str]) -> CandidateProfile:
        identity = (mode, tuple(kept))
        if identity not in self.measured:
            candidate = CandidateProfile(name, mode, kept, offload=False)
            self.isolated.measure_memory(candidate)
            self.measured[identity] = candidate
        return self.measured[identity]

    def choose(self, candidate: CandidateProfile) -> CandidateProfile:
        self.chosen.setdefault((candidate.mode, tuple(candidate.kept_units)), candidate)
        return candidate


def _units_that_run(isolated: IsolatedLayer, layer: nn.Module, declared: list[str]) -> list[str]:
    """The declared units whose marker intervals run at least one op in the plain layer's
    forward. A unit that runs none (a shared expert a model of this shape does not have)
    saves nothing when kept, and the engine warns about keeping it, so no candidate keeps it."""
    ran = isolated.unit_ops(interval_map_of(layer), declared)
    return [unit for unit in declared if ran[unit] > 0]


def _presets(found: _Candidates, declared: list[str]) -> CandidateProfile:
    """``none``, ``full`` and every selective preset with some of its units here; returns ``full``."""
    found.choose(found.measure("none", "none", []))
    full = found.choose(found.measure("full", "full", []))
    for preset_name, preset in PRESETS.items():
        if preset.mode != "selective":
            continue
        kept = list(preset_kept_units(preset_name, declared))
        if kept:  # a preset with none of its units here is `full` with more overhead
            found.choose(found.measure(preset_name, "selective", kept))
    return full


def _greedy_chain(
    found: _Candidates,
    layer: nn.Module,
    declared: list[str],
    full: CandidateProfile,
    say: Callable[[str], None],
) -> None:
    """Greedy chain from ``full``: each step adds the unit that saves the most time per byte
    kept. Time saved is each unit's own forward time (what the replay no longer reruns),
    timed from the markers of the plain layer; bytes are measured for each set tried, by a
    forward-only run. Scores are evaluated lazily: a unit's score from an earlier step is
    re-measured only when it tops the others. The chain's sets become candidates."""
    isolated = found.isolated
    saves = isolated.unit_seconds(interval_map_of(layer), declared)
    kept_now: list[str] = []
    retained_now = full.retained_bytes
    stale: dict[str, float] = {unit: math.inf for unit in declared}  # last known score
    while len(kept_now) < len(declared):
        tried: dict[tuple[str, ...], CandidateProfile] = {}  # this step's sets, measured
        while True:
            unit = max(stale, key=stale.__getitem__)
            units = [u for u in declared if u in kept_now or u == unit]
            if tuple(units) not in tried:
                probe = CandidateProfile(_kept_set_name(units), "selective", units, offload=False)
                isolated.measure_retained(probe)
                tried[tuple(units)] = probe
            stale[unit] = saves[unit] / max(tried[tuple(units)].retained_bytes - retained_now, 1)
            if stale[unit] >= max(stale.values()):
                break
        del stale[unit]
        kept_now, retained_now = units, tried.pop(tuple(units)).retained_bytes
        isolated.forget(tried.values())  # the chosen set's layer stays: measured next
        found.choose(found.measure(_kept_set_name(kept_now), "selective", kept_now))
        say(f"greedy {len(kept_now)}/{len(declared)}")


def _offloaded_variants(
    isolated: IsolatedLayer,
    found: dict[_Identity, CandidateProfile],
    bandwidth: dict[str, float],
    overlap: bool,
) -> None:
    """Adds to ``found`` the offloaded variant of every checkpointed candidate that moves bytes."""
    for candidate in list(found.values()):
        if candidate.mode == "none":
            continue
        variant = CandidateProfile(
            candidate.name + "+offload", candidate.mode, candidate.kept_units, offload=True
        )
        with quiet_empty_offload():  # moving nothing here only means the variant is dropped
            isolated.measure_memory(variant)
        isolated.forget([variant])
        if variant.offloaded_bytes == 0:
            continue  # nothing above min_bytes to move: same as the candidate itself
        variant.layer_seconds = candidate.layer_seconds
        variant.extra_seconds = candidate.extra_seconds + _exposed_seconds(variant, bandwidth, overlap)
        found[(candidate.mode + "+offload", tuple(candidate.kept_units))] = variant


def profile_layer_type(
    layer: nn.Module,
    args: tuple,
    kwargs: dict,
    min_bytes: int,
    repeats: int,
    bandwidth: dict[str, float],
    overlap: bool,
    say: Callable[[str], None],
    clock: RooflineClock | None = None,
) -> list[CandidateProfile]:
    """The layer type's candidates; ``say`` is called ``layer_type_steps(layer)`` times. With
    ``clock``, times are its estimates (offload's copies at its accelerator's host link, on
    fake tensors as on real ones: the engine moves fake tensors as it moves real ones)."""
    isolated = IsolatedLayer(layer, args, kwargs, min_bytes, clock)
    every_unit = [u.value for u in interval_map_of(layer).units]
    declared = _units_that_run(isolated, layer, every_unit)
    for unit in every_unit:
        if unit not in declared:
            say(f"unit {unit} runs no op here: never kept")  # its greedy step, skipped
    candidates = _Candidates(isolated)
    full = _presets(candidates, declared)
    say("presets")
    _greedy_chain(candidates, layer, declared, full, say)
    # Every candidate timed together, so their differences come from the same rounds.
    chosen = list(candidates.chosen.values())
    isolated.measure_time(chosen, repeats)
    isolated.forget(chosen)
    say("timing")
    found = dict(candidates.chosen)
    _offloaded_variants(isolated, found, bandwidth, overlap)
    say("offload")
    return list(found.values())

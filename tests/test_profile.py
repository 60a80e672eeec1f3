"""The profiler: what a profile holds, its isolated-layer timing, and ``actplan profile``."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from actplan.cli import main
from actplan.models import build_model, load_model
from actplan.planning.budget import preset_choices
from actplan.planning.cache import get_profile
from actplan.planning.profile import ModelProfile

# One worker profiles conftest's long models once
pytestmark = pytest.mark.xdist_group("long-profiles")

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# What the profile holds


@pytest.mark.slow
def test_profile_has_every_candidate_kind_and_sane_costs(dense, cache):
    bundle, profile = dense
    (layer_type,) = profile.layer_types
    assert layer_type.layer_indices == [0, 1]
    names = [c.name for c in layer_type.candidates]
    for expected in (
        "none",
        "full",
        "attn",
        "matmuls",
        "megatron-selective",
        "full+offload",
        "matmuls+offload",
    ):
        assert expected in names
    assert any(name.startswith("keep ") for name in names)  # the greedy chain
    assert len(names) == len(set(names))
    none, full, matmuls = (layer_type.candidate(n) for n in ("none", "full", "matmuls"))
    # `full` keeps exactly the layer input: batch x seq x dim fp32.
    assert full.retained_bytes == 16 * 64 * 64 * 4
    assert full.retained_bytes < matmuls.retained_bytes < none.retained_bytes
    assert none.extra_seconds == 0.0 and full.extra_seconds >= 0.0
    offloaded = layer_type.candidate("full+offload")
    assert offloaded.offloaded_bytes == full.retained_bytes and offloaded.retained_bytes == 0
    # The chain grows one unit at a time, each set measured in full.
    chain = [c for c in layer_type.candidates if c.name.startswith("keep ") and not c.offload]
    chain.sort(key=lambda c: len(c.kept_units))
    sizes = [len(c.kept_units) for c in chain]
    assert sizes == sorted(set(sizes)) and all(c.transient_bytes > 0 for c in chain)
    assert all(set(a.kept_units) < set(b.kept_units) for a, b in itertools.pairwise(chain))
    # Cached: the same profile comes back without measuring.
    again, from_cache = get_profile(bundle, "model_factories:dense_long", CPU, cache_dir=cache, min_bytes=0)
    assert from_cache and again == profile
    assert ModelProfile.from_json(profile.to_json()) == profile


@pytest.mark.slow
def test_profile_predicts_the_measured_peaks_of_none_and_full(dense, moe):
    for _, profile in (dense, moe):
        problem = profile.problem()
        for preset, measured in (("none", profile.none_peak_bytes), ("full", profile.full_peak_bytes)):
            predicted = problem.peak(preset_choices(profile, preset))
            assert abs(predicted - measured) / measured < 0.05, (profile.model, preset, predicted, measured)


# ---------------------------------------------------------------------------------------------
# Models and the CLI


def test_unit_seconds_times_each_units_own_forward():
    from actplan._install.apply import find_layers, interval_map_of
    from actplan.planning._isolated import IsolatedLayer, capture_layer_inputs

    bundle = build_model("dense", "tiny", batch_size=8, seq_len=64)
    (_, layer), *_ = find_layers(bundle.model)
    (_, args, kwargs), *_ = capture_layer_inputs(bundle.model, bundle.make_batch(0))
    isolated = IsolatedLayer(layer, args, kwargs, 0)
    units = [u.value for u in interval_map_of(layer).units]
    seconds = isolated.unit_seconds(interval_map_of(layer), units)
    assert set(seconds) == set(units) and all(s >= 0 for s in seconds.values())
    assert seconds["mlp_up"] > 0 and seconds["attn_core"] > 0
    # Together they fit inside one forward of the layer (the spans do not overlap).
    start = time.perf_counter()
    isolated.step(layer, backward=False)
    assert sum(seconds.values()) < 3 * (time.perf_counter() - start) + 0.01


def test_model_spec_errors_name_the_fix():
    with pytest.raises(ValueError, match="built-in name"):
        load_model("nope")
    with pytest.raises(ValueError, match="cannot import"):
        load_model("no_such_module_xyz:factory")
    with pytest.raises(ValueError, match="no callable"):
        load_model("model_factories:missing")
    with pytest.raises(ValueError, match="return a ModelBundle or a pair"):
        load_model("model_factories:not_a_pair")


@pytest.mark.slow
def test_cli_profile_prints_the_candidates(dense, cache, capsys):
    args = ["profile", "--model", "model_factories:dense_long", "--min-bytes", "0", "--cache-dir", str(cache)]
    assert main([*args, "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "cached" in printed and "matmuls+offload" in printed

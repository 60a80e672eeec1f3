"""The caching-allocator model (measure._allocator) and its settings (measure._alloc_conf): each
rule of torch's c10/cuda/CUDACachingAllocator.cpp on a case small enough to work out by hand,
the settings parsed and refused as torch parses and refuses them, and properties that hold for
any trace (reserved covers allocated, frees give everything back to the cache)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actplan.measure._alloc_conf import (
    MIB,
    AllocatorSettings,
    AllocatorSettingsError,
    settings_from_env,
)
from actplan.measure._allocator import (
    CachingAllocatorModel,
    SimulatedOutOfMemory,
    next_division,
    replay,
)


def model(text: str = "", capacity: int | None = None) -> CachingAllocatorModel:
    return CachingAllocatorModel(AllocatorSettings.parse(text), capacity)


# --- rounding and segment sizes -----------------------------------------------------------------


def test_requests_round_to_512_bytes_and_power_of_two_divisions():
    plain = model()
    assert [plain.round_size(n) for n in (1, 512, 513, 3 * MIB + 1)] == [512, 512, 1024, 3 * MIB + 512]
    # torch's own example: 1200 over 4 divisions of [1024, 2048) is 1280.
    assert next_division(1200, 4) == 1280
    assert next_division(2048, 4) == 2048
    quartered = model("roundup_power2_divisions:4")
    assert quartered.round_size(1 * MIB + 300_000) == 1 * MIB + 512 * 1024  # steps of 256 KiB
    assert quartered.round_size(1500) == 1536  # at most 512 x 4 bytes: plain rounding
    # The list form: below 256 MiB one division (off), from 256 MiB two, above 512 MiB eight.
    listed = AllocatorSettings.parse("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert listed.roundup_power2_divisions[:8] == (1,) * 8
    assert listed.roundup_power2_divisions[8:10] == (1, 2)
    assert set(listed.roundup_power2_divisions[10:]) == {8}
    listed_model = CachingAllocatorModel(listed)
    assert listed_model.round_size(600 * MIB) == 768 * MIB  # [512 MiB, 1 GiB) in two steps
    assert listed_model.round_size(1229 * MIB) == 1280 * MIB  # [1 GiB, 2 GiB) in steps of 128 MiB
    assert listed_model.round_size(300 * MIB + 1) == 300 * MIB + 512  # one division: plain


def test_small_requests_pack_into_2_mib_segments_and_medium_ones_into_20_mib():
    allocator = model()
    allocator.malloc(600_000)
    allocator.malloc(600_000)
    assert allocator.reserved == 2 * MIB  # both in one small segment
    allocator.malloc(900_000)
    assert allocator.reserved == 4 * MIB  # 2 MiB minus 1.2 MB left is too little
    allocator.malloc(5 * MIB)
    allocator.malloc(5 * MIB)
    assert allocator.reserved == 4 * MIB + 20 * MIB  # two 5 MiB requests in one 20 MiB segment
    allocator.malloc(11 * MIB)
    assert allocator.reserved == 4 * MIB + 20 * MIB + 12 * MIB  # 10 MiB and up: rounded to 2 MiB
    assert allocator.report().segments == 4


def test_a_large_block_keeps_a_remainder_of_1_mib_or_less_unsplit():
    allocator = model()
    block = allocator.malloc(11 * MIB)  # a 12 MiB segment: 1 MiB left over is not split off
    assert block.size == 12 * MIB
    assert allocator.allocated == 12 * MIB
    assert allocator.requested == 11 * MIB
    larger = model().malloc(9 * MIB)  # in a 20 MiB segment: 11 MiB left, split off
    assert larger.size == 9 * MIB


def test_large_segment_size_sets_the_medium_segment():
    allocator = model("large_segment_size_mb:40")
    allocator.malloc(5 * MIB)
    assert allocator.reserved == 40 * MIB


# --- reuse, splitting, merging, streams ---------------------------------------------------------


def test_freed_blocks_are_reused_best_fit_split_and_merged_back():
    allocator = model()
    big = allocator.malloc(100 * MIB)
    allocator.free(big)
    first = allocator.malloc(50 * MIB)
    second = allocator.malloc(30 * MIB)
    assert allocator.reserved == 100 * MIB  # both carved from the cached 100 MiB segment
    assert second.addr == first.addr + 50 * MIB
    allocator.free(first)
    allocator.free(second)
    whole = allocator.malloc(100 * MIB)  # the three pieces merged back into one block
    assert whole.addr == first.addr and allocator.reserved == 100 * MIB


def test_best_fit_takes_the_smallest_block_that_fits():
    allocator = model()
    blocks = [allocator.malloc(n * MIB) for n in (60, 40, 80)]
    for block in blocks:
        allocator.free(block)
    assert allocator.malloc(35 * MIB).addr == blocks[1].addr


def test_a_block_freed_on_one_stream_is_not_reused_by_another():
    allocator = model()
    allocator.free(allocator.malloc(64 * MIB, stream=1))
    allocator.malloc(64 * MIB, stream=0)
    assert allocator.reserved == 128 * MIB
    allocator.malloc(64 * MIB, stream=1)
    assert allocator.reserved == 128 * MIB


def test_max_split_size_keeps_oversize_blocks_whole_and_within_the_rounding_limit():
    allocator = model("max_split_size_mb:64")
    allocator.free(allocator.malloc(100 * MIB))
    allocator.malloc(50 * MIB)  # an oversize cached block is not handed to a smaller request
    assert allocator.reserved == 150 * MIB
    rounding = model("max_split_size_mb:64")
    rounding.free(rounding.malloc(100 * MIB))
    rounding.malloc(70 * MIB)  # 100 >= 70 + 20: too much larger, a new segment
    assert rounding.reserved == 170 * MIB
    taken = model("max_split_size_mb:64")
    taken.free(taken.malloc(100 * MIB))
    block = taken.malloc(90 * MIB)  # within 20 MiB: the whole 100 MiB block, unsplit
    assert block.size == 100 * MIB and taken.reserved == 100 * MIB
    wider = model("max_split_size_mb:64,max_non_split_rounding_mb:40")
    wider.free(wider.malloc(100 * MIB))
    assert wider.malloc(70 * MIB).size == 100 * MIB


# --- out of memory and what is given back first --------------------------------------------------


def test_out_of_memory_frees_cached_segments_and_retries():
    allocator = model(capacity=23 * MIB)
    allocator.free(allocator.malloc(500_000))  # a cached small segment, 2 MiB
    allocator.malloc(22 * MIB)  # 2 + 22 > 23: the cached segment is released, then it fits
    report = allocator.report()
    assert report.reserved_bytes == 22 * MIB
    assert report.peak_reserved_bytes == 22 * MIB
    assert report.retries == 1
    with pytest.raises(SimulatedOutOfMemory, match="requested"):
        allocator.malloc(4 * MIB)


def test_max_split_size_gives_back_oversize_blocks_before_everything_else():
    allocator = model("max_split_size_mb:64", capacity=160 * MIB)
    allocator.free(allocator.malloc(100 * MIB))
    allocator.malloc(50 * MIB)  # 100 + 50 fits: a new segment beside the cached one
    allocator.malloc(50 * MIB)  # 150 + 50 does not: the oversize cached block goes first
    report = allocator.report()
    assert report.reserved_bytes == 100 * MIB and report.retries == 0


def test_garbage_collection_frees_old_unsplit_segments_above_the_threshold():
    text = "garbage_collection_threshold:0.3,per_process_memory_fraction:1.0"
    collected = model(text, capacity=100 * MIB)
    collected.free(collected.malloc(40 * MIB))
    collected.malloc(50 * MIB)  # 40 reserved > 30: the cached 40 MiB goes before the new segment
    assert collected.reserved == 50 * MIB
    kept = model(capacity=100 * MIB)
    kept.free(kept.malloc(40 * MIB))
    kept.malloc(50 * MIB)
    assert kept.reserved == 90 * MIB


def test_a_memory_fraction_caps_what_is_reserved():
    allocator = model("per_process_memory_fraction:0.5", capacity=100 * MIB)
    allocator.malloc(40 * MIB)
    with pytest.raises(SimulatedOutOfMemory):
        allocator.malloc(20 * MIB)


# --- expandable segments ------------------------------------------------------------------------


def test_expandable_segments_grow_one_segment_in_pages():
    allocator = model("expandable_segments:True")
    allocator.malloc(5 * MIB)
    assert allocator.reserved == 20 * MIB  # one 20 MiB page mapped
    allocator.malloc(30 * MIB)  # the free 15 MiB and one more... two more pages, merged
    assert allocator.reserved == 40 * MIB
    assert model().reserved == 0
    plain = model()
    plain.malloc(5 * MIB)
    plain.malloc(30 * MIB)
    assert plain.reserved == 50 * MIB


def test_expandable_segments_unmap_free_pages_when_memory_runs_out():
    allocator = model("expandable_segments:True", capacity=100 * MIB)
    first = allocator.malloc(60 * MIB)
    allocator.malloc(20 * MIB)
    allocator.free(first)  # 60 MiB free at the front, 80 mapped
    allocator.malloc(70 * MIB)  # no free block fits; mapping 60 more exceeds 100: unmap, remap
    assert allocator.reserved == 20 * MIB + 80 * MIB  # the 60 free MiB unmapped, 4 pages mapped
    assert allocator.report().retries == 1


# --- replay and properties ----------------------------------------------------------------------


def test_replay_reports_peaks_and_ignores_zero_byte_requests():
    events = [(1, 1, 3 * MIB, 0), (1, 2, 0, 0), (1, 3, 100, 0)]
    events += [(0, 1, 0, 0), (0, 2, 0, 0), (1, 4, 2 * MIB, 0)]
    report = replay(events)
    assert report.peak_requested_bytes == 3 * MIB + 100
    assert report.peak_allocated_bytes == 3 * MIB + 512
    assert report.peak_reserved_bytes == 20 * MIB + 2 * MIB
    assert report.fragmentation_bytes == report.peak_reserved_bytes - report.peak_allocated_bytes


_sizes = st.one_of(st.integers(1, 4096), st.integers(4096, 2 * MIB), st.integers(2 * MIB, 64 * MIB))


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), _sizes, st.integers(0, 1)), min_size=1, max_size=80),
    text=st.sampled_from(
        ["", "expandable_segments:True", "max_split_size_mb:32", "roundup_power2_divisions:4"]
    ),
)
def test_any_trace_reserves_at_least_what_it_allocates_and_frees_back_to_the_cache(ops, text):
    allocator = model(text)
    live = []
    for allocate, size, stream in ops:
        if allocate or not live:
            live.append(allocator.malloc(size, stream))
        else:
            allocator.free(live.pop(size % len(live)))
        assert allocator.allocated <= allocator.reserved
        assert allocator.requested <= allocator.allocated
    for block in live:
        allocator.free(block)
    assert allocator.allocated == allocator.requested == 0
    allocator._release_cached()  # as empty_cache: every cached byte goes back to the device
    assert allocator.reserved == 0
    assert allocator.report().segments == 0


# --- the settings ---------------------------------------------------------------------------------


def test_settings_parse_torchs_keys_and_defaults():
    default = AllocatorSettings()
    assert default.max_split_size is None and not default.expandable_segments
    parsed = AllocatorSettings.parse(
        "expandable_segments:True, max_split_size_mb:512,release_lock_on_cudamalloc:True"
    )
    assert parsed.expandable_segments and parsed.max_split_size == 512 * MIB
    assert parsed.unmodelled == ("release_lock_on_cudamalloc",)
    assert settings_from_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}).expandable_segments
    new_name = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF": "bogus:1"}
    assert settings_from_env(new_name).max_split_size == 64 * MIB
    assert settings_from_env({}) == AllocatorSettings()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("expandable_segment:True", "unknown allocator setting 'expandable_segment'; known: max_split"),
        ("max_split_size_mb:8", "too small; torch needs at least 20"),
        ("garbage_collection_threshold:1.5,per_process_memory_fraction:0.9", "outside"),
        ("garbage_collection_threshold:0.6", "acts only under a per-process memory fraction"),
        ("roundup_power2_divisions:3", "power of two"),
        ("roundup_power2_divisions:[256:3]", "power-of-two count"),
        ("expandable_segments:yes", "True or False"),
        ("backend:cudaMallocAsync", "not modelled"),
        ("max_split_size_mb", "has no value"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(text, message):
    with pytest.raises(AllocatorSettingsError, match=message):
        AllocatorSettings.parse(text)


def test_a_bad_environment_setting_names_the_variable():
    with pytest.raises(AllocatorSettingsError, match="PYTORCH_CUDA_ALLOC_CONF: unknown"):
        settings_from_env({"PYTORCH_CUDA_ALLOC_CONF": "bogus:1"})

"""Measurement for actplan: a device-independent memory meter, an op counter, an interleaved step
timer and gradient-parity checks, used by the benchmarks, the planner and the CLI to prove a plan
saves memory, to price its overhead, and to prove it changes no gradient.

This package only re-exports; the work is in ``_memory`` (with ``_tracker``), ``_fake`` (runs on
fake tensors), ``_roofline`` (estimated time on a named accelerator), ``_allocator`` (with
``_alloc_blocks`` and ``_alloc_conf``: what torch's CUDA caching allocator reserves), ``_counting``,
``_timing`` and ``_parity``. It imports torch, the standard library, ``actplan._storage`` and
``actplan._torch_internals``.
"""

from __future__ import annotations

from actplan.measure._alloc_blocks import AllocatorReport, SimulatedOutOfMemory
from actplan.measure._alloc_conf import AllocatorSettings, AllocatorSettingsError, settings_from_env
from actplan.measure._allocator import CachingAllocatorModel
from actplan.measure._allocator import replay as replay_allocations
from actplan.measure._counting import OpCounter
from actplan.measure._fake import (
    FakeRun,
    FakeValueError,
    RoutingRecorder,
    balanced_counts,
    copy_module,
    is_fake,
)
from actplan.measure._memory import (
    MarkSample,
    MemoryMeter,
    MemoryReport,
    SavedTensorMeter,
    unique_storage_bytes,
)
from actplan.measure._parity import (
    GradCensus,
    ParityReport,
    StepCapture,
    capture_step,
    compare_steps,
    grad_census,
)
from actplan.measure._roofline import (
    ACCELERATORS,
    LINKS,
    Accelerator,
    RooflineClock,
    accelerator,
    link_rate,
)
from actplan.measure._timing import RatioStats, TimingStats, interleaved_timing, ratio

__all__ = [
    "ACCELERATORS",
    "LINKS",
    "Accelerator",
    "AllocatorReport",
    "AllocatorSettings",
    "AllocatorSettingsError",
    "CachingAllocatorModel",
    "FakeRun",
    "FakeValueError",
    "GradCensus",
    "MarkSample",
    "MemoryMeter",
    "MemoryReport",
    "OpCounter",
    "ParityReport",
    "RatioStats",
    "RooflineClock",
    "RoutingRecorder",
    "SavedTensorMeter",
    "SimulatedOutOfMemory",
    "StepCapture",
    "TimingStats",
    "accelerator",
    "balanced_counts",
    "capture_step",
    "compare_steps",
    "copy_module",
    "grad_census",
    "interleaved_timing",
    "is_fake",
    "link_rate",
    "ratio",
    "replay_allocations",
    "settings_from_env",
    "unique_storage_bytes",
]

"""The CUDA caching allocator's settings as a user writes them (``PYTORCH_ALLOC_CONF``, formerly
``PYTORCH_CUDA_ALLOC_CONF``): parsed and checked with torch's own rules, so that the allocator
model (``_allocator``) replays a step under the settings the user's run will have.

The keys, their defaults and their checks follow ``c10/core/AllocatorConfig.cpp``
(``AcceleratorAllocatorConfig::parseArgs`` and its ``parse*`` helpers) and
``c10/cuda/CUDAAllocatorConfig.h`` (the CUDA-only keys). Keys that change what the device
holds are modelled; keys that only change host-side behaviour (lock release, pinned host
memory) are accepted and listed in ``AllocatorSettings.unmodelled``; the ``cudaMallocAsync``
backend is refused (its pools are the driver's, not torch's). Standard library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["MIB", "AllocatorSettings", "AllocatorSettingsError", "settings_from_env"]

MIB = 1 << 20
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one per power of two
_LARGE_BUFFER = 20 * MIB  # kLargeBuffer, the default large segment and non-split rounding

# The keys torch reads that change how the device's memory is carved up.
MODELLED_KEYS = (
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "large_segment_size_mb",
    "per_process_memory_fraction",
    "backend",
)
# CUDA keys torch accepts that change nothing the device allocator holds.
HOST_SIDE_KEYS = (
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
)


class AllocatorSettingsError(ValueError):
    """An allocator setting torch would refuse, or one the model cannot honour."""


@dataclass(frozen=True)
class AllocatorSettings:
    """What the caching allocator is told; the defaults are torch's (no environment variable)."""

    max_split_size: int | None = None  # None: unlimited (SIZE_MAX), blocks of any size split
    max_non_split_rounding: int = _LARGE_BUFFER
    garbage_collection_threshold: float = 0.0  # 0: off
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    expandable_segments: bool = False
    large_segment_size: int = _LARGE_BUFFER
    memory_fraction: float | None = None  # torch.cuda.set_per_process_memory_fraction
    unmodelled: tuple[str, ...] = field(default=(), compare=False)
    text: str = field(default="", compare=False)

    def describe(self) -> str:
        return self.text or "torch's defaults"

    @classmethod
    def parse(cls, text: str) -> AllocatorSettings:
        """Settings from a ``PYTORCH_ALLOC_CONF`` string such as
        ``expandable_segments:True,max_split_size_mb:512``."""
        values: dict[str, object] = {}
        unmodelled: list[str] = []
        for key, value in _items(text):
            if key in HOST_SIDE_KEYS:
                unmodelled.append(key)
            elif key == "max_split_size_mb":
                values["max_split_size"] = _megabytes(key, value, minimum=_LARGE_BUFFER // MIB)
            elif key == "max_non_split_rounding_mb":
                values["max_non_split_rounding"] = _megabytes(key, value, minimum=_LARGE_BUFFER // MIB)
            elif key == "large_segment_size_mb":
                values["large_segment_size"] = _megabytes(key, value, minimum=2)
            elif key == "garbage_collection_threshold":
                threshold = _number(key, value)
                if not 0.0 < threshold < 1.0:
                    raise AllocatorSettingsError(
                        f"garbage_collection_threshold:{value} is outside (0.0, 1.0); torch refuses it"
                    )
                values["garbage_collection_threshold"] = threshold
            elif key == "per_process_memory_fraction":
                fraction = _number(key, value)
                if not 0.0 < fraction <= 1.0:
                    raise AllocatorSettingsError(
                        f"per_process_memory_fraction:{value} must be in (0.0, 1.0]"
                    )
                values["memory_fraction"] = fraction
            elif key == "roundup_power2_divisions":
                values["roundup_power2_divisions"] = _divisions(value)
            elif key == "expandable_segments":
                values["expandable_segments"] = _boolean(key, value)
            elif key == "backend":
                if value != "native":
                    raise AllocatorSettingsError(
                        f"backend:{value} is not modelled: only torch's native caching allocator "
                        "is (cudaMallocAsync pools belong to the CUDA driver); drop the key or "
                        "set backend:native"
                    )
            else:
                known = ", ".join((*MODELLED_KEYS, *HOST_SIDE_KEYS))
                raise AllocatorSettingsError(f"unknown allocator setting {key!r}; known: {known}")
        settings = cls(**values, unmodelled=tuple(unmodelled), text=text.strip())  # type: ignore[arg-type]
        if settings.garbage_collection_threshold and settings.memory_fraction is None:
            raise AllocatorSettingsError(
                "garbage_collection_threshold acts only under a per-process memory fraction "
                "(torch reclaims cached blocks above threshold x fraction x memory); add "
                "per_process_memory_fraction:<f> or drop the threshold"
            )
        return settings


def settings_from_env(environ: dict[str, str] | None = None) -> AllocatorSettings:
    """The settings torch's allocator would read from this environment: ``PYTORCH_ALLOC_CONF``,
    else the older ``PYTORCH_CUDA_ALLOC_CONF``, else the defaults."""
    env = os.environ if environ is None else environ
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        if env.get(name):
            try:
                return AllocatorSettings.parse(env[name])
            except AllocatorSettingsError as err:
                raise AllocatorSettingsError(f"{name}: {err}") from None
    return AllocatorSettings()


def _items(text: str) -> list[tuple[str, str]]:
    # Commas separate keys, but also the entries of a bracketed list.
    items, depth, start = [], 0, 0
    for index, char in enumerate(text + ","):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            item = text[start:index].strip()
            start = index + 1
            if not item:
                continue
            key, sep, value = item.partition(":")
            if not sep or not value.strip():
                raise AllocatorSettingsError(f"allocator setting {item!r} has no value; write key:value")
            items.append((key.strip(), value.strip()))
    if depth:
        raise AllocatorSettingsError(f"unbalanced brackets in allocator settings {text!r}")
    return items


def _number(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise AllocatorSettingsError(f"{key}:{value} is not a number") from None


def _whole(key: str, value: str) -> int:
    if not value.isdigit():
        raise AllocatorSettingsError(f"{key}:{value} is not a whole number")
    return int(value)


def _megabytes(key: str, value: str, minimum: int) -> int:
    megabytes = _whole(key, value)
    if megabytes < minimum:
        raise AllocatorSettingsError(f"{key}:{value} is too small; torch needs at least {minimum}")
    return megabytes * MIB


def _boolean(key: str, value: str) -> bool:
    if value not in ("True", "False", "true", "false"):
        raise AllocatorSettingsError(f"{key}:{value} must be True or False")
    return value in ("True", "true")


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _divisions(value: str) -> tuple[int, ...]:
    """``roundup_power2_divisions``: one count for every size, or ``[256:1,512:2,>:8]`` (each
    boundary in MiB opens an interval; the first entry also covers the intervals below it,
    ``>`` every interval after the last)."""
    key = "roundup_power2_divisions"
    if not value.startswith("["):
        count = _whole(key, value)
        if not _power_of_two(count):
            raise AllocatorSettingsError(f"{key}:{value} must be a power of two")
        return (count,) * ROUNDUP_INTERVALS
    if not value.endswith("]"):
        raise AllocatorSettingsError(f"{key}:{value} opens a list it does not close")
    divisions = [0] * ROUNDUP_INTERVALS
    first, last_index = True, 0
    for entry in filter(None, (part.strip() for part in value[1:-1].split(","))):
        boundary, sep, count_text = entry.partition(":")
        count = _whole(key, count_text) if sep else -1
        if count < 0 or (count and not _power_of_two(count)):
            raise AllocatorSettingsError(f"{key}: entry {entry!r} needs a power-of-two count (or 0)")
        if boundary.strip() == ">":
            divisions[last_index + 1 :] = [count] * (ROUNDUP_INTERVALS - last_index - 1)
            continue
        size_mb = _whole(key, boundary.strip())
        if not _power_of_two(size_mb):
            raise AllocatorSettingsError(f"{key}: boundary {boundary!r} must be a power of two (MiB)")
        index = min(size_mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            divisions[:index] = [count] * index
            first = False
        divisions[index] = count
        last_index = index
    return tuple(divisions)

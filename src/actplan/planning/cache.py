"""The profile cache: a profile is stored as JSON under a digest of everything it depends on
(``cache_key``, defined in the leaf ``_cache_key`` and re-exported here), and ``get_profile``
reuses it or profiles afresh.

Imports torch, the models' bundle type, the profile records, the key and the profiler
(``profile``); the profiler imports the key, not this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from actplan.models import ModelBundle
from actplan.planning._cache_key import cache_key
from actplan.planning._records import ModelProfile
from actplan.planning.profile import profile_model
from actplan.progress import ProgressCallback
from actplan.sizes import DEFAULT_OFFLOAD_MIN_BYTES

__all__ = ["cache_key", "default_cache_dir", "get_profile", "load_cached", "store"]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/actplan/profiles``, else ``~/.cache/actplan/profiles``."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "actplan" / "profiles"


def load_cached(cache_dir: Path, key: str) -> ModelProfile | None:
    """The profile stored under ``key``; ``None`` when there is none or it cannot be read."""
    path = cache_dir / f"{key}.json"
    if not path.is_file():
        return None
    try:
        return ModelProfile.from_json(path.read_text())
    except (json.JSONDecodeError, TypeError, KeyError):
        return None  # an older or damaged file: profile again


def store(cache_dir: Path, profile: ModelProfile) -> Path:
    """Write ``profile`` under its key; returns the file."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{profile.cache_key}.json"
    path.write_text(profile.to_json())
    return path


def get_profile(
    bundle: ModelBundle,
    spec: str,
    device: torch.device,
    *,
    cache_dir: Path | None = None,
    refresh: bool = False,
    repeats: int = 5,
    min_bytes: int = DEFAULT_OFFLOAD_MIN_BYTES,
    bandwidth: float | None = None,
    progress: ProgressCallback | None = None,
) -> tuple[ModelProfile, bool]:
    """The cached profile when its key matches (model, shapes, dtype, device, torch version),
    else a fresh one, stored. Returns ``(profile, came_from_cache)``."""
    directory = cache_dir or default_cache_dir()
    key = cache_key(bundle, spec, device, min_bytes, bandwidth)
    if not refresh:
        cached = load_cached(directory, key)
        if cached is not None:
            return cached, True
    profile = profile_model(
        bundle,
        spec=spec,
        device=device,
        repeats=repeats,
        min_bytes=min_bytes,
        bandwidth=bandwidth,
        progress=progress,
    )
    store(directory, profile)
    return profile, False

"""The profile cache: a profile is stored as JSON under a digest of everything it depends on,
and ``get_profile`` reuses it or profiles afresh.

Imports torch (shapes and dtypes for the key), the models' bundle type and the profile
records; the profiler itself only when a profile has to be made.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from actplan.models import ModelBundle
from actplan.planning._records import PROFILE_FORMAT, ModelProfile
from actplan.progress import ProgressCallback
from actplan.sizes import DEFAULT_OFFLOAD_MIN_BYTES

__all__ = ["cache_key", "default_cache_dir", "get_profile", "load_cached", "store"]


def cache_key(
    bundle: ModelBundle,
    spec: str,
    device: torch.device,
    min_bytes: int,
    bandwidth: float | None = None,
    gpu: str | None = None,
) -> str:
    """A digest of everything a profile depends on: model spec, parameter and batch shapes and
    dtypes, device type, torch version, offload threshold, a forced copy bandwidth (``None``:
    measured), the accelerator whose roofline clock gave the times (``None``: timed) and this
    file's format."""
    batch = bundle.make_batch(0)
    described = {
        "spec": spec,
        "params": [(name, list(p.shape), str(p.dtype)) for name, p in bundle.model.named_parameters()],
        "batch": {k: (list(v.shape), str(v.dtype)) for k, v in batch.items() if isinstance(v, torch.Tensor)},
        "device": device.type,
        "torch": torch.__version__,
        "min_bytes": min_bytes,
        "format": PROFILE_FORMAT,
        **({"bandwidth": bandwidth} if bandwidth is not None else {}),
        **({"roofline": gpu} if gpu is not None else {}),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]


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
    from actplan.planning.profile import profile_model  # the profiler imports this module

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

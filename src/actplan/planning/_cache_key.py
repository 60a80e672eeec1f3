"""The key a profile is cached under: a digest of everything a profile depends on.

A leaf of the package that exists to break the ``cache`` <-> ``profile`` circle: the profiler
stamps its profile with this key and the cache looks profiles up by it, so both import it and
``cache`` imports ``profile``, never the reverse. Imports torch (shapes and dtypes), the
records (the file format) and, for annotations, the models' bundle type.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import torch

from actplan.planning._records import PROFILE_FORMAT

if TYPE_CHECKING:
    from actplan.models import ModelBundle

__all__ = ["cache_key"]


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
    measured), the accelerator whose roofline clock gave the times (``None``: timed) and the
    profile file's format."""
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

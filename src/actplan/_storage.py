"""Storage identity: one helper for "which storage is this tensor's" and "which storages does
the model own" (parameters and buffers), shared by the offload engine, the meters and the
profiler. Imports torch and ``_torch_internals`` (which holds the storage key itself)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from actplan._torch_internals import storage_key


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {storage_key(t) for t in tensors}


def owned_storages(model: nn.Module, parameters: bool = True, buffers: bool = True) -> set[int]:
    """Storages of ``model``'s parameters and/or buffers: the model's own memory, never an
    activation."""
    tensors: list[torch.Tensor] = []
    if parameters:
        tensors.extend(model.parameters())
    if buffers:
        tensors.extend(model.buffers())
    return storage_keys(tensors)

"""What the eager engine (``scoped.ScopedRegion``) works with, besides its state machine: the
records of held outputs and watched ops, what a layer's first call teaches (``LearntLayout``)
and what a call held (``HeldReport``), the placeholders the replay serves for dropped
outputs, and the small per-op helpers and context objects the region uses.

Imports ``ops`` (which ops a segment's dispatch mode passes through), ``units``; plus torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from actplan._engine.ops import IGNORED_OPS
from actplan.units import MarkerInterval

if TYPE_CHECKING:
    from actplan._engine.scoped import ScopedRegion


def _python_storage_refs() -> int:
    # A storage whose Python object exists counts one reference for it (torch keeps that
    # object alive with the storage); calibrated once rather than assumed.
    probe = torch.empty(1)
    return torch._C._storage_Use_Count(probe.untyped_storage()._cdata) - 1


PYTHON_REFS = _python_storage_refs()


def is_dense_tensor(tensor: object) -> bool:
    """A plain tensor whose storage the engine can key on: ``torch.Tensor`` itself, or a fake
    one (``FakeTensorMode``), whose meta storage stands for the real one byte for byte. Other
    subclasses (DTensor, ...) are handled as opaque."""
    return type(tensor) is torch.Tensor or type(tensor) is FakeTensor


def detach_alias(tensor: torch.Tensor) -> torch.Tensor:
    # As torch's SAC cache does: the alias must not look like a view to autograd when served.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()


ROUTING = object()  # "saved because it routes or communicates", in place of a kept interval


@dataclass(eq=False)
class HeldOutput:
    """One tensor output of a kept op: held until proven unread, or dropped."""

    value: Any  # the detached alias; an offload handle; None once dropped or served
    interval: MarkerInterval | None  # the kept interval, None for routing/collective outputs
    storage: int  # the storage's _cdata
    nbytes: int
    version: int
    meta: tuple  # (size, stride, dtype, device) for the placeholder
    producer: Any  # the op
    mutated_by: Any = None  # an in-place op seen writing into it
    offloaded: bool = False
    routing: bool = False  # a routing/collective output: held whatever reads it


@dataclass(eq=False)
class Entry:
    """One op of a watched segment, in forward order: run again, or served."""

    func: Any
    leaves: list | None = None  # kept ops: HeldOutput or plain (non-tensor) values
    spec: Any = None


@dataclass
class LearntLayout:
    """What a layer's first call showed: its marker sequence, which segments ran routing,
    collective or device-to-host ops outside every kept interval, and which ran only views."""

    markers: tuple[str, ...]
    kept: tuple[MarkerInterval | None, ...]  # per segment, the innermost kept interval open
    routing_segments: frozenset[int]
    inert_segments: frozenset[int]  # segments that ran nothing but views


@dataclass
class HeldReport:
    """Per kept interval (``None``: routing and collective outputs), the bytes a call holds at
    the end of its forward, against what autograd keeps for the same ops without checkpointing:
    the tensors those ops save, and those of their outputs that any op saves (measured on the
    layer's first call, when every segment is watched)."""

    held: dict[MarkerInterval | None, int] = field(default_factory=dict)
    autograd: dict[MarkerInterval | None, int] = field(default_factory=dict)


class _Placeholders(threading.local):
    storages: dict[int, StorageWeakRef]

    def __init__(self) -> None:
        self.storages = {}


PLACEHOLDERS = _Placeholders()


def is_placeholder(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in a placeholder the replay made for a dropped output (its
    values are meaningless, and nothing that reads them runs before the replay stops)."""
    if not is_dense_tensor(tensor):
        return False
    ref = PLACEHOLDERS.storages.get(tensor.untyped_storage()._cdata)
    return ref is not None and not ref.expired()


def make_placeholder(meta: tuple) -> tuple[torch.Tensor, int]:
    # NaN-filled: a read the engine cannot see (a kernel reading raw memory) shows up as NaN,
    # never as a silently wrong gradient. Only floating-point outputs are ever dropped.
    size, stride, dtype, device = meta
    out = torch.empty_strided(size, stride, dtype=dtype, device=device)
    storage = out.untyped_storage()
    PLACEHOLDERS.storages[storage._cdata] = StorageWeakRef(storage)
    return out.fill_(float("nan")), storage._cdata


def tensor_args(args: tuple, kwargs: dict):
    # An aten op's tensor arguments: positional, keyword, and inside Tensor[] lists.
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item


def is_parameter(tensor: torch.Tensor) -> bool:
    # A parameter, or a view of one (``weight.t()`` saved by a GEMM): not an activation.
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


def checkpoint_frame(pack: Any) -> Any:
    # torch.utils.checkpoint's pack hook closes over its frame; the frame's count of saved
    # tensors tells where the replay will stop. Without it, nothing is dropped on that ground.
    for cell in getattr(pack, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if hasattr(value, "weak_holders") and hasattr(value, "early_stop"):
            return value
    return None


class SegmentMode(TorchDispatchMode):
    """The dispatch mode of one watched segment: hands each op to the region's forward or
    replay handler (``run_op``)."""

    def __init__(self, run_op: Any) -> None:
        super().__init__()
        self.run_op = run_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in IGNORED_OPS:
            return func(*args, **kwargs)
        return self.run_op(func, args, kwargs)


class Phase:
    """A context manager that starts the region's forward or replay (``context_fn``'s pair)."""

    def __init__(self, region: ScopedRegion, replay: bool) -> None:
        self.region, self.replay = region, replay

    def __enter__(self) -> None:
        if self.replay:
            self.region.begin_replay()
        else:
            self.region.begin_forward()

    def __exit__(self, *exc: Any) -> None:
        self.region.end_phase(failed=exc[0] is not None)

"""What the eager engine (``scoped.ScopedRegion``) works with, besides its state machine: the
records of held outputs and watched ops, the phases of a call, the placeholders the replay
serves for dropped outputs, and the small per-op helpers and the segment dispatch mode.

Imports ``ops`` (which ops a segment's dispatch mode passes through), ``_torch_internals``;
plus torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from actplan._engine.ops import IGNORED_OP_IDS
from actplan._torch_internals import (
    DEVICE_QUERY,
    FakeTensor,
    TorchDispatchMode,
    detach_alias,
    is_traceable_wrapper_subclass,
    storage_key_of,
    storage_use_count,
    tensor_base,
)
from actplan.units import MarkerInterval


class RegionPhase(enum.Enum):
    """Where one checkpointed call is: made, in its forward, between forward and backward, in
    the replay, or done (the replay ran)."""

    IDLE = "idle"
    FORWARD = "forward"
    FORWARD_DONE = "forward-done"
    REPLAY = "replay"
    DONE = "done"


class Fate(enum.Enum):
    """What becomes of a held output (``ledger.Ledger`` keeps one record per fate)."""

    PENDING = "pending"  # made in the open segment, not yet proven read or unread
    UNDECIDED = "undecided"  # still referenced when its segment closed: may yet be read
    WAITING = "waiting"  # unread, alive while a cheap op that read it has an unsettled output
    HELD = "held"  # the replay is served it
    RELEASED = "released"  # dropped (a placeholder stands in), rerun instead, or served


class PhasedRegion(Protocol):
    """What ``PhaseContext`` drives: a region's forward, its replay, and their end."""

    def begin_forward(self) -> None: ...

    def begin_replay(self) -> None: ...

    def end_phase(self, failed: bool) -> None: ...


class PhaseContext:
    """A context manager that starts the region's forward or replay (``context_fn``'s pair)."""

    def __init__(self, region: PhasedRegion, replay: bool) -> None:
        self.region, self.replay = region, replay

    def __enter__(self) -> None:
        if self.replay:
            self.region.begin_replay()
        else:
            self.region.begin_forward()

    def __exit__(self, *exc: Any) -> None:
        self.region.end_phase(failed=exc[0] is not None)


def is_dense_tensor(tensor: object) -> bool:
    """A plain tensor whose storage the engine can key on: ``torch.Tensor`` itself, or a fake
    one (``FakeTensorMode``), whose meta storage stands for the real one byte for byte. Other
    subclasses (DTensor, ...) are handled as opaque."""
    return type(tensor) is torch.Tensor or type(tensor) is FakeTensor


# Where a kept op's output was made: (segment, place among the segment's watched ops, output).
Site = tuple[int, int, int]


@dataclass(eq=False)
class HeldOutput:
    """One tensor output of a kept op: held until proven unread, or dropped.

    ``interval`` is the kept interval the op ran in, ``None`` outside every kept interval (then
    the op is a routing one and held only for that). ``routing``: the op routes or copies to the
    host, so its output is held whatever reads it (a collective's floating-point outputs are held
    only while read; never rerun either way)."""

    value: Any  # the detached alias; an offload handle; None once dropped or served
    interval: MarkerInterval | None
    storage: int  # the storage's key
    nbytes: int
    version: int
    meta: tuple  # (size, stride, dtype, device) for the placeholder
    producer: Any  # the op
    routing: bool
    mutated_by: Any = None  # an in-place op seen writing into it
    rewritten_by: Any = None  # a routing output's in-place op: the replay is served a copy
    # Aliases that do not share its version counter (``_unsafe_view`` outputs), each with its
    # version when made: a write through one, unwatched, still shows when the replay serves it.
    aliases: list | None = None
    offloaded: bool = False
    # For an output that is a wrapper subclass around one plain tensor (a DTensor around its
    # local shard): how to rebuild it around a placeholder. ``storage``, ``meta`` and ``version``
    # are then the inner tensor's: that is what holding it costs and what writes change.
    wrapped: Wrapped | None = None
    fate: Fate = Fate.PENDING
    # Where the op ran: (segment, its place among the segment's watched ops, output index). The
    # same site names the same output on every call that follows the path learnt.
    site: Site | None = None


@dataclass(frozen=True)
class Wrapped:
    """A traceable wrapper subclass with one inner tensor, as ``__tensor_flatten__`` describes it
    (``others``: the inner entries that are not tensors, such as a DTensor's device mesh)."""

    kind: type
    name: str
    others: tuple[tuple[str, Any], ...]
    context: Any
    size: torch.Size
    stride: tuple[int, ...]
    placements: tuple | None = None  # a DTensor's (with its device mesh in ``others``)

    def rebuild(self, inner: torch.Tensor) -> torch.Tensor:
        inners = {**dict(self.others), self.name: inner}
        try:
            return self.kind.__tensor_unflatten__(inners, self.context, self.size, self.stride)
        except ValueError:
            # torch 2.13's DTensor unflatten refuses a strided shard with an explicit shard
            # order (torchtitan's router scores under expert parallelism): a placeholder only
            # needs the same mesh, placements and shape, which ``from_local`` gives.
            if self.placements is None:
                raise
            from torch.distributed.tensor import DTensor

            mesh = dict(self.others)["device_mesh"]
            return DTensor.from_local(
                inner, mesh, self.placements, run_check=False, shape=self.size, stride=self.stride
            )

    def rebuilds(self, meta: tuple) -> bool:
        """Whether ``rebuild`` works around a stand-in for the inner tensor (``meta``: its size,
        stride, dtype): a subclass's ``__tensor_unflatten__`` may not take back what its flatten
        gave, and the engine then holds the output rather than drop it."""
        size, stride, dtype, _ = meta
        try:
            self.rebuild(torch.empty_strided(size, stride, dtype=dtype, device="meta"))
        except Exception:  # any refusal: the engine holds the output rather than drop it
            return False
        return True


def single_inner(tensor: torch.Tensor) -> tuple[Wrapped, torch.Tensor] | None:
    """For a traceable wrapper subclass around exactly one plain tensor (a DTensor, an async
    collective's result): how to rebuild it, and that tensor. ``None`` for anything else (several
    inner tensors, nested wrappers): the engine then holds it as it is, whatever reads it."""
    if not is_traceable_wrapper_subclass(tensor):
        return None
    names, context = tensor.__tensor_flatten__()
    values = {name: getattr(tensor, name) for name in names}
    tensors = [name for name, value in values.items() if isinstance(value, torch.Tensor)]
    if len(tensors) != 1 or not is_dense_tensor(values[tensors[0]]):
        return None
    (name,) = tensors
    others = tuple((n, v) for n, v in values.items() if n != name)
    placements = getattr(tensor, "placements", None) if "device_mesh" in values else None
    wrapped = Wrapped(type(tensor), name, others, context, tensor.size(), tensor.stride(), placements)
    return wrapped, values[name]


def wrapper_alias(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Wrapped] | None:
    """A detached alias of a wrapper subclass output around one plain tensor, that tensor inside
    the alias, and how to rebuild it: the engine then holds and drops it by that tensor's storage,
    as a plain output. Only when the alias's inner tensor is a new tensor on the same storage
    (one more use of it), which the engine's "nothing else references it" rule relies on."""
    found = single_inner(tensor)
    if found is None or found[1].device.type == "meta":
        return None
    key = storage_key_of(found[1].untyped_storage())
    before = storage_use_count(key)
    alias = detach_alias(tensor)
    again = single_inner(alias)
    if again is None or storage_key_of(again[1].untyped_storage()) != key:
        return None
    if storage_use_count(key) != before + 1:
        return None
    return alias, again[1], again[0]


@dataclass(eq=False)
class Entry:
    """One op of a watched segment, in forward order: run again, or served."""

    func: Any
    leaves: list | None = None  # kept ops: HeldOutput or plain (non-tensor) values
    spec: Any = None


def make_placeholder(meta: tuple, observer: Any = None, wrapped: Wrapped | None = None) -> torch.Tensor:
    """A stand-in for a dropped output, NaN-filled: a read the engine cannot see (a kernel
    reading raw memory) shows up as NaN, never as a silently wrong gradient. Only floating-point
    outputs are ever dropped. ``observer`` (``actplan verify``'s) is told before it is filled,
    so the fill, like every later op on it, is known to act on a placeholder. ``wrapped``: the
    output was a wrapper subclass, rebuilt around the placeholder (``meta`` is its inner's)."""
    size, stride, dtype, device = meta
    out = torch.empty_strided(size, stride, dtype=dtype, device=device)
    if observer is not None:
        observer.placeholder_made(out)
    out.fill_(float("nan"))
    return out if wrapped is None else wrapped.rebuild(out)


def inner_tensors(tensor: torch.Tensor):
    """The plain tensors inside a traceable wrapper subclass (a DTensor's local shard), found
    through its ``__tensor_flatten__``, recursively: what autograd really keeps when it saves
    the subclass."""
    if is_dense_tensor(tensor):
        yield tensor
    elif is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            yield from inner_tensors(getattr(tensor, name))


def leaf_tensors(tensor: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The plain tensors an op reads through one tensor argument, as far as the engine sees:
    the tensor itself; none for a parameter (not an activation); the one plain tensor inside a
    traceable wrapper subclass around exactly one (a DTensor around its shard: the wrappers the
    engine can also hold and drop by that tensor). ``None`` for any other subclass (several
    inner tensors, nested wrappers, not traceable): unseen, it may read anything held. The
    engine's one answer to "which storages does this op read?"."""
    if is_dense_tensor(tensor):
        return (tensor,)
    if isinstance(tensor, nn.Parameter):
        return ()
    found = single_inner(tensor)
    return None if found is None else (found[1],)


def storages_read(args: tuple, kwargs: dict) -> list[int] | None:
    """The storages of an op's tensor arguments other than parameters (and their views), through
    ``leaf_tensors``; ``None`` if one is a subclass the engine cannot look into."""
    keys = []
    for leaf in tensor_args(args, kwargs):
        found = leaf_tensors(leaf)
        if found is None:
            return None
        keys.extend(storage_key_of(inner.untyped_storage()) for inner in found if not is_parameter(inner))
    return keys


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
    base = tensor_base(tensor)
    if base is None:
        base = tensor
    return base.is_leaf and base.requires_grad


class SegmentMode(TorchDispatchMode):
    """The dispatch mode of one watched segment: hands each op to the region's forward or
    replay handler (``run_op``)."""

    def __init__(self, run_op: Any) -> None:
        super().__init__()
        self.run_op = run_op


def _segment_dispatch(self: SegmentMode, func, types, args=(), kwargs=None):
    if kwargs is None:
        kwargs = {}
    if id(func) in IGNORED_OP_IDS:
        if func is DEVICE_QUERY:  # answered here: no mode below has anything to do with it
            return args[0].device
        return func(*args, **kwargs)
    return self.run_op(func, args, kwargs)


# Set after the class is made: TorchDispatchMode wraps a subclass's own __torch_dispatch__ to
# keep dynamo out of it, which costs about a microsecond per op. Dynamo never traces while this
# mode is active (it refuses frames under a non-infra dispatch mode), and the segment handler
# compiles nothing, so the per-op hot path goes without the wrapper.
SegmentMode.__torch_dispatch__ = _segment_dispatch

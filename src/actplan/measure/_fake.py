"""Runs on fake tensors: a model of any size built, planned and stepped without allocating its
memory, so the memory meter measures a real-scale step on a laptop.

Bytes do not depend on values: under ``torch._subclasses.FakeTensorMode`` every op produces a
tensor with the real shape, dtype, strides and storage sharing, but no data, and
``MemoryMeter`` counts those storages exactly as it counts real ones (``tests/test_fake.py``
proves fake and real agree to the byte). Fake tensors live on the CPU device: the CPU
flash-attention op saves what the GPU one saves (the output and the log-sum-exp).

What values decide cannot be faked. Two such decisions have stated assumptions. Hugging Face
``transformers`` tells a batch that packs several sequences per row from the position ids'
values, and takes fake ones for packed, building a mask a real unpacked batch never holds; a
``FakeRun`` assumes one sequence per row, as an ordinary training batch has
(``FakeRun(packed=True)`` keeps transformers' own path; the assumption applies when
``transformers`` was imported before the run, as building a model from it does). And how many
tokens each expert receives (``torch.bincount`` of the router's choices, read with ``.tolist()``).
``FakeRun(routing="balanced")`` gives every expert an equal share, as capacity planning does;
``routing=`` a list of count lists replays recorded counts (one list per ``bincount`` call and
per exchange of counts, in order: what ``RoutingRecorder`` records on a real run). Any other op
whose output size depends on values stops the run with an error naming it.

Counts travel. Under expert parallelism a rank learns how many tokens it receives from an
all-to-all of the counts (``_c10d_functional.all_to_all_single`` on an integer tensor), then
reads split sizes and offsets from them. So values the run knows (an assumed or replayed count,
and what follows from known values only: views, sums, cumulative sums of integers) travel with
their fake tensors (torch's ``FakeTensor.constant``, which torch itself keeps for one-element
tensors only). An exchange of known counts on a fake process group assumes every rank routes as
this one (each rank sends this rank what this rank sends itself), unless recorded counts replay
what it received.

Fake tensors run the CPU's kernels. Where those save what a GPU run saves, the bytes are the
GPU's: the CPU flash-attention op saves the output and the log-sum-exp, as the GPU one does.
One difference remains: ``F.dropout`` with ``p > 0`` saves a mask of the input's dtype on the
CPU, where CUDA's fused kernel saves a 1-byte one (the reference models train without dropout,
as Llama- and Qwen-style pretraining does).
Imports torch and ``_torch_internals``.
"""

from __future__ import annotations

import copy
import importlib
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.distributed import ProcessGroup

from actplan._torch_internals import (
    DEVICE_QUERY,
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    OpOverload,
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    op_schema,
    process_group_named,
)
from actplan._torch_internals import disable_current_modes as _disable_current_modes

__all__ = ["FakeRun", "FakeValueError", "RoutingRecorder", "balanced_counts", "copy_module", "is_fake"]


class FakeValueError(RuntimeError):
    """A fake-tensor run reached something that needs real values."""


def is_fake(tensor: object) -> bool:
    return isinstance(tensor, FakeTensor)


def fake_mode_of(tensors: Iterable[torch.Tensor]) -> FakeTensorMode | None:
    """The ``FakeTensorMode`` of the first fake tensor in ``tensors`` (a model built under one),
    looking inside tensor subclasses (FSDP2's and TP's DTensor parameters), or None for real
    tensors."""
    for tensor in tensors:
        if isinstance(tensor, FakeTensor):
            return tensor.fake_mode
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            found = fake_mode_of(getattr(tensor, name) for name in names)
            if found is not None:
                return found
    return None


_Module = TypeVar("_Module", bound=nn.Module)


def copy_module(module: _Module) -> _Module:
    """``copy.deepcopy(module)``, also when its tensors are fake: ``deepcopy`` of a fake tensor
    makes one of a new fake mode, which cannot meet the running one's tensors. Fake parameters,
    buffers and tensor attributes (and DTensors around fake ones, a tensor-parallel layer's)
    are cloned in the running mode first; a real module is deep-copied as it is. A process
    group a module holds (torchtitan's vocabulary-parallel embedding keeps its TP group) is
    shared with the copy: it cannot be copied, and the copy runs on the same ranks."""
    tensors: dict[int, torch.Tensor] = {}
    memo: dict[int, Any] = {}
    for m in module.modules():
        for value in (*m._parameters.values(), *m._buffers.values(), *vars(m).values()):
            if isinstance(value, torch.Tensor):
                tensors.setdefault(id(value), value)
            elif isinstance(value, ProcessGroup):
                memo[id(value)] = value
    if fake_mode_of(tensors.values()) is None:
        return copy.deepcopy(module, memo)
    with torch.no_grad():
        for key, tensor in tensors.items():
            if isinstance(tensor, nn.Parameter):
                copied = nn.Parameter(tensor.detach().clone(), requires_grad=tensor.requires_grad)
                if tensor.grad is not None:
                    copied.grad = tensor.grad.detach().clone()
            else:
                copied = tensor.detach().clone().requires_grad_(tensor.requires_grad)
            memo[key] = copied
    return copy.deepcopy(module, memo)


def balanced_counts(total: int, bins: int) -> list[int]:
    """``total`` items over ``bins`` as evenly as they go: the first ``total % bins`` get one more."""
    share, extra = divmod(total, bins)
    return [share + (index < extra) for index in range(bins)]


_BINCOUNT = torch.ops.aten.bincount.default
try:
    _WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
    _ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default
except (AttributeError, RuntimeError):  # a torch built without distributed
    _WAIT_TENSOR = _ALL_TO_ALL = None

# Values carried with fake tensors are routing bookkeeping (counts, offsets), never activations.
_KNOWN_LIMIT = 1 << 16
_COUNT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)


def _known(value: object) -> bool:
    return isinstance(value, FakeTensor) and value.constant is not None


def _has_counts(tensor: torch.Tensor) -> bool:
    return tensor.dtype in _COUNT_DTYPES and tensor.numel() <= _KNOWN_LIMIT


class _Routing(TorchDispatchMode):
    """Answers ``bincount`` under fake tensors with counts whose values are known, and turns
    torch's data-dependence errors into one that says what to do."""

    # A tensor subclass's op passes through unchanged (what ``StorageTracker`` asks of the
    # modes below it before running a subclass's dispatch itself).
    passes_subclass_ops = True

    def __init__(self, fake_mode: FakeTensorMode, routing: Literal["balanced"] | Sequence[Sequence[int]]):
        super().__init__()
        self.fake_mode = fake_mode
        self.routing = routing
        self.calls = 0
        self.values_known = False  # whether any fake tensor carries values yet

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY:
            return args[0].device
        kwargs = kwargs or {}
        if func is _BINCOUNT and is_fake(args[0]):
            return self._bincount(*args, **kwargs)
        if func is _WAIT_TENSOR and func is not None and is_fake(args[0]):
            # The real kernel hands back the tensor it waited on; the fake one returns a new
            # tensor, which a meter would count as a second copy of every collective's output.
            # An alias, not the tensor itself: autograd would make its own view of an input
            # that needs a gradient returned as an output, an op a recomputation (whose
            # inputs need none) does not run.
            out = args[0].view(args[0].shape)
            if _known(args[0]):
                out.constant = args[0].constant
            return out
        hidden = None
        if func is _ALL_TO_ALL and func is not None and _known(args[0]):
            # torch's fake mode would run the collective for real on the known values (which
            # the process group then waits for in vain); its values are this mode's to give.
            hidden, args[0].constant = args[0].constant, None
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            raise FakeValueError(
                f"{func} needs tensor values to know its result, and a fake-tensor run has none "
                f"({type(err).__name__}). actplan estimates on fake tensors only models whose sizes "
                "follow from shapes (plus MoE token counts from `torch.bincount`, which follow the "
                "routing assumption); measure this model with real tensors at a smaller shape"
            ) from None
        finally:
            if hidden is not None:
                args[0].constant = hidden
        if self.values_known and isinstance(out, torch.Tensor) and _has_counts(out):
            if hidden is not None:
                self._exchange(out, *args)
            else:
                self._carry(func, args, kwargs, out)
        return out

    def _carry(self, func, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        """Gives ``out`` its values when the op read only fake tensors with known values (and
        plain numbers): the op is run on those values."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not tensors or not all(_known(t) for t in tensors) or not is_fake(out):
            return
        if not isinstance(func, OpOverload) or op_schema(func).is_mutable:
            return  # torch itself forgets the values an in-place op writes
        swap = {id(t): t.constant for t in tensors}
        with _disable_current_modes():
            real = func(
                *(swap.get(id(a), a) for a in args), **{k: swap.get(id(v), v) for k, v in kwargs.items()}
            )
        if isinstance(real, torch.Tensor) and real.shape == out.shape:
            out.constant = real

    def _exchange(self, out: torch.Tensor, sent: torch.Tensor, output_splits, input_splits, group) -> None:
        """The counts an all-to-all of known counts delivers to this rank: replayed when the
        routing was recorded, else what every rank sends if it routes as this one does (this
        rank's own share of what it sends, from each rank)."""
        if self.routing != "balanced":
            values = self._recorded(out.numel(), f"an exchange of {out.numel()} counts")
            with _disable_current_modes():
                out.constant = torch.tensor(values, dtype=out.dtype).view(out.shape)
            return
        group = process_group_named(group)
        size, rank = group.size(), group.rank()
        with _disable_current_modes():
            chunks = sent.constant.split(list(input_splits) if input_splits else sent.shape[0] // size)
            if len(chunks) != size:
                return
            mine = chunks[rank]
            if output_splits and any(n != mine.shape[0] for n in output_splits):
                return  # the ranks do not all send as this one; the values stay unknown
            out.constant = torch.cat([mine] * size).view(out.shape)

    def _recorded(self, items: int, what: str) -> list[int]:
        if self.calls >= len(self.routing):
            raise FakeValueError(
                f"the recorded routing has {len(self.routing)} results, and the run asked for "
                f"another ({what}); record the counts of every router call and exchange of one step"
            )
        values = list(self.routing[self.calls])
        self.calls += 1
        if len(values) != items:
            raise FakeValueError(
                f"recorded result #{self.calls - 1} has {len(values)} values; this run's {what} needs {items}"
            )
        return values

    def _bincount(self, ids: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0):
        if weights is not None:
            raise FakeValueError("bincount with weights under fake tensors: its values are unknown")
        if self.routing == "balanced":
            if minlength <= 0:
                raise FakeValueError(
                    "bincount without minlength under fake tensors: the number of bins depends on "
                    "values; pass minlength=<number of experts>"
                )
            counts = balanced_counts(ids.numel(), minlength)
            self.calls += 1
        else:
            if self.calls >= len(self.routing):
                raise FakeValueError(
                    f"the recorded routing has {len(self.routing)} results, and the run asked "
                    "for another (a bincount); record the counts of every router call and exchange "
                    "of one step"
                )
            counts = list(self.routing[self.calls])
            if sum(counts) != ids.numel() or len(counts) < minlength:
                raise FakeValueError(
                    f"recorded counts #{self.calls} ({len(counts)} bins, {sum(counts)} items) do not "
                    f"fit this call ({ids.numel()} items, minlength {minlength})"
                )
            self.calls += 1
        with _disable_current_modes():  # a real tensor, made outside the fake mode
            real = torch.tensor(counts, dtype=torch.int64)
        out = self.fake_mode.from_tensor(real)
        out.constant = real  # so `.tolist()` (split sizes) reads the assumed counts
        self.values_known = True
        return out


class FakeRun:
    """Fake tensors for a measured run: enter it, build the model and batch, apply a plan, step.

    ::

        with FakeRun() as fake:
            bundle = build_model("dense", "small", n_layers=32, dim=4096, ...)
            actplan.apply(bundle.model, "matmuls")
            with MemoryMeter(bundle.model, optimizer) as meter:
                train_step(bundle.model, bundle.batch(0, fake.device), optimizer, context=...)

    Parameters, buffers, activations and optimizer state are all fake: nothing the size of the
    model is allocated. Tensors made outside the block (real ones) cannot enter it; build
    everything inside. ``routing`` is the MoE token-count assumption (see the module doc).
    ``materialize_meta=True`` lets a model built on the ``meta`` device (and parallelized
    there: tensor parallelism cannot be applied inside the fake mode) take fake storage with
    ``model.to_empty(device=FakeRun.device)`` inside the block; real tensors may then reach
    the run's ops, so build nothing real in it.
    """

    device = torch.device("cpu")

    def __init__(
        self,
        routing: Literal["balanced"] | Sequence[Sequence[int]] = "balanced",
        packed: bool = False,
        materialize_meta: bool = False,
    ) -> None:
        if routing != "balanced" and (
            isinstance(routing, str) or not all(isinstance(c, Sequence) for c in routing)
        ):
            raise ValueError(f"routing must be 'balanced' or a list of count lists, got {routing!r}")
        self.routing = routing
        self.packed = packed
        self.materialize_meta = materialize_meta
        self.mode: FakeTensorMode | None = None
        self._routing_mode: _Routing | None = None
        self._restore: Callable[[], None] | None = None

    def __enter__(self) -> FakeRun:
        if self.mode is not None:
            raise RuntimeError("FakeRun is already entered; use one block per run")
        self.mode = FakeTensorMode(allow_non_fake_inputs=self.materialize_meta)
        self.mode.__enter__()
        self._routing_mode = _Routing(self.mode, self.routing)
        self._routing_mode.__enter__()
        self._restore = None if self.packed else _assume_one_sequence_per_row()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.mode is None or self._routing_mode is None:
            raise RuntimeError("FakeRun exited without being entered")
        if self._restore is not None:
            self._restore()
            self._restore = None
        self._routing_mode.__exit__(*exc)
        self.mode.__exit__(*exc)
        self._routing_mode = None

    @property
    def bincount_calls(self) -> int:
        """How many token-count results the routing assumption has answered so far."""
        return 0 if self._routing_mode is None else self._routing_mode.calls


def _one_sequence_per_row(position_ids: torch.Tensor) -> None:
    return None  # what transformers answers for a batch it has checked is not packed


def _assume_one_sequence_per_row() -> Callable[[], None] | None:
    """While the run lasts, transformers' packed-sequence check answers "not packed" (its own
    answer on an unpacked batch, which it cannot reach on fake values); returns the undo.
    Nothing to do when transformers was not imported or has no such check."""
    if "transformers" not in sys.modules:
        return None
    try:
        masking = importlib.import_module("transformers.masking_utils")
    except ImportError:
        return None
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        return None
    masking.find_packed_sequence_indices = _one_sequence_per_row
    return lambda: setattr(masking, "find_packed_sequence_indices", original)


class RoutingRecorder(TorchDispatchMode):
    """Records the token counts of a real run in call order (each ``bincount`` result, and the
    counts each exchange of counts between expert-parallel ranks delivered, read when it is
    waited on), so a fake run can replay them: ``FakeRun(routing=recorder.counts)``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[list[int]] = []
        self._exchanges: set[int] = set()  # ids of count exchanges not yet waited on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _BINCOUNT:
            self.counts.append(out.tolist())
        elif func is _ALL_TO_ALL and func is not None and _has_counts(out):
            self._exchanges.add(id(out))
        elif func is _WAIT_TENSOR and func is not None:
            # Eager collectives hand out an AsyncCollectiveTensor, waited on as itself.
            waited = id(getattr(args[0], "elem", args[0]))
            if waited in self._exchanges:
                self._exchanges.discard(waited)
                self.counts.append(out.flatten().tolist())
        return out

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
``routing=`` a list of count lists replays recorded counts (one list per ``bincount`` call, in
order). Any other op whose output size depends on values stops the run with an error naming it.

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
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from actplan._torch_internals import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    TorchDispatchMode,
)
from actplan._torch_internals import disable_current_modes as _disable_current_modes

__all__ = ["FakeRun", "FakeValueError", "RoutingRecorder", "balanced_counts", "copy_module", "is_fake"]


class FakeValueError(RuntimeError):
    """A fake-tensor run reached something that needs real values."""


def is_fake(tensor: object) -> bool:
    return isinstance(tensor, FakeTensor)


_Module = TypeVar("_Module", bound=nn.Module)


def copy_module(module: _Module) -> _Module:
    """``copy.deepcopy(module)``, also when its tensors are fake: ``deepcopy`` of a fake tensor
    makes one of a new fake mode, which cannot meet the running one's tensors. Fake parameters,
    buffers and tensor attributes are cloned in the running mode first; a real module is
    deep-copied as it is."""
    tensors: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for value in (*m._parameters.values(), *m._buffers.values(), *vars(m).values()):
            if isinstance(value, torch.Tensor):
                tensors.setdefault(id(value), value)
    if not any(is_fake(t) for t in tensors.values()):
        return copy.deepcopy(module)
    memo: dict[int, Any] = {}
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


try:
    _WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
except (AttributeError, RuntimeError):  # a torch built without distributed
    _WAIT_TENSOR = None


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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.bincount.default and is_fake(args[0]):
            return self._bincount(*args, **kwargs)
        if func is _WAIT_TENSOR and func is not None and is_fake(args[0]):
            # The real kernel hands back the tensor it waited on; the fake one returns a new
            # tensor, which a meter would count as a second copy of every collective's output.
            return args[0]
        try:
            return func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            raise FakeValueError(
                f"{func} needs tensor values to know its result, and a fake-tensor run has none "
                f"({type(err).__name__}). actplan estimates on fake tensors only models whose sizes "
                "follow from shapes (plus MoE token counts from `torch.bincount`, which follow the "
                "routing assumption); measure this model with real tensors at a smaller shape"
            ) from None

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
        else:
            if self.calls >= len(self.routing):
                raise FakeValueError(
                    f"the recorded routing has {len(self.routing)} bincount results, and the run asked "
                    "for another; record the counts of every router call of one step"
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
    """Records the token counts (``bincount`` results) of a real run, in call order, so a fake
    run can replay them: ``FakeRun(routing=recorder.counts)``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bincount.default:
            self.counts.append(out.tolist())
        return out

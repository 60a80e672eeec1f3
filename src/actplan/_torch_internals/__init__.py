"""Every private torch API actplan relies on, reached through this one module, each with a probe.

torch makes no promise about its private names (``torch._C._storage_Use_Count``, the frame
``torch.utils.checkpoint`` keeps per call, ``torch.utils._python_dispatch``). A renamed or
changed internal must never show up as a plan that quietly holds more memory, so:

* each internal is looked up here (this package: FSDP2's in ``_fsdp``) and nowhere else
  (``tests/test_torch_internals.py`` scans the package for private torch names used outside it);
* ``probe()`` runs every check once per process, the first time a plan that needs them is
  installed (an ``IntervalPolicy`` or an ``OffloadEngine`` is made). A missing internal or one
  that behaves differently raises ``TorchInternalsError`` naming the torch version, what
  changed, and the way around it (``mode: full`` needs none of them).

Names torch's own tooling imports everywhere (dispatch modes, pytree, fake tensors) are imported
here with a clear error when they are gone. Foundation module: imports torch only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from actplan._torch_internals._errors import TorchInternalsError
from actplan._torch_internals._fsdp import (
    collective_call,
    dtensor_shape_propagation,
    fake_process_group_store,
    fsdp_hooks_step_aside,
    process_group_named,
    waited_collective,
    watch_fsdp_storage_resizes,
)

TESTED_TORCH = "2.13"
SUPPORTED_TORCH = ">= 2.10"
_WORKAROUND = (
    "Use mode 'full' (whole-layer checkpointing needs none of torch's internals), or install a "
    f"torch release actplan is tested with ({TESTED_TORCH})"
)


def _changed(what: str, detail: str) -> TorchInternalsError:
    return TorchInternalsError(
        f"torch {torch.__version__}: {what} {detail}. actplan relies on it to tell what a "
        f"selectively checkpointed layer may drop; without it a plan could hold more memory than it "
        f"says. {_WORKAROUND}, and please report it."
    )


try:
    from torch._ops import OpOverload
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensor,
        FakeTensorMode,
    )
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import (
        TorchDispatchMode,
        _disable_current_modes,
        _get_current_dispatch_mode_stack,
        is_traceable_wrapper_subclass,
        is_traceable_wrapper_subclass_type,
    )
    from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
except ImportError as error:  # pragma: no cover - depends on the installed torch
    raise ImportError(
        f"torch {torch.__version__} lacks {error.name or error}, which actplan imports from torch's "
        f"dispatch, pytree or fake-tensor modules; actplan supports torch {SUPPORTED_TORCH} and is "
        f"tested with {TESTED_TORCH}. Install one of those."
    ) from error

DEVICE_QUERY = torch.ops.prim.device.default
"""``tensor.device`` asked from C++ of a tensor that answers it in Python (a fake tensor does):
torch dispatches it through every mode on the stack, some ten times per op a kernel runs. A mode
that only watches ops answers it at once with ``args[0].device`` (a Python property there, no
dispatch): it allocates nothing and runs no kernel, and each mode it passes through costs
several microseconds."""

__all__ = [
    "DEVICE_QUERY",
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "FakeTensor",
    "FakeTensorMode",
    "OpOverload",
    "StorageWeakRef",
    "TorchDispatchMode",
    "TorchInternalsError",
    "capture_data_dependent_shapes",
    "checkpoint_frame",
    "collective_call",
    "compile_module_under",
    "detach_alias",
    "disable_current_modes",
    "dtensor_shape_propagation",
    "fake_process_group_store",
    "fsdp_hooks_step_aside",
    "in_backward",
    "is_compiled_module",
    "is_traceable_wrapper_subclass",
    "is_traceable_wrapper_subclass_type",
    "layer_compile_flags",
    "local_shard",
    "modes_below",
    "op_name",
    "op_schema",
    "probe",
    "process_group_named",
    "python_storage_refs",
    "saved_count",
    "storage_key",
    "storage_use_count",
    "tensor_base",
    "tensor_version",
    "top_saved_tensors_hooks",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "waited_collective",
    "watch_fsdp_storage_resizes",
]

disable_current_modes = _disable_current_modes


def modes_below() -> list[Any]:
    """The dispatch modes on the stack now, innermost last. Inside a mode's own
    ``__torch_dispatch__`` the mode itself is off the stack: these are the ones below it."""
    return list(_get_current_dispatch_mode_stack())


def _missing(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise _changed(name, "does not exist")

    return refuse


# -- storages and tensors -----------------------------------------------------------------------


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (shared by every view of it)."""
    return tensor.untyped_storage()._cdata


def storage_key_of(storage: Any) -> int:
    """The identity of an untyped storage (what ``storage_key`` gives for its tensors)."""
    return storage._cdata


# How many references a storage has (tensors, views, Python storage objects): the engine drops an
# output nothing but itself references any more. Bound once: it runs for every pending output.
storage_use_count: Callable[[int], int] = getattr(
    torch._C, "_storage_Use_Count", _missing("torch._C._storage_Use_Count")
)


def op_schema(func: Any) -> Any:
    """An op's schema (arguments, returns, alias information), ``None`` for what has none."""
    return getattr(func, "_schema", None)


def op_name(func: Any) -> str:
    """An aten op's name without namespace or overload (``"mm"`` for ``aten.mm.default``)."""
    return getattr(func, "_opname", "")


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` was called on ``module`` (its calls go to a compiled forward)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's version counter (bumped by every in-place write, shared by its views)."""
    return tensor._version


def tensor_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor a view was taken of, ``None`` for a tensor that is not a view."""
    return tensor._base


@functools.cache
def python_storage_refs() -> int:
    """The references a storage gains while its Python object exists (torch keeps that object
    alive with the storage): calibrated on first use rather than assumed. The probe runs with
    the dispatch modes off, so that a memory meter or a fake mode the first call happens under
    sees nothing of it (a run would otherwise differ by whether it came first)."""
    with _disable_current_modes():
        probe_tensor = torch.empty(1, device="cpu")
        return storage_use_count(probe_tensor.untyped_storage()._cdata) - 1


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a DTensor holds on this rank (the same object every call, unlike
    ``to_local()``, which returns a new alias); any other tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    return tensor if local is None else local


def detach_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A detached alias (same storage and version counter) that autograd does not see as a view
    of ``tensor`` when it is handed back, as torch's selective-checkpoint cache makes them."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()


# -- autograd and checkpoint --------------------------------------------------------------------

_graph_task_id: Callable[[], int] = getattr(
    torch._C, "_current_graph_task_id", _missing("torch._C._current_graph_task_id")
)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a checkpoint's replay
    runs inside one)."""
    return _graph_task_id() != -1


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The innermost ``saved_tensors_hooks`` pair in effect (a checkpoint's, inside its forward)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def checkpoint_frame(pack: Any) -> Any:
    """The per-call frame ``torch.utils.checkpoint``'s pack hook closes over, or ``None``. Its
    count of saved tensors tells where the replay will stop (``early_stop``)."""
    for cell in getattr(pack, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if hasattr(value, "weak_holders") and hasattr(value, "early_stop"):
            return value
    return None


def saved_count(frame: Any) -> int | None:
    """Tensors the checkpoint saved so far in this call when the replay stops at the last one
    (``early_stop``); ``None`` when it replays the whole forward."""
    if not frame.early_stop:
        return None
    return len(frame.weak_holders)


# -- compile ------------------------------------------------------------------------------------


def compile_module_under(
    module: torch.nn.Module, options: dict[str, Any], context: Callable[[], Any]
) -> None:
    """``module.compile(**options)``, with every call of the compiled module made inside
    ``context()``: dynamo reads its config while it traces, at the first call and at each
    recompile, so flags set around the call (``capture_data_dependent_shapes``) reach it, and
    they hold for this module's calls only."""
    module.compile(**options)
    compiled = module._compiled_call_impl

    def call(*args: Any, **kwargs: Any) -> Any:
        with context():
            return compiled(*args, **kwargs)

    module._compiled_call_impl = call


def capture_data_dependent_shapes() -> Any:
    """A context in which dynamo traces ``.tolist()`` / ``.item()`` of a tensor and ops with
    data-dependent output shapes into the graph as symbolic sizes, instead of breaking it:
    what a MoE layer's per-expert token splits need to compile with ``fullgraph=True``."""
    import torch._dynamo

    return torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)


def layer_compile_flags() -> Any:
    """What ``parallelize(compile=...)`` compiles each checkpointed layer under: MoE layers'
    data-dependent sizes (as ``capture_data_dependent_shapes``), and layer code that sets and
    resets a global around a call (transformers 5.25 wraps attention so, through ``kernels``).
    dynamo refuses an outside mutation inside a checkpoint unless the backward's recompute may
    skip it; a balanced set and reset, skipped, changes nothing."""
    import torch._dynamo

    return torch._dynamo.config.patch(
        capture_scalar_outputs=True,
        capture_dynamic_output_shape_ops=True,
        skip_fwd_side_effects_in_bwd_under_checkpoint=True,
    )


# -- probes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    name: str  # the internal, as torch spells it
    check: Callable[[], None]  # raises TorchInternalsError when it is missing or changed


def _probe_use_count() -> None:
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        raise _changed("torch._C._storage_Use_Count", "does not exist")
    tensor = torch.empty(4)
    key = storage_key(tensor)
    before = count(key)
    view = tensor.view(2, 2)
    with_view = count(key)
    del view
    if with_view != before + 1 or count(key) != before:
        raise _changed(
            "torch._C._storage_Use_Count",
            f"no longer counts a view as one reference (alone {before}, with a view {with_view})",
        )


def _probe_detach_alias() -> None:
    source = torch.ones(4, requires_grad=True) * 2
    view = source.view(2, 2)
    try:
        alias = detach_alias(view)
    except (AttributeError, RuntimeError) as error:
        what = "torch._C._SetExcludeDispatchKeyGuard(DispatchKey.ADInplaceOrView)"
        raise _changed(what, f"fails ({error})") from error
    before = tensor_version(alias)
    with torch.no_grad():
        source.add_(1)
    if (
        storage_key(alias) != storage_key(source)
        or alias.requires_grad
        or alias._is_view()
        or tensor_version(alias) == before
    ):
        raise _changed(
            "a detached alias made under ADInplaceOrView exclusion",
            "no longer shares storage and version counter without being a view",
        )


def _probe_in_backward() -> None:
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    if task_id is None:
        raise _changed("torch._C._current_graph_task_id", "does not exist")
    seen: list[int] = []
    leaf = torch.ones(1, requires_grad=True)
    out = leaf * 2
    out.register_hook(lambda grad: seen.append(task_id()))
    out.sum().backward()
    if task_id() != -1 or len(seen) != 1 or seen[0] == -1:
        raise _changed(
            "torch._C._current_graph_task_id",
            f"no longer tells a backward (-1 outside it, an id inside; saw {task_id()} and {seen})",
        )


def _probe_checkpoint_frame() -> None:
    from torch.utils.checkpoint import checkpoint

    seen: dict[str, Any] = {}

    class Watch:
        def __enter__(self) -> None:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            frame = checkpoint_frame(top[0]) if top is not None else None
            seen["frame"], seen["first"] = frame, len(frame.weak_holders) if frame is not None else None

        def __exit__(self, *exc: Any) -> None:
            frame = seen["frame"]
            seen["last"] = len(frame.weak_holders) if frame is not None else None

    def contexts() -> tuple[Any, Any]:
        return Watch(), contextlib.nullcontext()

    leaf = torch.ones(3, requires_grad=True)
    try:
        checkpoint(lambda x: (x * x).sin(), leaf, use_reentrant=False, context_fn=contexts, early_stop=True)
    except AttributeError as error:
        raise _changed("torch._C._autograd._top_saved_tensors_default_hooks", f"fails ({error})") from error
    frame = seen.get("frame")
    if frame is None:
        raise _changed(
            "torch.utils.checkpoint's per-call frame",
            "is no longer reachable from its pack hook (a closure cell holding an object with "
            "'weak_holders' and 'early_stop')",
        )
    if frame.early_stop is not True or not seen["last"] > seen["first"]:
        raise _changed(
            "torch.utils.checkpoint's per-call frame",
            "no longer counts the tensors it saves in 'weak_holders' or records 'early_stop'",
        )


def _probe_disable_modes() -> None:
    seen: list[Any] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record(), disable_current_modes():
        torch.ones(1).add(1)
    if seen:
        raise _changed(
            "torch.utils._python_dispatch._disable_current_modes",
            "no longer hides ops from the dispatch modes in effect",
        )


DISABLE_MODES = "torch.utils._python_dispatch._disable_current_modes"
PROBES: tuple[Probe, ...] = (
    Probe("torch._C._storage_Use_Count", _probe_use_count),
    Probe("torch._C._SetExcludeDispatchKeyGuard", _probe_detach_alias),
    Probe("torch._C._current_graph_task_id", _probe_in_backward),
    Probe("torch.utils.checkpoint frame (weak_holders, early_stop)", _probe_checkpoint_frame),
    Probe(DISABLE_MODES, _probe_disable_modes),
)
"""Every probe: what a selectively checkpointed layer needs (an ``IntervalPolicy``)."""

OFFLOAD_PROBES = (DISABLE_MODES,)
"""What offload alone needs (an ``OffloadEngine``): its copies run outside the dispatch modes."""

_passed: set[str] = set()


def probe(names: tuple[str, ...] | None = None) -> None:
    """Run the probes named (default: all) that have not yet passed in this process; cheap
    after the first call. Raises ``TorchInternalsError`` for the first that fails."""
    wanted = [each for each in PROBES if (names is None or each.name in names) and each.name not in _passed]
    if not wanted:
        return
    # Real tensors with autograd on, whatever the caller runs under (a FakeRun, no_grad).
    with disable_current_modes(), torch.enable_grad():
        for each in wanted:
            each.check()
            _passed.add(each.name)

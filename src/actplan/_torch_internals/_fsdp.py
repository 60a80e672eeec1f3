"""The distributed internals the estimate relies on: torch's fake process group, the in-place
storage resizes FSDP2 frees and regrows unsharded parameters with, DTensor's shape propagation,
and the plain tensor behind a functional collective's result; and the one the engine relies on,
FSDP2's forward hooks on a module sharded inside a checkpointed layer. Part of
``actplan._torch_internals``, which re-exports them; imports torch and ``_errors``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from actplan._torch_internals._errors import TorchInternalsError

_FSDP_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param"
_FSDP_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


def waited_collective(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor an eager functional collective's result (``AsyncCollectiveTensor``, what
    tensor parallelism's all-gathers and reduce-scatters hand out) stands for, waited on; any
    other tensor as it is. torch's fake process group hands out plain fake tensors instead."""
    if type(tensor).__name__ != "AsyncCollectiveTensor":
        return tensor
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if not isinstance(tensor, AsyncCollectiveTensor):
        return tensor
    return tensor.trigger_wait()


# The collectives a step runs, by op: (kind, whether the program waits for it at once, which
# tensor's bytes the cost counts: "out", the output, or the argument of that name). c10d's own
# ops are what FSDP2 issues on its streams; the functional ones, tensor parallelism's and
# expert parallelism's, are waited on where their result is used, at once.
_COLLECTIVES = {
    "c10d::_allgather_base_": ("all-gather", False, "output_tensor"),
    "c10d::allgather_into_tensor_coalesced_": ("all-gather", False, "outputs"),
    "c10d::_reduce_scatter_base_": ("reduce-scatter", False, "input_tensor"),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce-scatter", False, "inputs"),
    "c10d::allreduce_": ("all-reduce", False, "tensors"),
    "_c10d_functional::all_gather_into_tensor": ("all-gather", True, "out"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all-gather", True, "out"),
    "_c10d_functional::reduce_scatter_tensor": ("reduce-scatter", True, "input"),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce-scatter", True, "inputs"),
    "_c10d_functional::all_reduce": ("all-reduce", True, "input"),
    "_c10d_functional::all_reduce_coalesced": ("all-reduce", True, "inputs"),
    "_c10d_functional::all_to_all_single": ("all-to-all", True, "input"),
}


def collective_call(
    func: Any, args: tuple, kwargs: dict, out: Any
) -> tuple[str, bool, int, list[int]] | None:
    """For a collective op: its kind, whether the program waits for it at once, the bytes its
    cost counts and the global ranks of its group; ``None`` for any other op."""
    entry = _COLLECTIVES.get(func._schema.name)
    if entry is None:
        return None
    kind, blocking, counted = entry
    named = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
    tensors = out if counted == "out" else named[counted]
    if all(t.numel() == 0 for t in _tensors(tensors)):
        return None
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(tensors))
    if kind == "all-to-all":
        nbytes = max(nbytes, out.numel() * out.element_size())
    group = named.get("process_group", named.get("group_name"))
    if isinstance(group, str):
        group = process_group_named(group)
    elif not isinstance(group, torch.distributed.ProcessGroup):
        group = torch.distributed.ProcessGroup.unbox(group)  # the dispatcher's boxed group
    return kind, blocking, nbytes, torch.distributed.get_process_group_ranks(group)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for item in value for t in _tensors(item)]


def fake_process_group_store() -> Any:
    """A store for torch's ``fake`` process-group backend (``init_process_group("fake")``):
    collectives return at once with outputs of the right shapes, one rank of any world size."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as err:
        raise TorchInternalsError(
            f"torch {torch.__version__} has no fake process group (torch.testing._internal."
            "distributed.fake_pg.FakeStore); install the torch release actplan is tested with"
        ) from err
    return FakeStore()


@contextlib.contextmanager
def watch_fsdp_storage_resizes(on_resize: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """While the block runs, ``on_resize(tensor)`` follows each storage FSDP2 frees or regrows
    in place (``_fsdp_param.alloc_storage`` / ``free_storage``: its all-gather outputs and
    unsharded parameters), which no dispatch mode sees. Restored on exit; nothing is changed
    while FSDP2 has not been imported."""
    import importlib
    import sys

    if _FSDP_PARAM not in sys.modules:
        yield
        return
    modules = [importlib.import_module(name) for name in (_FSDP_PARAM, _FSDP_PARAM_GROUP)]
    names = ("alloc_storage", "free_storage")
    if not all(callable(getattr(modules[0], name, None)) for name in names):
        raise TorchInternalsError(
            f"torch {torch.__version__}: {_FSDP_PARAM} has no alloc_storage / free_storage, so "
            "FSDP2's unsharded parameters cannot be followed; install the torch release actplan "
            "is tested with"
        )
    originals = {(m, name): getattr(m, name) for m in modules for name in names if hasattr(m, name)}

    def watched(original: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        def resize(tensor: torch.Tensor) -> None:
            original(tensor)
            on_resize(tensor)

        return resize

    for (module, name), original in originals.items():
        setattr(module, name, watched(original))
    try:
        yield
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)


class _Counted:
    """Wraps DTensor's shape-propagation lock (a ``nullcontext`` unless a multi-threaded test
    set a real one) and counts how deep inside it the calling thread is (each thread its own
    count: a propagation on another thread is not this one's)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._local = threading.local()

    @property
    def depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def __enter__(self) -> None:
        self.inner.__enter__()
        self._local.depth = self.depth + 1

    def __exit__(self, *exc: Any) -> Any:
        self._local.depth = self.depth - 1
        return self.inner.__exit__(*exc)


@contextlib.contextmanager
def dtensor_shape_propagation() -> Iterator[Callable[[], bool] | None]:
    """While open, a callable that says whether DTensor is propagating shapes now: running an
    op on tensors of the global shape, under the fake mode active (a fake-tensor run's own) or
    a private one, only to learn its output's metadata. Those tensors are no allocation of the
    run. Yields ``None`` where this torch has no such hook (``ShardingPropagator.
    _fake_mode_lock``, the lock DTensor holds around the propagation)."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:
        yield None
        return
    previous = getattr(ShardingPropagator, "_fake_mode_lock", None)
    if previous is None:
        yield None
        return
    counted = _Counted(previous)
    ShardingPropagator._fake_mode_lock = counted
    try:
        yield lambda: counted.depth > 0
    finally:
        if ShardingPropagator._fake_mode_lock is counted:
            ShardingPropagator._fake_mode_lock = previous
        # else a meter opened after this one (on another thread) closes later and restores the
        # lock it found, this wrapper; its own ``inner`` chain still ends at the original lock.


def process_group_named(name: str) -> Any:
    """The process group a functional collective names by ``group_name`` (its rank and size)."""
    from torch.distributed import distributed_c10d

    resolve = getattr(distributed_c10d, "_resolve_process_group", None)
    if resolve is None:
        raise TorchInternalsError(
            f"torch {torch.__version__} cannot resolve a functional collective's group name "
            "(torch.distributed.distributed_c10d._resolve_process_group is gone); install the "
            "torch release actplan is tested with"
        )
    return resolve(name)


_STEPS_ASIDE = "_actplan_steps_aside"


def fsdp_hooks_step_aside(layer: torch.nn.Module, mode_type: type) -> None:
    """Makes the forward hooks of every module ``fully_shard`` sharded *inside* ``layer`` (not the
    layer itself: torchtitan's experts, in their own FSDP group) run with the innermost dispatch
    mode off the stack while it is a ``mode_type``: their unshard, reshard and input casts are
    FSDP's work, not the layer's computation. When a checkpointed layer is recomputed in
    backward, those hooks find FSDP in another state than in forward (the parameters already
    unsharded, say) and run other ops, which the engine must neither record nor match against
    the forward's. Idempotent; nothing happens while FSDP2 has not been imported. Reaches into
    FSDP2's hook handles (``FSDPState._pre_forward_hook_handle``), as torch's own
    ``FSDPMemTracker`` does."""
    import sys

    if "torch.distributed.fsdp" not in sys.modules:
        return
    from torch.distributed.fsdp import FSDPModule

    for module in layer.modules():
        if module is layer or not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        for hooks, handle in (
            (module._forward_pre_hooks, getattr(state, "_pre_forward_hook_handle", None)),
            (module._forward_hooks, getattr(state, "_post_forward_hook_handle", None)),
        ):
            if handle is None:
                raise TorchInternalsError(
                    f"torch {torch.__version__}: FSDP2's state has no forward hook handles, so a "
                    f"module sharded inside a checkpointed layer ({type(module).__name__}) cannot "
                    "be recomputed; shard that module with its layer, or install the torch "
                    "release actplan is tested with"
                )
            for hook_id in (h.id for h in getattr(handle, "handles", (handle,))):
                hook = hooks.get(hook_id)  # a grouped state's handles span several modules
                if hook is not None and not getattr(hook, _STEPS_ASIDE, False):
                    hooks[hook_id] = _stepping_aside(hook, mode_type)


def _stepping_aside(hook: Callable[..., Any], mode_type: type) -> Callable[..., Any]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

    def run(*args: Any, **kwargs: Any) -> Any:
        if isinstance(_get_current_dispatch_mode(), mode_type):
            with _pop_mode_temporarily():
                return hook(*args, **kwargs)
        return hook(*args, **kwargs)

    setattr(run, _STEPS_ASIDE, True)
    return run

"""The layer boundary: non-reentrant ``torch.utils.checkpoint`` around one module.

``apply_gradient_checkpointing`` installs an instance-level ``forward`` on the
module, so parameters, buffers and ``state_dict()`` keys are untouched, module
hooks (FSDP's included) stay outside the replayed region, and
``remove_gradient_checkpointing`` restores the module exactly. Inputs and
outputs may be any PyTree (TypedDicts, lists of micro-batches, kwargs,
non-tensor leaves): the non-reentrant implementation tracks saved tensors, not
argument positions.

Pickling a wrapped model (``torch.save(model)``) saves the plain model: the wrappers'
runtime state (policies, offload engines, streams) belongs to one process, so the loaded
model runs without a plan until ``actplan.apply`` installs one again. ``copy.deepcopy``
keeps the wrapper, bound to the copy.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint

from actplan._torch_internals import in_backward, tree_leaves
from actplan.markers import LAYER_END, checkpoint_record, routing_markers

_STATE_ATTR = "_actplan_checkpoint"


def _dropped() -> None:
    return None


class RuntimeOnly:
    """Mixin for wrapper state: pickling leaves it behind (it unpickles as ``None``), while
    ``copy.deepcopy`` copies it field by field."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_dropped, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        new = object.__new__(type(self))
        memo[id(self)] = new
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            object.__setattr__(new, field.name, copy.deepcopy(getattr(self, field.name), memo))
        return new


def _forward_after_load(module: nn.Module, previous: Callable[..., Any] | None) -> Callable[..., Any]:
    # The instance forward a loaded module gets: what the wrapper had replaced, or the class's.
    return previous if previous is not None else functools.partial(type(module).forward, module)


class InstanceForward:
    """An instance-level ``forward`` that calls ``function(module, ...)``.

    Deepcopy rebinds it to the copied module (the wrapper stays); pickling turns it back
    into the forward it replaced (``previous``), so a saved model loads without actplan.
    """

    __slots__ = ("function", "module", "previous")

    def __init__(
        self, function: Callable[..., Any], module: nn.Module, previous: Callable[..., Any] | None
    ) -> None:
        self.function = function
        self.module = module
        self.previous = previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(self.module, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_forward_after_load, (self.module, self.previous))

    def __deepcopy__(self, memo: dict[int, Any]) -> InstanceForward:
        return InstanceForward(
            self.function, copy.deepcopy(self.module, memo), copy.deepcopy(self.previous, memo)
        )


class MarkerPolicy(Protocol):
    """A selective policy driven by ``checkpoint_record`` markers (``IntervalPolicy``)."""

    # Stable across calls, for torch.compile: the graph's marker ops reach it.
    context_fn: Callable[[], Any]

    def open_region(
        self, layer_name: str | None = None, layer: nn.Module | None = None, observer: Any = None
    ) -> tuple[Callable[[], Any], Callable[[str], None]]:
        """Eager: a per-call ``context_fn`` and the sink its markers go to; ``layer`` is the
        module calling (what a policy learns about a layer is kept per module); ``observer``
        the layer's ``LayerObserver``, if any."""
        ...


class LayerObserver(Protocol):
    """What ``actplan verify`` attaches to a checkpointed layer to watch its runs."""

    def phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Entered around each run of the layer's own forward: ``name`` is "forward" or
        "recompute" (the replay in backward)."""
        ...

    def placeholder_made(self, tensor: torch.Tensor) -> None:
        """The replay made ``tensor`` to stand in for an output nothing reads: its values are
        meaningless by design."""
        ...


@dataclass
class CheckpointState(RuntimeOnly):
    """What ``apply_gradient_checkpointing`` installed on a module (not pickled)."""

    context_fn: Callable[[], Any] | None
    policy: MarkerPolicy | None
    preserve_rng_state: bool
    early_stop: bool
    determinism_check: str
    # An instance-level forward that was there before us (restored on removal).
    previous_forward: Callable[..., Any] | None
    # Free-form owner data (the plan entry ``actplan.apply`` installed).
    owner: Any = None
    # How errors name this module, e.g. "layers.3 (DecoderLayer)".
    name: str | None = None
    # Verification hook (``actplan verify``): watches each run of the layer's own forward and
    # the placeholders its replay serves.
    observer: LayerObserver | None = None
    # A fully recomputed layer's marker check (``marker_check``): run on its first eager
    # call with gradients, then dropped, so later calls cost nothing.
    marker_check: Callable[[str | None], Callable[[str], None]] | None = None
    # ``call_check(module, args, kwargs, name)``, run before each call that is checkpointed: an
    # integration's refusal of settings that would make the replay differ (a KV cache, say).
    call_check: Callable[..., None] | None = None


def _needs_grad(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    if any(p.requires_grad for p in module.parameters()):
        return True
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in tree_leaves((args, kwargs)))


def _run_with_markers(
    sink: Callable[[str], None] | None, forward: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    # The end marker lets the policy check that every interval the forward opened
    # was closed. Compiled, markers are graph ops; eager, they go to the sink.
    if torch.compiler.is_compiling():
        out = forward(*args, **kwargs)
        checkpoint_record(LAYER_END)
        return out
    with routing_markers(sink):
        out = forward(*args, **kwargs)
        checkpoint_record(LAYER_END)
    return out


def _first_call_checked(
    state: CheckpointState, forward: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    # The forward (not the replay, which runs the same markers) checks the layer's markers once.
    # Taken before the forward runs, so the replay (in backward, after it) never sees it.
    check, state.marker_check = state.marker_check, None
    if check is None:
        return forward(*args, **kwargs)
    try:
        return _run_with_markers(check(state.name), forward, *args, **kwargs)
    except BaseException:
        state.marker_check = check  # the first call that completes still checks
        raise


def _call_with_keywords(run: Callable[..., Any], names: tuple[str, ...], *flat: Any) -> Any:
    split = len(flat) - len(names)
    return run(*flat[:split], **dict(zip(names, flat[split:], strict=True)))


def _observed(observer: LayerObserver, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # The replay runs inside the autograd engine, where a graph task is current.
    with observer.phase("recompute" if in_backward() else "forward"):
        return forward(*args, **kwargs)


def inner_forward(module: nn.Module, previous: Callable[..., Any] | None) -> Callable[..., Any]:
    """The forward an instance-level wrapper calls: the instance forward it replaced, if
    any, else the class's (shared by the checkpoint and offload wrappers)."""
    return previous if previous is not None else functools.partial(type(module).forward, module)


def restore_forward(module: nn.Module, previous: Callable[..., Any] | None) -> None:
    """Put back what an instance-level wrapper replaced: ``previous``, or the class forward."""
    if previous is None:
        del module.forward
    else:
        module.forward = previous


def install_forward(module: nn.Module, attr: str, state: Any, function: Callable[..., Any]) -> None:
    """Store a wrapper's ``state`` (which records ``previous_forward``) on ``module`` under
    ``attr`` and make its forward ``function(module, ...)``: the one way the checkpoint and
    offload wrappers install themselves."""
    module.__dict__[attr] = state
    # Not a closure: copy.deepcopy rebinds it to the copy, and pickling drops it.
    module.forward = InstanceForward(function, module, state.previous_forward)


def uninstall_forward(module: nn.Module, attr: str) -> bool:
    """Undo ``install_forward``; returns whether a wrapper was there."""
    state = module.__dict__.pop(attr, None)
    if state is None:
        return False
    restore_forward(module, state.previous_forward)
    return True


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: CheckpointState = getattr(self, _STATE_ATTR)
    inner = inner_forward(self, state.previous_forward)
    # Frozen module with grad-free inputs (or no grad at all): nothing to replay.
    if not torch.is_grad_enabled() or not _needs_grad(self, args, kwargs):
        return inner(*args, **kwargs)
    if state.call_check is not None:
        state.call_check(self, args, kwargs, state.name)
    if state.observer is not None:
        inner = functools.partial(_observed, state.observer, inner)
    options: dict[str, Any] = {
        "use_reentrant": False,
        "preserve_rng_state": state.preserve_rng_state,
        "early_stop": state.early_stop,
        "determinism_check": state.determinism_check,
    }
    if state.policy is not None:
        if torch.compiler.is_compiling():
            context_fn, sink = state.policy.context_fn, None
        else:
            context_fn, sink = state.policy.open_region(state.name, self, state.observer)
        options["context_fn"] = context_fn
        run = functools.partial(_run_with_markers, sink, inner)
    else:
        # context_fn is passed only when set: dynamo rejects torch's default no-op one.
        if state.context_fn is not None:
            options["context_fn"] = state.context_fn
        run = inner
        if state.marker_check is not None and not torch.compiler.is_compiling():
            run = functools.partial(_first_call_checked, state, inner)
    if kwargs:
        # Keyword tensors travel as positional ones: checkpoint then saves them as saved tensors
        # (which offload can move) rather than holding them by reference, and a layer keyword
        # can never collide with one of checkpoint's own options.
        args = (run, tuple(kwargs), *args, *kwargs.values())
        run = _call_with_keywords
    if torch.compiler.is_compiling():
        return checkpoint(run, *args, **options)
    try:
        return checkpoint(run, *args, **options)
    except BaseException as error:
        _close_failed_checkpoints(error)
        raise


# torch < 2.13 does not unwind a checkpoint whose forward raised: its generator stays suspended
# inside the saved-tensor hooks and the context_fn's forward context (our region's dispatch
# mode) until it is garbage collected, so every later op of the thread is recorded for the
# failed layer. Newer torch closes it itself, leaving nothing suspended here.
_CHECKPOINT_CODE = inspect.unwrap(checkpoint).__code__
_GENERATOR_CODE = getattr(
    getattr(torch_checkpoint, "_checkpoint_without_reentrant_generator", None), "__code__", None
)


def _close_failed_checkpoints(error: BaseException) -> None:
    frames = []
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _CHECKPOINT_CODE:
            frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):  # innermost first, as the contexts were entered
        for value in frame.f_locals.values():
            if inspect.isgenerator(value) and value.gi_code is _GENERATOR_CODE and value.gi_frame is not None:
                # The forward's own error is the one to report, not one from unwinding.
                with contextlib.suppress(Exception):
                    value.close()


def _check_wrappable(module: Any, context_fn: Any, policy: Any) -> None:
    """Refuse what ``apply_gradient_checkpointing`` cannot wrap: a non-module, an already wrapped
    module, or arguments that contradict each other."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"apply_gradient_checkpointing expects an nn.Module, got {type(module).__name__}")
    if context_fn is not None and policy is not None:
        raise ValueError("give either context_fn or policy, not both: a policy brings its own context_fn")
    if is_checkpointed(module):
        raise ValueError(
            f"{type(module).__name__} is already checkpointed by actplan; call "
            "actplan.remove(module) before wrapping it again"
        )


def apply_gradient_checkpointing(
    module: nn.Module,
    *,
    context_fn: Callable[[], Any] | None = None,
    policy: MarkerPolicy | None = None,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    determinism_check: str = "default",
    name: str | None = None,
) -> nn.Module:
    """Checkpoint ``module``'s forward with ``torch.utils.checkpoint(use_reentrant=False)``, in
    place; returns ``module`` for chaining.

    ``context_fn``: a selective-checkpoint context factory, as ``torch.utils.checkpoint`` takes
    it; ``policy``: a marker-driven selective policy such as ``actplan.lowlevel.IntervalPolicy``
    (preferred over its bare ``context_fn``: eager markers then reach it without a trip through
    the dispatcher). Neither recomputes everything. ``preserve_rng_state`` restores the RNG
    state before the replay (dropout draws the same); ``early_stop`` stops the replay once
    every tensor backward needs exists; ``determinism_check`` goes to
    ``torch.utils.checkpoint``; ``name`` is how marker errors name the module. A module whose
    parameters are all frozen, called with inputs that need no gradient, runs without
    checkpointing. Raises ``ValueError`` if the module is already wrapped; ``actplan.remove``
    undoes it."""
    _check_wrappable(module, context_fn, policy)
    previous = module.__dict__.get("forward")
    state = CheckpointState(
        context_fn=context_fn,
        policy=policy,
        preserve_rng_state=preserve_rng_state,
        early_stop=early_stop,
        determinism_check=determinism_check,
        previous_forward=previous,
        name=name,
    )
    install_forward(module, _STATE_ATTR, state, _checkpointed_forward)
    return module


def wrap_for_checkpoint(
    module: nn.Module,
    *,
    owner: Any = None,
    marker_check: Callable[[str | None], Callable[[str], None]] | None = None,
    call_check: Callable[..., None] | None = None,
    **options: Any,
) -> nn.Module:
    """``apply_gradient_checkpointing(module, **options)`` with the installer's plumbing on the
    wrapper (``actplan.apply`` wraps each layer with this):

    - ``owner``: opaque data stored with the wrapper (the layer's plan, so ``explain`` and
      ``remove`` can find it);
    - ``marker_check``: without a ``policy``, a factory of marker sinks (such as
      ``policy.MarkerChecker``) that check the layer's markers on its first eager call with
      gradients, so unbalanced markers raise under full recompute too;
    - ``call_check``: run as ``call_check(module, args, kwargs, name)`` before each call that is
      checkpointed; it raises to refuse the call (an integration's check of settings that would
      make the replay differ from the forward, such as a KV cache)."""
    if marker_check is not None and options.get("policy") is not None:
        raise ValueError("give marker_check only without a policy: a policy checks the markers itself")
    apply_gradient_checkpointing(module, **options)
    state = checkpoint_state(module)
    state.owner, state.marker_check, state.call_check = owner, marker_check, call_check
    return module


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``apply_gradient_checkpointing`` wrapped this module."""
    # A loaded copy of a pickled wrapped module holds None here: it is not wrapped.
    return module.__dict__.get(_STATE_ATTR) is not None


def checkpoint_state(module: nn.Module) -> CheckpointState | None:
    """The wrapper state of a checkpointed module, or ``None``."""
    return module.__dict__.get(_STATE_ATTR)


def remove_gradient_checkpointing(module: nn.Module) -> bool:
    """Undo ``apply_gradient_checkpointing``; returns whether the module was wrapped."""
    return uninstall_forward(module, _STATE_ATTR)

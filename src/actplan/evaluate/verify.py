"""``actplan verify``: prove that a plan changes nothing but memory and speed.

The model runs twice from the same weights, without checkpointing and under the plan,
for a few optimizer steps on the same batches and seeds. Each step compares the loss,
every parameter's gradient, the grad census (non-zero / zero / missing) and the routing
decisions (outputs of top-k and sort ops in forward). Optionally the recompute itself is
checked by value: every op the backward replays in a checkpointed layer is compared with
the same op's output in that layer's forward (``torch.utils.checkpoint``'s own check
compares shapes only, and is refused together with a selective policy).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from actplan._engine.boundary import checkpoint_state
from actplan._engine.policy import ROUTING_OPS, UNINITIALIZED_OPS
from actplan._install.apply import apply, find_layers
from actplan._torch_internals import (
    StorageWeakRef,
    TorchDispatchMode,
    in_backward,
    op_name,
    storage_key,
    tree_leaves,
)
from actplan.config import RecomputeConfig
from actplan.measure import StepCapture, capture_step, compare_steps
from actplan.models import ModelBundle, train_step
from actplan.progress import ProgressCallback, ProgressTracker

# Checkpointing itself runs these a different number of times in forward and replay.
_UNMATCHED_OPS = frozenset(
    getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", ()) or {torch.ops.aten.detach.default}
)


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


class _RoutingRecorder(TorchDispatchMode):
    """Outputs of routing ops run in forward (not during backward), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.decisions: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in ROUTING_OPS and not in_backward():
            self.decisions.extend(t.detach().clone() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

    def as_extras(self) -> dict[str, torch.Tensor]:
        return {f"routing[{i}]": t for i, t in enumerate(self.decisions)}


@dataclass
class RecomputeMismatch:
    layer: str
    op: str
    index: int  # position of the op among the layer's forward ops
    detail: str


def _value_difference(original: torch.Tensor, again: torch.Tensor) -> float:
    """Largest absolute difference, where equal values (infinities of the same sign, NaN
    against NaN) count as equal: a mask filled with -inf must not read as a difference."""
    if not original.numel():
        return 0.0
    same = (original == again) | (original.isnan() & again.isnan())
    if bool(same.all()):
        return 0.0
    return float((original - again).abs()[~same].max().nan_to_num(nan=float("inf"), posinf=float("inf")))


class _RecomputeChecker(TorchDispatchMode):
    """Record each checkpointed layer's forward op outputs, then compare its replay.

    The boundary's observer tells which layer runs and whether it is the forward or the
    replay; ops whose held outputs the replay serves never reach this mode, so only replayed
    ops are compared, each with the next forward op of the same kind.
    """

    def __init__(self, atol: float) -> None:
        super().__init__()
        self.atol = atol
        self.current: tuple[str, str] | None = None
        self.forward_ops: dict[str, list[tuple[Any, list[torch.Tensor]]]] = {}
        self.cursor: dict[str, int] = {}
        self.mismatches: list[RecomputeMismatch] = []
        self.compared = 0
        # Storages of the placeholders replays served (told by the layers' observers).
        self.placeholders: dict[int, StorageWeakRef] = {}

    def observer(self, layer: str) -> _LayerWatch:
        return _LayerWatch(self, layer)

    @contextlib.contextmanager
    def running(self, layer: str, phase: str) -> Iterator[None]:
        previous = self.current
        self.current = (layer, phase)
        if phase == "forward":
            self.forward_ops[layer] = []
        else:
            self.cursor[layer] = 0
        try:
            yield
        finally:
            self.current = previous

    def is_placeholder(self, tensor: torch.Tensor) -> bool:
        if type(tensor) is not torch.Tensor:
            return False
        ref = self.placeholders.get(storage_key(tensor))
        return ref is not None and not ref.expired()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.current is None or func in _UNMATCHED_OPS:
            return out
        if op_name(func) in UNINITIALIZED_OPS:
            # Uninitialised memory differs between runs; the ops that fill it are compared.
            return out
        layer, phase = self.current
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if phase == "forward":
            self.forward_ops[layer].append((func, [t.detach().clone() for t in tensors]))
            return out
        if any(self.is_placeholder(t) for t in tensors):
            # The stand-in for an output nothing reads (its fill, views of it, writes into it):
            # its values are meaningless by design, so it is not compared.
            return out
        recorded = self.forward_ops.get(layer, [])
        position = self.cursor.get(layer, 0)
        while position < len(recorded) and recorded[position][0] is not func:
            position += 1
        if position == len(recorded):
            self.mismatches.append(
                RecomputeMismatch(
                    layer, str(func), -1, "the replay ran an op the forward did not run at this point"
                )
            )
            return out
        self.cursor[layer] = position + 1
        outputs = [t.detach().clone() for t in tensors]
        self.compared += 1
        for original, again in zip(recorded[position][1], outputs, strict=False):
            if original.shape != again.shape or original.dtype != again.dtype:
                detail = (
                    f"shape/dtype {tuple(original.shape)} {original.dtype} became "
                    f"{tuple(again.shape)} {again.dtype}"
                )
            elif original.is_floating_point() or original.is_complex():
                diff = _value_difference(original, again)
                if diff <= self.atol:
                    continue
                detail = f"values differ by up to {diff:.3e}"
            elif torch.equal(original, again):
                continue
            else:
                detail = "integer or boolean values differ"
            self.mismatches.append(RecomputeMismatch(layer, str(func), position, detail))
            break
        return out


@dataclass
class StepVerdict:
    step: int
    loss_baseline: float
    loss_plan: float
    loss_identical: bool
    max_abs_grad_diff: float
    worst_param: str | None
    grad_mismatches: list[str]
    census_match: bool
    census_diff: dict[str, list[str]]
    routing_decisions: int
    routing_match: bool
    routing_mismatches: list[str]
    ok: bool


@dataclass
class VerifyReport:
    model: str
    config: dict[str, Any]
    steps: list[StepVerdict]
    atol: float
    recompute_checked: bool
    recompute_ops_compared: int = 0
    recompute_mismatches: list[RecomputeMismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps) and not self.recompute_mismatches

    def problems(self) -> list[str]:
        """One line per failure, naming the parameter, tensor or op."""
        out = []
        for s in self.steps:
            if not s.loss_identical:
                out.append(
                    f"step {s.step}: loss {s.loss_plan!r} under the plan, {s.loss_baseline!r} without it"
                )
            for name in s.grad_mismatches:
                out.append(
                    f"step {s.step}: gradient of {name} differs (largest |diff| {s.max_abs_grad_diff:.3e})"
                )
            for category, names in s.census_diff.items():
                for name in names:
                    out.append(
                        f"step {s.step}: parameter {name} has a {category} gradient under the plan only"
                    )
            for name in s.routing_mismatches:
                out.append(f"step {s.step}: routing decision {name} differs (a different expert choice)")
        for m in self.recompute_mismatches:
            out.append(f"recompute of {m.layer}: op {m.op} (forward op #{m.index}): {m.detail}")
        return out

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["problems"] = self.problems()
        return data


def verify(
    bundle: ModelBundle,
    config: RecomputeConfig | dict | str,
    *,
    steps: int = 3,
    device: torch.device | None = None,
    atol: float = 0.0,
    check_recompute: bool = False,
    lr: float = 1e-3,
    progress: ProgressCallback | None = None,
) -> VerifyReport:
    """Run ``bundle``'s model without checkpointing and under ``config`` side by side.

    ``atol`` 0 demands bit-identical losses and gradients (fp32 eager on CPU); give a
    tolerance for compiled or low-precision runs. ``check_recompute`` also compares every
    replayed op with its forward value (it keeps a copy of each checkpointed layer's op
    outputs for the step, so it needs that much extra memory).
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    device = device or torch.device("cpu")
    tracker = ProgressTracker(progress, total=steps, prefix="verify: ")
    parsed = RecomputeConfig.parse(config)
    baseline = copy.deepcopy(bundle.model).to(device)
    candidate = copy.deepcopy(bundle.model).to(device)
    apply(candidate, parsed)
    checker = _watch_recompute(candidate, atol) if check_recompute else None
    optimizers = {
        id(model): torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
        for model in (baseline, candidate)
    }
    verdicts = []
    for step in range(steps):
        batch = bundle.batch(step, device)
        captures = []
        for model in (baseline, candidate):
            routes = _RoutingRecorder()
            watching = checker if (checker is not None and model is candidate) else contextlib.nullcontext()
            loss = train_step(model, batch, seed=1000 + step, context=_both(watching, routes))
            captures.append(capture_step(model, loss, routes.as_extras()))
            optimizer = optimizers[id(model)]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        verdicts.append(_step_verdict(step, captures[0], captures[1], atol))
        tracker.step(f"step {step + 1}/{steps}")
    return VerifyReport(
        model=bundle.description,
        config=parsed.to_dict(),
        steps=verdicts,
        atol=atol,
        recompute_checked=check_recompute,
        recompute_ops_compared=checker.compared if checker else 0,
        recompute_mismatches=checker.mismatches if checker else [],
    )


class _LayerWatch:
    """One checkpointed layer's observer (``boundary.LayerObserver``): its runs and the
    placeholders its replay serves go to the checker."""

    def __init__(self, checker: _RecomputeChecker, layer: str) -> None:
        self.checker, self.layer = checker, layer

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.checker.running(self.layer, name)

    def placeholder_made(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.checker.placeholders[storage_key(tensor)] = StorageWeakRef(storage)


def _watch_recompute(candidate: nn.Module, atol: float) -> _RecomputeChecker:
    """A recompute checker observing every checkpointed layer of ``candidate``."""
    checker = _RecomputeChecker(atol)
    for name, layer in find_layers(candidate):
        state = checkpoint_state(layer)
        if state is not None:
            state.observer = checker.observer(name or "<root>")
    return checker


def _step_verdict(step: int, baseline: StepCapture, plan: StepCapture, atol: float) -> StepVerdict:
    """One step's comparison: losses, gradients, grad census and routing decisions."""
    report = compare_steps(baseline, plan, grad_atol=atol, loss_atol=atol)
    return StepVerdict(
        step=step,
        loss_baseline=float(baseline.loss),
        loss_plan=float(plan.loss),
        loss_identical=report.loss_identical if atol == 0 else report.loss_abs_diff <= atol,
        max_abs_grad_diff=report.max_abs_grad_diff,
        worst_param=report.worst_param,
        grad_mismatches=report.grad_mismatches,
        census_match=report.census_match,
        census_diff=report.census_diff,
        routing_decisions=len(baseline.extras),
        routing_match=report.extras_match,
        routing_mismatches=report.extras_mismatches,
        ok=report.ok,
    )

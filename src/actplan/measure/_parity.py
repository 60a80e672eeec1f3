"""Gradient parity: capture one step's loss, gradients and chosen extras (``capture_step``), and
compare two captures (``compare_steps``) to prove a plan changes no gradient. Imports only
torch and the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class GradCensus:
    """Every parameter by the state of its gradient: some non-zero, all zero, or ``None``."""

    nonzero: frozenset[str]
    zero: frozenset[str]
    none: frozenset[str]

    def category(self, name: str) -> str:
        for category in ("nonzero", "zero", "none"):
            if name in getattr(self, category):
                return category
        raise KeyError(f"parameter {name!r} is not in this census")


def _grad_category(grad: torch.Tensor | None) -> str:
    if grad is None:
        return "none"
    # NaN != 0, so a NaN gradient counts as non-zero: it is present, just wrong.
    return "nonzero" if bool((grad != 0).any()) else "zero"


def _census_of(grads: Mapping[str, torch.Tensor | None]) -> GradCensus:
    by_category: dict[str, set[str]] = {"nonzero": set(), "zero": set(), "none": set()}
    for name, grad in grads.items():
        by_category[_grad_category(grad)].add(name)
    return GradCensus(**{category: frozenset(names) for category, names in by_category.items()})


def grad_census(model: nn.Module) -> GradCensus:
    """Classify every parameter of ``model`` (frozen ones included: their grad is ``None``)."""
    return _census_of({name: param.grad for name, param in model.named_parameters()})


@dataclass(frozen=True)
class StepCapture:
    """Detached copies of one step's loss, gradients and chosen extras (e.g. router choices)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    census: GradCensus
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def capture_step(
    model: nn.Module, loss: torch.Tensor, extras: Mapping[str, torch.Tensor] | None = None
) -> StepCapture:
    """Copy the loss, every parameter's gradient and ``extras``; call after ``backward()``."""
    grads = {
        name: None if param.grad is None else param.grad.detach().clone()
        for name, param in model.named_parameters()
    }
    return StepCapture(
        loss=loss.detach().clone(),
        grads=grads,
        census=_census_of(grads),
        extras={key: value.detach().clone() for key, value in (extras or {}).items()},
    )


@dataclass(frozen=True)
class ParityReport:
    """How a candidate step differs from a baseline step; ``ok`` when nothing does."""

    loss_identical: bool
    loss_abs_diff: float
    max_abs_grad_diff: float
    worst_param: str | None
    grad_mismatches: list[str]
    census_match: bool
    census_diff: dict[str, list[str]]
    extras_match: bool
    extras_mismatches: list[str]
    grad_atol: float
    loss_atol: float
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict; non-finite floats become the strings "inf"/"nan"."""
        return {key: _json_safe(value) for key, value in asdict(self).items()}


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise |a - b| in float64; equal values (inf included) and NaN-vs-NaN count
    as 0, NaN against a number as inf."""
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    a64 = a.detach().to(torch.float64)
    b64 = b.detach().to(device=a.device, dtype=torch.float64)
    diff = (a64 - b64).abs()
    diff = torch.where(a64 == b64, torch.zeros_like(diff), diff)
    diff = torch.where(a64.isnan() & b64.isnan(), torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=math.inf)
    return float(diff.max().item())


def _tensors_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.to(a.device))


def compare_steps(
    baseline: StepCapture,
    candidate: StepCapture,
    *,
    grad_atol: float = 0.0,
    loss_atol: float = 0.0,
) -> ParityReport:
    """Compare two captures of the same model's step (e.g. no checkpointing vs a plan).

    With the default tolerances of 0 the loss must be identical and every gradient equal
    elementwise; pass tolerances for compiled or low-precision runs.
    """
    names = _same_parameters(baseline, candidate)
    loss_identical = _tensors_identical(baseline.loss, candidate.loss)
    loss_abs_diff = _max_abs_diff(baseline.loss, candidate.loss)
    max_abs_grad_diff, worst_param, grad_mismatches = _grad_differences(baseline, candidate, names, grad_atol)
    census_diff = _census_changes(baseline, candidate, names)
    extras_mismatches = _extras_mismatches(baseline, candidate)

    loss_ok = loss_identical or loss_abs_diff <= loss_atol
    ok = loss_ok and not grad_mismatches and not census_diff and not extras_mismatches
    return ParityReport(
        loss_identical=loss_identical,
        loss_abs_diff=loss_abs_diff,
        max_abs_grad_diff=max_abs_grad_diff,
        worst_param=worst_param,
        grad_mismatches=grad_mismatches,
        census_match=not census_diff,
        census_diff=census_diff,
        extras_match=not extras_mismatches,
        extras_mismatches=extras_mismatches,
        grad_atol=grad_atol,
        loss_atol=loss_atol,
        ok=ok,
    )


def _same_parameters(baseline: StepCapture, candidate: StepCapture) -> list[str]:
    """The parameter names both captures share, sorted; an error when they differ."""
    baseline_names, candidate_names = set(baseline.grads), set(candidate.grads)
    if baseline_names != candidate_names:
        only_baseline = sorted(baseline_names - candidate_names)[:5]
        only_candidate = sorted(candidate_names - baseline_names)[:5]
        raise ValueError(
            "the captures come from models with different parameters "
            f"(only in baseline: {only_baseline}, only in candidate: {only_candidate}); "
            "compare two steps of the same model architecture"
        )
    return sorted(baseline_names)


def _grad_differences(
    baseline: StepCapture, candidate: StepCapture, names: list[str], grad_atol: float
) -> tuple[float, str | None, list[str]]:
    """The largest gradient difference, the parameter it is in, and every parameter whose
    gradient differs by more than ``grad_atol`` (or is ``None`` on one side only)."""
    max_abs_grad_diff = 0.0
    worst_param: str | None = None
    grad_mismatches: list[str] = []
    for name in names:
        base_grad, cand_grad = baseline.grads[name], candidate.grads[name]
        if base_grad is None and cand_grad is None:
            continue
        if base_grad is None or cand_grad is None:
            grad_mismatches.append(name)
            continue
        diff = _max_abs_diff(base_grad, cand_grad)
        if diff > max_abs_grad_diff:
            max_abs_grad_diff, worst_param = diff, name
        if diff > grad_atol:
            grad_mismatches.append(name)
    return max_abs_grad_diff, worst_param, grad_mismatches


def _census_changes(baseline: StepCapture, candidate: StepCapture, names: list[str]) -> dict[str, list[str]]:
    """Parameters whose gradient changed category, by ``"before->after"``."""
    census_diff: dict[str, list[str]] = {}
    for name in names:
        before, after = baseline.census.category(name), candidate.census.category(name)
        if before != after:
            census_diff.setdefault(f"{before}->{after}", []).append(name)
    return census_diff


def _extras_mismatches(baseline: StepCapture, candidate: StepCapture) -> list[str]:
    """Extras missing on one side or not identical, sorted."""
    return sorted(
        key
        for key in set(baseline.extras) | set(candidate.extras)
        if key not in baseline.extras
        or key not in candidate.extras
        or not _tensors_identical(baseline.extras[key], candidate.extras[key])
    )

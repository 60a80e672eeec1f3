"""What the tests share: one parity step and its checks (here), the tiny torchtitan models
(``helpers.titan``). Test modules and the multi-rank workers import from here, never from one
another."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

import actplan
from actplan.measure import StepCapture, capture_step, compare_steps


def step_and_capture(
    model: nn.Module,
    batch: Mapping[str, Any],
    seed: int = 5,
    extras: Callable[[Mapping[str, Any]], dict[str, torch.Tensor]] | None = None,
) -> StepCapture:
    """One parity step: seeded (dropout draws the same masks), in training mode, gradients
    cleared, forward, backward of ``model(**batch)["loss"]``; its capture (loss, every
    gradient, the census of nonzero ones), with ``extras(outputs)`` compared too (a MoE
    model's routing decisions)."""
    torch.manual_seed(seed)
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out["loss"].backward()
    return capture_step(model, out["loss"], extras=extras(out) if extras is not None else None)


def with_plan(model: nn.Module, plan: Any) -> nn.Module:
    """A copy of ``model`` with ``plan`` applied (``None``: left plain)."""
    model = copy.deepcopy(model)
    if plan is not None:
        actplan.apply(model, plan)
    return model


def assert_exact(baseline: StepCapture, candidate: StepCapture, what: object) -> None:
    """Bit for bit: the loss, every gradient and which gradients are nonzero."""
    report = compare_steps(baseline, candidate)
    assert report.loss_identical, what
    assert report.max_abs_grad_diff == 0.0, (what, report.worst_param)
    assert report.census_match, (what, report.census_diff)
    assert report.ok, what

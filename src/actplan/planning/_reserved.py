"""Plans whose budget bounds what the CUDA caching allocator reserves: ``actplan plan`` on a
GPU. The planner predicts the bytes tensors request; a run runs out of memory on the segments
the allocator reserves, which round, split and cache those requests. So the plan is stepped
(twice, the second step the steady one), its allocation trace replayed through the allocator
model under the user's settings (``measure.replay_allocations``), and while the modelled
reserved peak exceeds the budget the plan is made again under a budget lowered by the excess.

Imports torch, ``apply``, the config, the meters, the models' step and the planner.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from actplan._install.apply import apply
from actplan.config import RecomputeConfig
from actplan.measure import (
    AllocatorReport,
    AllocatorSettings,
    MemoryMeter,
    replay_allocations,
    unique_storage_bytes,
)
from actplan.models import ModelBundle, train_step
from actplan.planning._records import ModelProfile
from actplan.planning.choose import config_for
from actplan.planning.planner import BudgetError, Solution, solve
from actplan.sizes import human_bytes

__all__ = ["ReservedFit", "fit_reserved", "modelled_reserved", "resident_events"]

TRIES = 4


def resident_events(model: torch.nn.Module) -> list[tuple[int, int, int, int]]:
    """Allocations of the storages the model holds before a metered window (its parameters and
    buffers), as trace events with ids of their own, on the compute stream."""
    held = unique_storage_bytes([*model.parameters(), *model.buffers()])
    return [(1, -(index + 1), nbytes, 0) for index, nbytes in enumerate(held.values())]


def modelled_reserved(
    bundle: ModelBundle, config: RecomputeConfig, device: torch.device, settings: AllocatorSettings
) -> AllocatorReport:
    """The caching allocator's peaks for two training steps of ``bundle`` under ``config`` (with
    AdamW as the profile steps it), everything the process allocates from the model's
    parameters on, replayed under ``settings``."""
    model = copy.deepcopy(bundle.model).to(device)
    apply(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    batch = bundle.batch(0, device)
    resident = resident_events(model)
    meter = MemoryMeter(model, optimizer, trace_allocations=True)
    with meter:
        for _ in range(2):  # the first allocates AdamW's state; the second is the steady step
            train_step(model, batch, optimizer, seed=0)
    return replay_allocations(resident + meter.allocation_trace(), settings)


@dataclass
class ReservedFit:
    solution: Solution
    report: AllocatorReport  # the written plan's modelled peaks
    notes: list[str]  # how many times it was planned again


def fit_reserved(
    bundle: ModelBundle,
    profile: ModelProfile,
    budget_bytes: float,
    solution: Solution,
    device: torch.device,
    settings: AllocatorSettings,
    host_budget_bytes: float | None = None,
) -> ReservedFit:
    """The fastest plan whose modelled reserved peak is within ``budget_bytes``, starting from
    ``solution`` (the planner's for requested bytes): at most ``TRIES`` plans are stepped. When
    none fits, a ``BudgetError`` says what the last one reserves: no plan is written as fitting
    a budget it does not fit."""
    problem = profile.problem(host_budget_bytes)
    allowed = budget_bytes
    notes: list[str] = []
    for attempt in range(TRIES):
        report = modelled_reserved(bundle, config_for(profile, solution.choices), device, settings)
        reserved = report.peak_reserved_bytes
        if reserved <= budget_bytes:
            if attempt:
                notes.append(
                    f"planned again {attempt} time(s) so that the allocator's modelled reserved peak "
                    f"({human_bytes(reserved)}) fits the budget"
                )
            return ReservedFit(solution, report, notes)
        if attempt == TRIES - 1:
            raise BudgetError(
                f"after {TRIES} plans the modelled reserved peak is still {human_bytes(reserved)}, over "
                f"the budget {human_bytes(budget_bytes)}; allow more memory, or plan with "
                "--budget-of requested and leave room for the allocator's reserve yourself"
            )
        # Lower by the excess, and at least by this plan's reserve beyond what it requests.
        reserve = reserved - report.peak_requested_bytes
        allowed = min(allowed - (reserved - budget_bytes), budget_bytes - reserve)
        try:
            solution = solve(problem, allowed)
        except BudgetError:
            raise BudgetError(
                f"no plan fits {human_bytes(budget_bytes)} once the allocator's reserve is counted: "
                f"the plan that holds least reserves {human_bytes(reserved)} (modelled); lower the "
                "batch or sequence, or allow more memory"
            ) from None
    raise AssertionError("unreachable")

"""The plans ``actplan estimate --plan`` proposes: a shallow stack profiled on fake tensors,
deepened to the shape's depth, and planned under each budget. Imports the planning package,
measure and models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from actplan._install.tensor_parallel import tensor_parallelize
from actplan.config import RecomputeConfig
from actplan.measure import Accelerator, FakeRun
from actplan.models import ModelBundle, build_for_shape
from actplan.models.shape import DTYPES, Shape
from actplan.planning._rank_step import expert_group, fake_world, loss_parallel_plan, splits_sequence
from actplan.planning.choose import config_for, made_for
from actplan.planning.planner import BudgetError, minimum_peak, none_peak, plan_summary, solve
from actplan.planning.profile import ModelProfile, profile_model
from actplan.progress import PlainLines
from actplan.sizes import human_bytes

__all__ = [
    "FrontierPoint",
    "Planner",
    "deepened",
    "default_dtype",
    "plan_within",
    "planner_for",
    "shallow_profile",
]


@dataclass(frozen=True)
class FrontierPoint:
    """One plan of the frontier: the fastest the planner predicts at its peak."""

    peak_bytes: int  # predicted requested bytes of one rank's step
    budget_bytes: int  # the lowest of the budgets it was the fastest plan for
    above_static_bytes: int  # of which, beyond parameters and optimizer state
    share_of_none: float  # above_static_bytes against none's
    ratio: float  # predicted step time against none's
    host_bytes: int  # what its offloaded candidates move to the host tier, summed
    plan: str  # its candidates by layer range
    choices: tuple[int, ...]  # per layer, the index of its candidate in the planner's problem


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


_PROFILE_DEPTH = 4  # layers past the dense prefix in the profiled stack


def deepened(profile: ModelProfile, layers: int, base_seconds: float) -> ModelProfile:
    """A shallow stack's profile carried on to ``layers``: the new layers are copies of the
    stack's last-but-one (a middle layer: its type, gradient bytes and measured backward
    extra), inserted below the last, whose backward runs first, next to the loss head.
    ``base_seconds`` is the deep stack's step time without checkpointing, measured (the
    estimate's ``none`` row: an isolated layer's time is not its share of a model's).
    Parameters and AdamW state grow by the copies' gradient bytes (once and twice); the
    whole-model peaks of ``none`` and ``full`` stay the shallow stack's (the estimate plans
    with its own static memory)."""
    have = len(profile.layer_type_of)
    if layers <= have:
        return profile
    if have < 2:
        raise ValueError(f"a profile of {have} layer cannot be deepened; profile two or more")
    added = layers - have

    def grown(values: list) -> list:
        return values[:-1] + [values[-2]] * added + values[-1:] if values else values

    type_of = grown(list(profile.layer_type_of))
    types = [
        replace(t, layer_indices=[i for i, key in enumerate(type_of) if key == t.key])
        for t in profile.layer_types
    ]
    layer_bytes = profile.layer_grad_bytes[-2] if profile.layer_grad_bytes else 0
    return replace(
        profile,
        # A layer's parameters are its gradients' size, and AdamW keeps two moments of each
        # (and a 4-byte step counter per tensor, left out).
        param_bytes=profile.param_bytes + added * layer_bytes,
        optimizer_bytes=profile.optimizer_bytes + 2 * added * layer_bytes,
        base_seconds=base_seconds,
        layer_type_of=type_of,
        layer_types=types,
        layer_grad_bytes=grown(list(profile.layer_grad_bytes)),
        layer_backward_extra_bytes=grown(list(profile.layer_backward_extra_bytes)),
    )


@dataclass
class Planner:
    """The planner over a deepened fake profile: ``budgets(usable)`` (requested bytes, across the
    feasible range) and ``plan(budget)`` -> (config, predicted peak, predicted ratio)."""

    profile: ModelProfile
    problem: Any
    minimum: int  # the least requested bytes any plan peaks at
    made_for: dict[str, Any]  # the whole model's, without the budget

    def budgets(self, usable: float) -> list[int]:
        """Three budgets of requested bytes spread over the feasible range, up to ``usable``
        where it cuts the range short (the last then at it); one, at the least any plan
        holds, when even that is above ``usable``."""
        low = self.minimum
        high = none_peak(self.problem) or low
        if usable <= low:
            return [low]
        shares = (0.25, 0.5, 0.75)
        if usable < high:
            high, shares = usable, (1 / 3, 2 / 3, 1.0)
        return [int(low + (high - low) * share) for share in shares]

    def frontiers(self, budgets: int = 48) -> tuple[list[FrontierPoint], list[FrontierPoint]]:
        """The fastest plan at each of ``budgets`` budgets spread evenly from the least any plan
        peaks at to ``none``'s peak (a deep model's whole front has thousands of plans), among
        the candidates that keep or recompute, and with offload too; each least peak first,
        every plan faster than those of lower peaks. Both are solved at the same budgets."""
        problem = self.problem
        layers = tuple(tuple(c for c in layer if c.offloaded_bytes == 0) for layer in problem.layers)
        kept = replace(problem, layers=layers)
        low, _ = minimum_peak(problem)
        high = none_peak(problem) or low
        grid = [low + (high - low) * k / max(budgets - 1, 1) for k in range(budgets)]
        return self._front(kept, grid), self._front(problem, grid)

    def _front(self, problem: Any, grid: list[float]) -> list[FrontierPoint]:
        top = (none_peak(problem) or problem.static_bytes) - problem.static_bytes
        solutions: dict[tuple[int, ...], Any] = {}
        for budget in grid:
            try:
                solution = solve(problem, budget)
            except BudgetError:
                continue  # below what these candidates can reach
            solutions.setdefault(solution.choices, solution)  # solved at its lowest budget
        front, fastest = [], float("inf")
        for solution in sorted(solutions.values(), key=lambda s: s.predicted_peak_bytes):
            if solution.predicted_seconds < fastest:  # faster than every plan of a lower peak
                front.append(solution)
                fastest = solution.predicted_seconds
        points = []
        for solution in front:
            above = solution.predicted_peak_bytes - problem.static_bytes
            host = sum(problem.layers[i][c].offloaded_bytes for i, c in enumerate(solution.choices))
            points.append(
                FrontierPoint(
                    peak_bytes=int(solution.predicted_peak_bytes),
                    budget_bytes=int(solution.budget_bytes),
                    above_static_bytes=int(above),
                    share_of_none=above / top if top > 0 else 1.0,
                    ratio=solution.predicted_seconds / problem.base_seconds,
                    host_bytes=int(host),
                    plan=plan_summary(solution.names),
                    choices=self._in_full(problem, solution.choices),
                )
            )
        return points

    def _in_full(self, problem: Any, choices: tuple[int, ...]) -> tuple[int, ...]:
        """``choices`` in ``problem`` (a subset of the planner's candidates) as indices among all
        of each layer's candidates."""
        full = self.problem.layers
        return tuple(
            next(k for k, c in enumerate(full[i]) if c is problem.layers[i][choice])
            for i, choice in enumerate(choices)
        )

    def config_of(self, choices: tuple[int, ...], gpu_budget: int) -> RecomputeConfig:
        """The plan of ``choices`` (indices into each layer's candidates), its ``made_for``
        block naming the GPU memory ``gpu_budget`` it is meant to fit."""
        budget_block = {"budget": human_bytes(gpu_budget), "budget_bytes": gpu_budget, "budget_of": "gpu"}
        return config_for(self.profile, choices, {**self.made_for, **budget_block})

    def plan(self, budget: int, gpu_budget: int) -> tuple[RecomputeConfig, float, float]:
        """The plan for ``budget`` requested bytes, its ``made_for`` block naming the GPU memory
        ``gpu_budget`` it is meant to fit."""
        solution = solve(self.problem, budget)  # BudgetError names the feasible range
        ratio = solution.predicted_seconds / self.problem.base_seconds
        return self.config_of(solution.choices, gpu_budget), solution.predicted_peak_bytes, ratio


def shallow_profile(
    shape: Shape, gpu: str | Accelerator, say: Callable[[str], None] | None = None, tp: int = 1, ep: int = 1
) -> ModelProfile:
    """The profile of a shallow stack of ``shape`` (the dense prefix and a few alike layers)
    on fake tensors with the roofline clock: its whole-model steps are what a profile spends
    most on, and ``planner_for`` deepens it. ``say`` gets a progress line per tenth of the work.

    With ``tp`` above one the stack is split over ``tp`` ranks of torch's fake process group
    as the estimate's rank step splits it (``_tensor_parallel``), and each layer is profiled as
    one rank runs it: its sequence-parallel regions at ``s/tp``, the all-gathers and
    reduce-scatters around its matmuls on the clock, and rerun with them when recomputed.
    With ``ep`` above one (a MoE shape) its experts are split over ``ep`` fake ranks
    (``_expert_parallel``): each layer's all-to-alls run, on the clock, and what a
    checkpointed layer holds of them (a replay never re-communicates) is measured."""
    shallow = replace(shape, layers=min(shape.layers, (shape.first_k_dense or 0) + _PROFILE_DEPTH))
    # A line per tenth of the work, with the count and the time left, as `plan` shows.
    lines = None
    if say is not None:
        lines = PlainLines(lambda line: say(line.replace("profiling: ", "profiling on fake tensors: ", 1)))
    with default_dtype(DTYPES[shape.dtype]):
        if tp == ep == 1:
            with FakeRun() as fake:
                bundle = build_for_shape(shallow)
                return profile_model(bundle, spec=shape.name, device=fake.device, gpu=gpu, progress=lines)
        split = _tensor_parallel(shallow, tp, ep) if tp > 1 else _expert_parallel(shallow, ep)
        with split as bundle:
            return profile_model(bundle, spec=shape.name, device=FakeRun.device, gpu=gpu, progress=lines)


@contextlib.contextmanager
def _tensor_parallel(shape: Shape, tp: int, ep: int = 1) -> Iterator[ModelBundle]:
    """The reference model of ``shape`` split over a tensor-parallel group of ``tp`` fake ranks
    (this process rank 0), with fake storage, as ``_rank_step.step_on_mesh`` splits it
    without FSDP: its own plan with the head loss parallel (the block runs under
    ``loss_parallel()``); torchtitan's model by torchtitan's own tensor parallelism. With
    ``ep`` above one the experts are split over ``ep`` fake ranks too (consecutive ones of
    ``tp`` x ``ep``), and each tensor-parallel rank routes its own sequence shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    if shape.hf_config is not None:
        raise ValueError(f"a tensor-parallel profile runs the reference models; {shape.name} is not one")
    with fake_world(tp * ep):
        mesh = init_device_mesh(FakeRun.device.type, (ep, tp), mesh_dim_names=("dp", "tp"))
        titan_tp = mesh["tp"] if shape.titan is not None else None  # split by torchtitan's own code
        experts = expert_group(mesh, ep) if ep > 1 else None
        with torch.device("meta"):  # tensor parallelism cannot be applied inside a fake mode
            bundle = build_for_shape(shape, experts, titan_tp)
        if titan_tp is None:
            plan = loss_parallel_plan(bundle.model, tp, splits_sequence(shape, ep))
            tensor_parallelize(bundle.model, mesh["tp"], plan)
        with FakeRun(materialize_meta=True) as fake, loss_parallel():
            bundle.model.to_empty(device=fake.device)
            yield bundle


@contextlib.contextmanager
def _expert_parallel(shape: Shape, ep: int) -> Iterator[ModelBundle]:
    """The MoE reference model of ``shape`` with its experts split over ``ep`` fake ranks (this
    process rank 0, every rank routing as this one), with fake storage, as
    ``_rank_step.step_on_mesh`` splits them without FSDP."""
    with fake_world(ep), FakeRun():
        yield build_for_shape(shape, torch.distributed.group.WORLD)


def planner_for(
    profile: ModelProfile,
    shape: Shape,
    gpu: str,
    static: int,
    base_seconds: float,
    host_budget: float | None = None,
) -> Planner:
    """The planner over ``shallow_profile``'s profile deepened to ``shape``'s layers, with the
    estimate's measured ``static`` bytes and ``none``'s ``base_seconds``; its plans offload at
    most ``host_budget`` bytes per GPU (``None``: no limit). The plans' own steps check it."""
    profile = deepened(profile, shape.layers, base_seconds)
    with default_dtype(DTYPES[shape.dtype]), torch.device("meta"):
        whole = build_for_shape(shape)  # the layers and classes the plan will meet
    # The first layer's input as the estimate runs it ((batch, seq, hidden)); the whole model is
    # on the meta device, where running it to its first layer is not worth the risk.
    layer_input = (shape.batch, shape.seq, shape.hidden)
    header = made_for(whole, shape.titan or shape.hf_config or shape.model, gpu, layer_input=layer_input)
    # The measured static terms are the unsharded model's; the planner plans one FSDP rank.
    problem = replace(
        profile.problem(),
        static_bytes=float(static),
        layer_grad_bytes=(),
        other_grad_bytes=0.0,
        optimizer_step_bytes=0.0,
        host_budget_bytes=host_budget,
    )
    low, _ = minimum_peak(problem)  # BudgetError when the host budget is below every plan
    return Planner(profile, problem, int(low), header)


_PLAN_TRIES = 6


def plan_within(
    planner: Planner,
    target: int,
    outside: int,
    step: Callable[[RecomputeConfig], Any],
    say: Callable[[str], None],
    refused: list[str],
    reserve: int = 0,
) -> Any:
    """The planner's plan for ``target`` bytes of GPU memory. The planner predicts requested
    bytes; a GPU reserves more (the allocator's rounding and cached blocks), and the step may
    request a little more than predicted. The first plan is made for ``target`` less
    ``outside`` and ``reserve`` (the caller gives ``none``'s reserve beyond its requested
    bytes), then stepped; while its reserved bytes (plus ``outside``) exceed ``target`` it is
    planned again under a budget lowered by the excess and by the gap between the stepped plan's
    reserved bytes and its prediction, at most ``_PLAN_TRIES`` times. ``step`` steps a config
    and returns its ``EstimateRow``. A stepped plan pinning more host memory than the host budget
    (the offload pool rounds buffers up to its size classes) is planned again under a host budget
    lowered by the excess. Returns the last row stepped (``None`` when none was, or when no plan
    fits under a host budget so lowered, with the reason appended to ``refused``)."""
    usable = target - outside
    row = None
    if usable <= 0:
        refused.append(
            f"no plan fits a budget of {human_bytes(target)}: the CUDA context and NCCL's buffers "
            f"alone take {human_bytes(outside)}, outside the allocator"
        )
        return None
    allowed = usable - reserve
    for _ in range(_PLAN_TRIES):
        if allowed < planner.minimum and (row is not None or usable >= planner.minimum):
            # Below every plan: the plan that holds least is the (last) try.
            allowed = planner.minimum
        try:
            config, predicted_peak, predicted_ratio = planner.plan(allowed, target)
        except BudgetError as err:
            refused.append(str(err))  # the feasible range, said in the notes
            break
        say(f"stepping the plan for {human_bytes(target)}")
        row = step(config)
        row.preset = f"plan @ {human_bytes(target)}"
        row.budget_bytes = target
        row.predicted_peak_bytes = int(predicted_peak)
        row.predicted_ratio = predicted_ratio
        row.plan_yaml = config.to_yaml()
        gap = max(0, row.reserved_peak_bytes - int(predicted_peak))
        excess = row.reserved_peak_bytes + outside - target
        host = planner.problem.host_budget_bytes
        over_host = 0 if host is None or row.moved is None else row.moved.host_bytes - host
        if over_host > 0:  # the pool's size classes hold more than the plan moves
            say(
                f"the plan for {human_bytes(target)} pins {human_bytes(row.moved.host_bytes)} of host "
                f"memory, {human_bytes(over_host)} over the host budget: planning again under less"
            )
            problem = replace(planner.problem, host_budget_bytes=host - over_host)
            try:
                least = int(minimum_peak(problem)[0])
            except BudgetError as err:  # below what any plan offloads
                refused.append(str(err))
                return None
            planner = replace(planner, problem=problem, minimum=least)
            continue
        if excess <= 0 or allowed == planner.minimum:
            break  # fits, or the plan that holds least does not fit either
        say(
            f"the plan for {human_bytes(target)} reserves {human_bytes(row.reserved_peak_bytes)} "
            f"(predicted {human_bytes(int(predicted_peak))} requested), {human_bytes(excess)} over: "
            "planning again under less"
        )
        allowed = min(allowed - excess, usable - gap)
    return row

"""``actplan estimate``: what a real-scale training step needs on one GPU, and which plan to
run, before the hardware exists.

Each preset runs one training step of the reference model at the requested shape, as one rank
builds it (``Shape.per_rank``), on fake tensors (``measure.FakeRun``: nothing the size of the
model is allocated) under the memory meter and a roofline clock for the named accelerator.
Plans come from the profiler and the planner run the same way (``profile_model(gpu=...)`` on
fake tensors), and each plan is then stepped like a preset, so its row is measured too.

What the step allocates is measured. These parts are formulas, stated here, in the output and
in docs/concepts.md:

- **static memory per GPU**: FSDP2 with bf16 compute and fp32 everything else: 16 bytes per
  parameter (fp32 parameter, gradient and AdamW's two moments). A rank's non-expert parameters
  are sharded over ``fsdp`` ranks; its experts (``experts/ep`` of them) over ``fsdp/ep``, as
  torchtitan carves expert parallelism out of the FSDP ranks. On top: the bf16 parameters of
  two gathered units (the one computing and the one prefetched), sized as the largest of the
  decoder layers, the embedding and the output head;
- **gradients**: each parameter's gradient is dropped as soon as it is complete, as FSDP's
  reduce-scatter frees the unsharded gradient, so the measured peak holds activations and the
  backward's transients, not a whole model's gradients;
- **tensor parallelism with sequence parallelism**: the rank's layers have heads, KV heads,
  FFN and vocabulary split ``tp`` ways and run the whole sequence; the sequence-parallel
  regions (norms, residual adds, a checkpointed layer's input) are counted at the whole
  sequence, where a rank holds ``1/tp`` of them: up to ``4 s b h (1 - 1/tp)`` bytes per layer
  too many in bf16 (about 224 MiB for llama3-70b at 8192 tokens over 8 ranks);
- **expert parallelism**: routing is balanced, so a rank receives as many token slots as it
  sends; the all-to-all is a copy.

Times are estimates (``measure.RooflineClock``): forward and backward (plans: as the planner
predicts them, optimizer step included), no communication. Imports install, measure, models
and the planning package.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from actplan._install.apply import apply, find_layers
from actplan.config import RecomputeConfig
from actplan.measure import FakeRun, MemoryMeter, RooflineClock, accelerator
from actplan.models import build_model, loss_of
from actplan.models.shape import DTYPES, Shape
from actplan.planning.choose import config_for
from actplan.planning.planner import BudgetError, minimum_peak, none_peak, solve
from actplan.planning.profile import ModelProfile, profile_model
from actplan.sizes import human_bytes

__all__ = ["EstimateResult", "EstimateRow", "estimate", "preset_step", "stack_step"]


@dataclass
class EstimateRow:
    """One preset's or plan's step at the estimated shape, on one GPU."""

    preset: str
    activation_bytes: int  # alive at the end of forward
    step_peak_bytes: int  # what the step allocates at its peak (activations, transients)
    peak_bytes: int  # step_peak_bytes plus the static memory
    flops: int
    seconds: float  # roofline estimate of forward and backward
    ratio_to_none: float | None = None
    fits: bool | None = None
    # Plans only: the budget asked for, the planner's predictions and the plan itself.
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted_ratio: float | None = None
    plan_yaml: str | None = None


@dataclass
class EstimateResult:
    shape: dict[str, Any]
    description: str
    gpu: str
    gpu_source: str
    fsdp: int
    parameters: int  # on one rank, before FSDP sharding
    static_bytes: int
    gathered_bytes: int
    budget_bytes: int | None
    rows: list[EstimateRow] = field(default_factory=list)
    seconds_taken: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def plans(self) -> list[EstimateRow]:
        return [row for row in self.rows if row.plan_yaml is not None]

    @property
    def recommended(self) -> EstimateRow | None:
        """The fastest preset or plan that fits the budget (the fastest overall without one)."""
        fitting = [row for row in self.rows if row.fits is not False]
        return min(fitting, key=lambda row: row.seconds) if fitting else None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _drop_grads_when_complete(model: nn.Module) -> None:
    # As FSDP's reduce-scatter frees the unsharded gradient once it is complete.
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))


@dataclass(frozen=True)
class _Sizes:
    parameters: int  # on this rank
    expert_parameters: int  # of those, the routed experts'
    largest_unit: int  # parameters of the largest gathered unit


def _sizes(model: nn.Module) -> _Sizes:
    units = [layer for _, layer in find_layers(model)]
    units += [m for m in model.modules() if isinstance(m, nn.Embedding)]
    units += [m for name, m in model.named_modules() if name.endswith(("output", "lm_head"))]
    return _Sizes(
        parameters=sum(p.numel() for p in model.parameters()),
        expert_parameters=sum(p.numel() for n, p in model.named_parameters() if ".experts." in n),
        largest_unit=max(sum(p.numel() for p in unit.parameters()) for unit in units),
    )


def preset_step(
    shape: Shape, preset: str | RecomputeConfig, gpu: str, fake: bool = True
) -> tuple[EstimateRow, _Sizes]:
    """One preset's (or config's) metered, clocked step at ``shape``; with ``fake=False`` the same
    step on real tensors (the tests compare the two). Returns the row and the rank's sizes."""
    run = FakeRun() if fake else contextlib.nullcontext()
    with _default_dtype(DTYPES[shape.dtype]), run:
        bundle = build_model(shape.model, "small", **shape.model_overrides())
        model = bundle.model
        if preset != "none":
            apply(model, preset)
        _drop_grads_when_complete(model)
        sizes = _sizes(model)
        batch = bundle.batch(0, FakeRun.device)
        clock = RooflineClock(gpu)
        meter = MemoryMeter(model)
        with meter, clock:
            loss = loss_of(model(**batch))
            forward_end = meter.mark("forward_end").activation_bytes
            loss.backward()
        report = meter.report()
    row = EstimateRow(
        preset=preset if isinstance(preset, str) else "plan",
        activation_bytes=forward_end,
        step_peak_bytes=report.peak_live_bytes,
        peak_bytes=0,
        flops=clock.flops,
        seconds=clock.seconds,
    )
    return row, sizes


def _extrapolated(values: Sequence[float], depths: Sequence[int], layers: int) -> float | None:
    """``values`` at three consecutive ``depths`` carried on to ``layers``, when they grow by the
    same step each layer (exactly, for integers); ``None`` when they do not."""
    first, second = values[1] - values[0], values[2] - values[1]
    exact = all(isinstance(v, int) for v in values)
    if (first != second) if exact else abs(first - second) > 1e-9 * max(abs(v) for v in values):
        return None
    return values[0] + first * (layers - depths[0])


def stack_step(
    shape: Shape, preset: str | RecomputeConfig, gpu: str, fake: bool = True
) -> tuple[EstimateRow, _Sizes]:
    """``preset_step`` of a deep stack from three shallow ones: a shape's layers past its dense
    prefix are alike, so every figure (bytes at the end of forward and at the peak, FLOPs,
    seconds, parameters) grows by the same step per layer. Measured at three depths; when
    the two steps agree, carried on to the full depth; otherwise (or for a shallow stack, or
    a per-layer config) the full stack is stepped."""
    prefix = shape.first_k_dense or 0
    depths = [prefix + 1, prefix + 2, prefix + 3]
    if shape.layers <= depths[-1] + 1 or not isinstance(preset, str):
        return preset_step(shape, preset, gpu, fake)
    shallow = [preset_step(replace(shape, layers=depth), preset, gpu, fake) for depth in depths]
    rows, sizes = [row for row, _ in shallow], [size for _, size in shallow]
    figures = {
        "activation_bytes": [row.activation_bytes for row in rows],
        "step_peak_bytes": [row.step_peak_bytes for row in rows],
        "flops": [row.flops for row in rows],
        "seconds": [row.seconds for row in rows],
        "parameters": [size.parameters for size in sizes],
        "expert_parameters": [size.expert_parameters for size in sizes],
    }
    carried = {name: _extrapolated(values, depths, shape.layers) for name, values in figures.items()}
    if any(value is None for value in carried.values()) or len({s.largest_unit for s in sizes}) > 1:
        return preset_step(shape, preset, gpu, fake)
    row = replace(
        rows[0],
        activation_bytes=int(carried["activation_bytes"]),
        step_peak_bytes=int(carried["step_peak_bytes"]),
        flops=int(carried["flops"]),
        seconds=float(carried["seconds"]),
    )
    size = _Sizes(int(carried["parameters"]), int(carried["expert_parameters"]), sizes[0].largest_unit)
    return row, size


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


def _plans(
    shape: Shape,
    gpu: str,
    static: int,
    budgets: Sequence[int] | None,
    base_seconds: float,
    say: Callable[[str], None],
    refused: list[str],
) -> list[tuple[int, RecomputeConfig, float, float]]:
    """Profile and plan on fake tensors with the roofline clock; per budget (``None``: three
    spread over the feasible range up to the accelerator's memory), the plan, its predicted
    peak and its predicted ratio."""
    # Profiled on a shallow stack (the dense prefix and a few alike layers), then deepened: its
    # whole-model steps are what a profile spends most on. The plans' own steps check it.
    shallow = replace(shape, layers=min(shape.layers, (shape.first_k_dense or 0) + _PROFILE_DEPTH))
    with _default_dtype(DTYPES[shape.dtype]), FakeRun() as fake:
        bundle = build_model(shallow.model, "small", **shallow.model_overrides())
        profile = profile_model(
            bundle,
            spec=shape.name,
            device=fake.device,
            gpu=gpu,
            progress=lambda event: say(f"profiling on fake tensors: {event.stage}"),
        )
    profile = deepened(profile, shape.layers, base_seconds)
    # The measured static terms are the unsharded model's; the planner plans one FSDP rank.
    problem = replace(
        profile.problem(),
        static_bytes=float(static),
        layer_grad_bytes=(),
        other_grad_bytes=0.0,
        optimizer_step_bytes=0.0,
    )
    if budgets is None:
        # Three budgets across the feasible range; where the accelerator's memory (less 5% for
        # the CUDA context and fragmentation) cuts it short, up to that memory, the last at it.
        low, _ = minimum_peak(problem)
        high = none_peak(problem) or low
        usable = 0.95 * accelerator(gpu).memory_bytes
        shares = (0.25, 0.5, 0.75)
        if low < usable < high:
            high, shares = usable, (1 / 3, 2 / 3, 1.0)
        budgets = [int(low + (high - low) * share) for share in shares]
    plans = []
    for budget in budgets:
        try:
            solution = solve(problem, budget)
        except BudgetError as err:
            refused.append(str(err))  # the feasible range, said in the notes
            continue
        config = config_for(profile, solution.choices)
        plans.append(
            (budget, config, solution.predicted_peak_bytes, solution.predicted_seconds / problem.base_seconds)
        )
    return plans


def estimate(
    shape: Shape,
    presets: Sequence[str] = ("none", "full", "attn", "matmuls", "megatron-selective"),
    *,
    gpu: str = "h100",
    fsdp: int = 1,
    tp: int = 1,
    ep: int = 1,
    budget_bytes: int | None = None,
    plans: bool = False,
    progress: Callable[[str], None] | None = None,
) -> EstimateResult:
    """Each preset's memory per GPU and estimated step time at ``shape`` on one rank of the
    layout (FSDP over ``fsdp``, tensor parallel over ``tp``, experts over ``ep``); with
    ``plans``, the planner's plan for ``budget_bytes`` (or three budgets across the feasible
    range), each stepped like a preset. See the module doc."""
    accel = accelerator(gpu)
    if fsdp < 1:
        raise ValueError(f"--fsdp must be 1 or more ranks, got {fsdp}")
    if ep > 1 and fsdp % ep:
        raise ValueError(
            f"--ep {ep} must divide --fsdp {fsdp}: expert parallelism takes its ranks from the FSDP "
            "ones (as torchtitan does); choose --fsdp a multiple of --ep"
        )
    if not presets and not plans:
        raise ValueError("no presets to estimate; name at least one (e.g. none,full)")
    rank_shape = shape.per_rank(tp, ep)
    say = progress or (lambda line: None)
    started = time.perf_counter()
    rows: list[EstimateRow] = []
    sizes = None
    for preset in presets:
        say(f"estimating {preset} on fake tensors")
        row, sizes = stack_step(rank_shape, preset, accel.name)
        rows.append(row)
    if sizes is None:
        _, sizes = stack_step(rank_shape, "full", accel.name)
    dense_params = sizes.parameters - sizes.expert_parameters
    static = 16 * dense_params // fsdp + 16 * sizes.expert_parameters * ep // fsdp
    gathered = 2 * sizes.largest_unit * DTYPES[shape.dtype].itemsize
    refused: list[str] = []
    if plans:
        budgets = None if budget_bytes is None else [budget_bytes]
        none_row = next((r for r in rows if r.preset == "none"), None)
        if none_row is None:
            none_row, _ = stack_step(rank_shape, "none", accel.name)
        for budget, config, predicted_peak, predicted_ratio in _plans(
            rank_shape, accel.name, static + gathered, budgets, none_row.seconds, say, refused
        ):
            say(f"stepping the plan for {human_bytes(budget)} on fake tensors")
            row, _ = preset_step(rank_shape, config, accel.name)
            row.preset = f"plan @ {human_bytes(budget)}"
            row.budget_bytes = budget
            row.predicted_peak_bytes = int(predicted_peak)
            row.predicted_ratio = predicted_ratio
            row.plan_yaml = config.to_yaml()
            rows.append(row)
    none_seconds = next((r.seconds for r in rows if r.preset == "none"), None)
    for row in rows:
        row.peak_bytes = static + gathered + row.step_peak_bytes
        row.ratio_to_none = None if none_seconds is None else row.seconds / none_seconds
        limit = row.budget_bytes if row.budget_bytes is not None else budget_bytes
        row.fits = None if limit is None else row.peak_bytes <= limit
    notes = [
        *(f"no plan: {reason}" for reason in refused),
        f"times are estimates from a roofline clock for {accel.name} (vendor peaks, no kernel "
        "efficiency, no communication); memory is measured on fake tensors",
        "static memory is a formula: 16 bytes per parameter (fp32 parameter, gradient, AdamW "
        f"moments) over {fsdp} FSDP rank(s)"
        + (f" (experts over {fsdp // ep})" if ep > 1 else "")
        + f", plus two gathered units' {shape.dtype} parameters",
    ]
    if tp > 1:
        notes.append(
            f"tensor parallel over {tp}: the sequence-parallel regions (norms, residual adds, a "
            "checkpointed layer's input) are counted at the whole sequence, where a rank holds "
            f"1/{tp} of them: up to {human_bytes(4 * shape.seq * shape.batch * shape.hidden * (1 - 1 / tp))} "
            "per layer too many"
        )
    if ep > 1:
        notes.append(f"experts over {ep} ranks: routing assumed balanced")
    if plans:
        notes.append(
            "plans: profiled and planned on fake tensors with the roofline clock (offload is not "
            "profiled on fake tensors); 'predicted' is the planner's figure, the row the plan's "
            "own fake step"
        )
    return EstimateResult(
        shape=rank_shape.to_dict(),
        description=rank_shape.describe(),
        gpu=accel.name,
        gpu_source=accel.source,
        fsdp=fsdp,
        parameters=sizes.parameters,
        static_bytes=static,
        gathered_bytes=gathered,
        budget_bytes=budget_bytes,
        rows=rows,
        seconds_taken=time.perf_counter() - started,
        notes=notes,
    )

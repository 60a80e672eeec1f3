"""``actplan estimate``: what a real-scale training step needs on one GPU, and which plan to
run, before the hardware exists.

Each preset (or baseline: ``torch-checkpoint``, ``titan-op-sac``, ``titan-layer-sac:N``) runs
one rank's training at the requested shape on fake tensors (``measure.FakeRun``: nothing the
size of the model is allocated) under the memory meter, with an allocation trace, and a roofline clock for the
named accelerator. The trace replays through the caching-allocator model
(``measure.replay_allocations``) under the user's allocator settings: each row gives the
bytes tensors request, the blocks the allocator hands out, and the segments it *reserves*,
which is what a run runs out of. "Fits" is reserved plus the CUDA context and NCCL's buffers
(stated constants, ``_rank_step``) against the budget, or the GPU's memory.

How a rank is run depends on the layout:

- **FSDP, with or without tensor parallelism** (``ep`` 1): measured, through the real code
  path (``_rank_step.rank_step``): the model built on the meta device, ``actplan.parallelize``
  with tensor and sequence parallelism and FSDP2 (bf16 parameters, fp32 reductions) on
  torch's fake process group at the layout's world size, then given fake storage and
  stepped twice with a real AdamW. Nothing is a formula: parameter, gradient and optimizer
  shards, all-gathered layers, reduce-scatter buffers, the sequence-parallel regions at
  ``s/tp`` and the activations are what the code allocates.
- **experts over ``ep`` of the ranks** (``ep`` dividing ``fsdp`` x ``tp``: what
  ``actplan.parallelize`` runs): measured the same way, the MoE reference model's experts
  split over ``ep`` ranks (left out of FSDP when ``ep`` is every rank, else FSDP-sharded over
  the ranks holding the same ones, inside each layer), tokens exchanged by all-to-all on the
  fake group, each tensor-parallel rank routing its own sequence shard; how many each
  expert receives is the routing assumption (balanced, every rank routing as this one).
- **expert parallelism on other code, or with TP on latent attention**: the rank's layers (``Shape.per_rank``)
  are stepped bare, and these parts are formulas, stated in the output and in
  docs/concepts.md: 16 bytes per parameter (fp32 parameter, gradient and AdamW's moments;
  non-expert parameters over ``fsdp`` ranks, the rank's experts over ``fsdp/ep``) plus two
  gathered units' parameters; each gradient dropped when complete, as FSDP's reduce-scatter
  does; the sequence-parallel regions at the whole sequence (up to ``4 s b h (1 - 1/tp)``
  bytes per layer too many); balanced routing. The static part is allocated first in the
  replayed trace, tensor by tensor.

The presets are independent runs of pure-Python fake-tensor dispatch, one core each: with
``workers`` above one they step in that many worker processes at once (``_workers``; the
command line's ``--workers``, by default one per usable core), the planner's profile beside
them, and then each budget's plan tries beside the other budgets'. A preset's step is
``_preset_row.preset_row``.

Times are estimates (``measure.RooflineClock``): forward and backward with the communication
the compute waits for (plans: as the planner predicts them, optimizer step included). Imports
install, measure, models and the planning package.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from actplan._install.baselines import check_name
from actplan.config import RecomputeConfig
from actplan.measure import AllocatorSettings, accelerator
from actplan.models.shape import Shape
from actplan.planning._estimate_plans import FrontierPoint, Planner, plan_within, planner_for, shallow_profile
from actplan.planning._preset_row import EstimateRow, PresetJob, preset_row, preset_step
from actplan.planning._rank_step import CUDA_CONTEXT_BYTES, expert_layout_refusal, nccl_bytes, splits_sequence
from actplan.planning._training import DEFAULT_TRAINING, TrainingSetup
from actplan.planning._workers import Workers
from actplan.planning.planner import preset_peak
from actplan.sizes import human_bytes

__all__ = [
    "FRONTIER_KINDS",
    "FRONTIER_RATIO",
    "EstimateResult",
    "EstimateRow",
    "FrontierPoint",
    "TrainingSetup",
    "estimate",
    "preset_step",
]

FRONTIER_KINDS = ("keep or recompute", "with offload")
FRONTIER_RATIO = 1.03
"""Each frontier's plan holding the least activations at this step-time ratio or less is stepped."""


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
    method: str = ""  # how a rank was run: the real FSDP2 path, or the bare layers and formula
    parameters_scope: str = ""  # what ``parameters`` counts: the whole model, or one rank's layers
    allocator_settings: str = ""
    gpu_memory_bytes: int = 0
    rows: list[EstimateRow] = field(default_factory=list)
    seconds_taken: float = 0.0
    notes: list[str] = field(default_factory=list)
    # With ``frontier``: the planner's frontier by kind (``FRONTIER_KINDS``), least peak first.
    frontiers: dict[str, list[FrontierPoint]] = field(default_factory=dict)

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
    allocator: AllocatorSettings | None = None,
    training: TrainingSetup = DEFAULT_TRAINING,
    progress: Callable[[str], None] | None = None,
    workers: int = 1,
    gpus_per_node: int | None = None,
    frontier: bool = False,
    host_budget_bytes: int | None = None,
) -> EstimateResult:
    """Each preset's memory per GPU (requested, allocated and reserved) and estimated step
    time at ``shape`` on one rank of the layout (FSDP over ``fsdp``, tensor parallel over
    ``tp``, experts over ``ep``) under the caching allocator's ``allocator`` settings
    (torch's defaults when ``None``); with ``plans``, the planner's plan for ``budget_bytes``
    (or three budgets across the feasible range), each stepped like a preset;
    ``training``: optimizer, micro-batches, frozen parameters (``TrainingSetup``). ``workers``
    steps the presets (and tries the budgets) in that many processes at once. ``gpus_per_node``
    replaces the GPU's (8): groups within a node use its GPU link, across nodes the network.
    ``frontier`` adds the planner's frontier, with and without offload.
    ``host_budget_bytes``: the pinned host memory per node (default: the node's), shared by this
    job's GPUs on it; plans keep within it, a row that pins more does not fit. ``gpu``: a name
    in ``ACCELERATORS`` or an ``Accelerator`` (say, with other links). See the module doc."""
    accel = accelerator(gpu)
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be 1 or more, got {gpus_per_node}")
        accel = replace(accel, gpus_per_node=gpus_per_node)
    if host_budget_bytes is not None and not 0 <= host_budget_bytes <= accel.node_host_bytes:
        raise ValueError(
            f"--host-budget {human_bytes(host_budget_bytes)} is outside what a node holds: give 0 up to "
            f"its host memory, {accel.node_host_bytes / 1e12:g} TB ({human_bytes(accel.node_host_bytes)}) "
            f"on a {accel.name} node"
        )
    if fsdp < 1:
        raise ValueError(f"--fsdp must be 1 or more ranks, got {fsdp}")
    node_host = accel.node_host_bytes if host_budget_bytes is None else host_budget_bytes
    on_node = max(min(fsdp * tp, accel.gpus_per_node), 1)
    host_per_gpu = node_host / on_node
    if ep > 1 and (fsdp * tp) % ep:
        raise ValueError(
            f"--ep {ep} must divide the {fsdp * tp} ranks of --fsdp {fsdp}"
            + (f" x --tp {tp}" if tp > 1 else "")
            + ": expert parallelism takes its ranks from them (as torchtitan does); choose --ep a divisor"
        )
    if budget_bytes is not None and budget_bytes > accel.memory_bytes:
        raise ValueError(
            f"a budget of {human_bytes(budget_bytes)} is more than the {accel.name}'s "
            f"{human_bytes(accel.memory_bytes)}; give a budget within it, or another --gpu"
        )
    training.check()
    unmeasured = expert_layout_refusal(shape, fsdp, tp, ep)  # why the real path cannot run it
    measured = unmeasured is None
    if not measured and training != DEFAULT_TRAINING:
        raise ValueError(
            "--optimizer, --optimizer-impl, --grad-accum and --freeze need the measured path, which this "
            f"expert-parallel layout does not run on ({unmeasured}; its static memory is AdamW's "
            "formula); leave them out, or change the layout"
        )
    if workers < 1:
        raise ValueError(f"--workers must be 1 or more processes, got {workers}")
    profiles = plans or frontier  # the planner is built for plans and for the frontier
    if not presets and not profiles:
        raise ValueError("no presets to estimate; name at least one (e.g. none,full)")
    for preset in presets:
        check_name(preset)
    settings = allocator or AllocatorSettings()
    rank_shape = shape.per_rank(tp, ep)
    if not measured:  # the formula path steps the reference layers, whatever code was named
        rank_shape = replace(rank_shape, hf_config=None)
    groups = sum(degree > 1 for degree in (fsdp, tp, ep))
    outside = CUDA_CONTEXT_BYTES + nccl_bytes(groups)
    say = progress or (lambda line: None)
    started = time.perf_counter()
    job = PresetJob(shape, rank_shape, measured, fsdp, tp, ep, accel, settings, training, outside)
    how = f"through parallelize over {fsdp * tp} fake ranks" if measured else "their layers bare"
    # The planner needs `none`'s row (and some row's static bytes), stepped with the presets.
    names = [*presets, *(["none"] if profiles and "none" not in presets else [])]
    # One rank's share is planned (a transformers class gathers its logits whole); measured, the
    # reference model is profiled split over fake TP or EP ranks (a transformers class's, bare).
    profiled = replace(rank_shape, vocab=shape.vocab) if measured and shape.hf_config else rank_shape
    split = measured and tp * ep > 1 and shape.hf_config is None
    whom, degrees = (shape, {"tp": tp, "ep": ep}) if split else (profiled, {})
    refused: list[str] = []
    frontiers: dict[str, list[FrontierPoint]] = {}
    with Workers(min(workers, len(names) + profiles)) as pool:
        where = f"in {pool.count} worker processes" if pool.parallel else "one after another"
        say(f"stepping {', '.join(names)} ({how} on fake tensors) {where}")
        profiling = None
        if profiles and pool.parallel:  # the profile needs no row: it runs beside them
            say("profiling on fake tensors in a worker process, beside them")
            profiling = pool.submit(shallow_profile, whom, accel, **degrees)
        stepped = pool.run(
            [(preset_row, (job, name), {}) for name in names],
            lambda index: say(f"stepped {names[index]} ({time.perf_counter() - started:.0f} s)"),
        )
        rows = [row for row, *_ in stepped[: len(presets)]]
        _, sizes, static, gathered = stepped[-1]
        if profiles:
            none_row = stepped[names.index("none")][0]
            profile = pool.result(profiling) if profiling else shallow_profile(whom, accel, say, **degrees)
            planner = planner_for(
                profile, profiled, accel.name, static + gathered, none_row.seconds, host_per_gpu
            )
            if frontier:
                say("the planner's frontier, with and without offload")
                frontiers = dict(zip(FRONTIER_KINDS, planner.frontiers(), strict=True))
                rows += _frontier_checks(planner, frontiers, pool, job, accel.memory_bytes, say)
        if plans:
            stepped_rows = [row for row, *_ in stepped]
            rows += _plans(planner, pool, job, stepped_rows, budget_bytes, accel.memory_bytes, say, refused)
    none_row = next((r for r in rows if r.preset == "none"), None)
    refused_host: list[str] = []
    peak = accel.fp32_flops if shape.dtype == "fp32" else accel.bf16_flops
    for row in rows:
        row.ratio_to_none = None if none_row is None else row.seconds / none_row.seconds
        row.tokens_per_s = shape.batch * shape.seq / tp / row.seconds
        row.mfu = None if none_row is None else none_row.flops / (row.seconds * peak)
        limit = row.budget_bytes if row.budget_bytes is not None else budget_bytes
        row.fits = row.reserved_peak_bytes + row.outside_allocator_bytes <= (limit or accel.memory_bytes)
        if row.moved is not None and row.moved.host_bytes > host_per_gpu * (1 + 1e-9):
            row.fits = False
            refused_host.append(
                f"{row.preset} pins {human_bytes(row.moved.host_bytes)} of host memory per GPU, "
                f"{human_bytes(row.moved.host_bytes * on_node)} per node of {on_node} GPU(s): more than its "
                f"{human_bytes(node_host)}; raise --host-budget (at most the node's "
                f"{human_bytes(accel.node_host_bytes)}), spread the job over more nodes, or offload less"
            )
    notes = [
        *(f"no plan: {reason}" for reason in refused),
        *(f"does not fit the host: {reason}" for reason in refused_host),
        f"times are estimates from a roofline clock for {accel.name} (vendor peaks, no kernel "
        "efficiency); collectives at ring cost on the GPU's links, "
        + (
            f"{accel.intra_node_bytes_per_s / 1e9:.0f} GB/s inside a node of {accel.gpus_per_node} "
            f"GPUs, {accel.inter_node_bytes_per_s / 1e9:.0f} GB/s per GPU across nodes, FSDP's "
            "beside the compute, TP's and EP's in its path"
            if measured
            else "none on the formula path"
        )
        + "; memory is measured on fake tensors",
        f"reserved: the step's allocations replayed through a model of torch's CUDA caching "
        f"allocator ({settings.describe()}; set --alloc-conf or PYTORCH_ALLOC_CONF), a pool per stream; "
        f"fits: reserved + {human_bytes(outside)} outside the allocator (CUDA context, NCCL "
        f"buffers of {groups} communicator(s)) within "
        + (human_bytes(budget_bytes) if budget_bytes is not None else f"the {accel.name}'s memory"),
    ]
    if measured:
        layout = f"FSDP2 over {fsdp}" + (f" x TP {tp}" if tp > 1 else "")
        layout += " with sequence parallelism" if tp > 1 and splits_sequence(shape, ep) else ""
        held = " (left out of FSDP)" if ep == fsdp * tp else f" (each FSDP-sharded over {fsdp * tp // ep})"
        layout += f", experts over {ep} of them{held}" if ep > 1 else ""
        method = f"{layout} on a fake process group, {training.optimizer}, steady (2nd) step"
        notes.append(
            f"measured through actplan.parallelize: {layout} over {fsdp * tp} fake rank(s), bf16 "
            f"parameters and fp32 reductions, two steps of {training.describe()}; static = what stays "
            "between steps"
        )
    else:
        method = "the rank's layers stepped bare, static memory by formula"
        notes.append(
            "static memory is a formula: 16 bytes per parameter (fp32 parameter, gradient, AdamW "
            f"moments) over {fsdp} FSDP rank(s)"
            + (f" (experts over the {fsdp * tp // ep} holding the same ones)" if ep > 1 else "")
            + f", plus two gathered units' {shape.dtype} parameters (not run through actplan."
            f"parallelize on the fake process group: {unmeasured})"
        )
        if tp > 1:
            too_many = human_bytes(4 * shape.seq * shape.batch * shape.hidden * (1 - 1 / tp))
            notes.append(
                f"tensor parallel over {tp}: the sequence-parallel regions (norms, residual adds, a "
                "checkpointed layer's input) are counted at the whole sequence, where a rank holds "
                f"1/{tp} of them: up to {too_many} per layer too many"
            )
    if ep > 1:
        alike = ", every rank routing as this one (the same tokens sent as received)" * measured
        notes.append(f"experts over {ep} ranks: routing assumed balanced{alike}")
    notes.append(
        f"code measured: {shape.code if measured else rank_shape.code}"
        + ("; plans profiled on one tensor-parallel rank's share of it" if plans and tp > 1 else "")
    )
    if profiles or any(row.moved is not None for row in rows):
        notes.append(
            f"host: offload's pinned buffers share {human_bytes(node_host)} per node "
            + ("(--host-budget)" if host_budget_bytes is not None else f"(a {accel.name} node's host memory)")
            + f" over this job's {on_node} GPU(s) on it, {human_bytes(host_per_gpu)} each; the plans keep "
            f"within it; copies at {accel.host_link_bytes_per_s / 1e9:g} GB/s per direction"
        )
    if plans:
        notes.append(
            "plans: profiled and planned on fake tensors with the roofline clock (offload's copies "
            "at the GPU's host link, hidden behind a layer's compute as far as it lasts); the "
            "planner plans requested bytes, 'predicted' is its figure, "
            "the row the plan's own step, and fits is judged on the row's reserved bytes"
            + (
                "; the profile steps one micro-batch over every parameter, so with --grad-accum or "
                "--freeze the prediction is the planner's and the row is what the setup holds"
                if training != DEFAULT_TRAINING
                else ""
            )
        )
    return EstimateResult(
        shape=(shape if measured else rank_shape).to_dict(),
        description=(
            shape.describe() + (f"; each rank holds 1/{tp} of it under TP" if tp > 1 else "")
            if measured
            else rank_shape.describe()
        ),
        gpu=accel.name,
        gpu_source=accel.source,
        fsdp=fsdp,
        parameters=sizes.parameters,
        static_bytes=static,
        gathered_bytes=gathered,
        budget_bytes=budget_bytes,
        method=method,
        parameters_scope=(
            (f"in this rank's model (1/{ep} of the experts), sharded over {fsdp}" if ep > 1 else "")
            or f"in the model, sharded over {fsdp * tp} ranks"
            if measured
            else f"in this rank's layers (TP {tp}, EP {ep}), before FSDP"
        ),
        allocator_settings=settings.describe(),
        gpu_memory_bytes=accel.memory_bytes,
        rows=rows,
        seconds_taken=time.perf_counter() - started,
        notes=notes,
        frontiers=frontiers,
    )


def _frontier_checks(
    planner: Planner,
    frontiers: dict[str, list[FrontierPoint]],
    pool: Workers,
    job: PresetJob,
    memory_bytes: int,
    say: Callable[[str], None],
) -> list[EstimateRow]:
    """Each frontier's plan holding the least activations at ``FRONTIER_RATIO`` or less, stepped
    like a preset: the check of the planner's predictions the frontier is drawn from."""
    picked: list[tuple[str, FrontierPoint]] = []
    for kind, points in frontiers.items():
        fast = [p for p in points if p.ratio <= FRONTIER_RATIO]
        if not fast:
            continue
        point = min(fast, key=lambda p: p.share_of_none)
        same = [i for i, (_, other) in enumerate(picked) if other.choices == point.choices]
        if same:  # offload bought nothing here: one plan, one step
            picked[same[0]] = ("keep or recompute, and with offload", point)
        else:
            picked.append((kind, point))
    if not picked:
        return []
    say(f"stepping the frontier's plans at {FRONTIER_RATIO}x: {', '.join(kind for kind, _ in picked)}")
    configs = [planner.config_of(point.choices, int(memory_bytes)) for _, point in picked]
    stepped = pool.run([(preset_row, (job, config), {}) for config in configs])
    rows = []
    for (kind, point), (row, *_) in zip(picked, stepped, strict=True):
        row.preset = f"frontier {kind}, {point.share_of_none:.0%} @ {point.ratio:.3f}x"
        row.predicted_peak_bytes = point.peak_bytes
        row.predicted_ratio = point.ratio
        rows.append(row)
    return rows


def _plans(
    planner: Planner,
    pool: Workers,
    job: PresetJob,
    stepped: list[EstimateRow],
    budget_bytes: int | None,
    memory_bytes: int,
    say: Callable[[str], None],
    refused: list[str],
) -> list[EstimateRow]:
    """The plan for each budget (``budget_bytes``, or the planner's three), each stepped until
    it fits (``plan_within``); with worker processes the budgets' tries run side by side.

    The planner predicts requested bytes from a shallow profile without FSDP's transients (its
    gathered layers and reduce-scatter buffers; TP's are profiled), and a GPU reserves more
    than is requested. Each preset stepped (``stepped``, ``none`` among them) measures how far
    its reserved peak lies above the planner's prediction for the same preset; a plan is first
    made with the largest of those gaps held back, so that it fits at the first step where the
    presets around it do."""
    none_row = next(row for row in stepped if row.preset == "none")
    gaps = [
        row.reserved_peak_bytes - int(peak)
        for row in stepped
        if (peak := preset_peak(planner.problem, row.preset)) is not None
    ]
    reserve = max(gaps, default=none_row.reserved_peak_bytes - none_row.peak_bytes)
    # A budget is what the GPU must hold: reserved plus what sits outside the allocator. The
    # default ones are the planner's (requested bytes, within what the GPU leaves) plus both.
    targets = (
        [budget_bytes]
        if budget_bytes is not None
        else [
            int(min(b + reserve + job.outside, memory_bytes))
            for b in planner.budgets(memory_bytes - job.outside - reserve)
        ]
    )

    def step(config: RecomputeConfig) -> EstimateRow:
        return pool.result(pool.submit(preset_row, job, config))[0]

    def within(target: int) -> tuple[EstimateRow | None, list[str]]:
        # Each budget starts from the presets' gap: under TP the planner's figure is off by an
        # amount that changes with the plan, so a gap learnt on another budget misleads.
        reasons: list[str] = []
        return plan_within(planner, target, job.outside, step, say, reasons, reserve), reasons

    if pool.parallel and len(targets) > 1:
        with ThreadPoolExecutor(len(targets)) as threads:  # each waits on its worker's steps
            tried = list(threads.map(within, targets))
    else:
        tried = [within(target) for target in targets]
    for _, reasons in tried:
        refused += reasons
    return [row for row, _ in tried if row is not None]

"""Property tests of the eager engine on generated layers (``engine_layers.py``).

Each example builds a two-layer ``GeneratedStack`` from random layer programs and random
marker spans, picks a random plan per layer (none, full, kept units through ``actplan.apply``,
kept intervals through a hand-made ``IntervalPolicy``, offload of kept units, routing saved or
not), and runs four steps: the call that learns each layer's path, two on the learnt fast path,
and one with ``watch_every_segment`` on (set in the constructor or by attribute). Against the
same model without checkpointing (built again from the same seed, cheaper than a deepcopy):

* every call: loss and every parameter gradient bit-identical, same gradient census (dropout
  included: the replay draws the same numbers);
* every call: no kept GEMM or attention kernel reruns in backward, and no routing op where
  routing is saved (backward runs at most no checkpointing's count plus the ops outside kept
  intervals);
* fast calls hold the same bytes as each other;
* activation bytes at the end of the forward at most no checkpointing's, each kept unit's held
  bytes at most 1.05x its ``autograd`` figure, and fast calls at most the watching call, each up
  to a margin the engine's design implies (``kept_flows``, whose docstring gives the smallest
  layers that need each margin: without them these bounds fail, by design).

A second property builds layers that write in place into the output of a kept GEMM that an op
then saves for backward, and checks the engine refuses with ``KeptTensorMutatedError`` naming
the ops. The main property keeps in-place writes to fresh tensors; when one lands on a tensor a
kept unit holds, it must raise that error too (checked to name the write, and the same program
checked exact without the unit kept).

Engine findings are pinned as named tests at the end of the file (``xfail(strict=True)`` while
the engine still shows them).

CI runs a fixed, derandomized set of examples (under a minute on two cores; the module runs
torch single-threaded, as the tensors are tiny). For a deeper, randomized run set
``ACTPLAN_FUZZ_EXAMPLES`` (the main property's example count; the mutation property runs a
quarter as many), e.g. ``ACTPLAN_FUZZ_EXAMPLES=5000 pytest tests/test_engine_properties.py -s``;
a failure prints the seed to rerun with ``--hypothesis-seed`` and a ``@reproduce_failure`` blob.
``-s`` also prints the coverage line: how many distinct op sequences, marker placements and
layers the run exercised.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import actplan
from actplan._engine.boundary import apply_gradient_checkpointing, checkpoint_state
from actplan._engine.ops import ROUTING_OPS
from actplan._engine.policy import IntervalPolicy, KeptTensorMutatedError
from actplan._install.apply import held_by_layer, offload_engine
from actplan.markers import checkpoint_record
from actplan.measure import MemoryMeter, OpCounter, capture_step, compare_steps
from actplan.units import MarkerInterval, RecomputeIntervalMap
from engine_layers import BATCH, EXPERTS, INPLACE_OPS, GeneratedStack, LayerSpec, Op, Span, programs, stacks

# One worker: the coverage report (`report_coverage`) then covers all of this file's properties.
pytestmark = pytest.mark.xdist_group("engine-properties")

# GEMMs and attention kernels a kept unit must never rerun (the CPU ops the vocabulary issues).
EXPENSIVE = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu"})
ROUTING = frozenset(ROUTING_OPS)

_DEEP = int(os.environ.get("ACTPLAN_FUZZ_EXAMPLES", "0"))
MAIN_EXAMPLES = _DEEP or 1000
MUTATION_EXAMPLES = max(_DEEP // 4, 150) if _DEEP else 150


def _fuzz_settings(examples: int) -> settings:
    # CI: a fixed example set (derandomized, no database). A deep run explores fresh seeds.
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=not _DEEP,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=True,
    )


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # The tensors are tiny: intra-op threads only add synchronisation, which on a loaded 2-core
    # machine costs milliseconds per op (10-30x the whole property's time).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# What the examples covered, reported when this file's tests are done (``report_coverage``).
COVERAGE: dict = {
    "op_sequences": set(),
    "placements": set(),
    "layers": set(),
    "plans": Counter(),
    "examples": 0,
    "mutation_errors_explained": 0,
    "learnt_path_exposed": 0,
    "mutation_cases": Counter(),
    "mutation_layers": set(),
}


# ---------------------------------------------------------------------------------------------
# Plans


@dataclass(frozen=True)
class LayerChoice:
    """How one layer is checkpointed.

    ``mode``: ``none`` and ``full`` (through ``actplan.apply``), ``keep`` (``actplan.apply``
    with ``keep: units``), or ``intervals`` (a hand-made ``IntervalPolicy`` keeping a subset of
    the declared intervals, which may split a unit)."""

    mode: str
    units: tuple[str, ...] = ()
    spans: tuple[int, ...] = ()  # intervals: the kept span indices
    offload: tuple[str, ...] = ()  # keep: units whose held outputs move to the host


@dataclass(frozen=True)
class Plan:
    layers: tuple[LayerChoice, ...]
    save_collectives: bool | str
    # Whether the first two calls watch every segment (``watch_every_segment`` from the start:
    # set in the constructor of hand-made policies), then two on the fast path; else a learning
    # call, a fast one, one watching every segment (switched on by attribute), a fast one.
    watch_first: bool


@st.composite
def layer_choices(draw, spec: LayerSpec) -> LayerChoice:
    units = tuple(dict.fromkeys(span.unit for span in spec.spans))
    mode = draw(st.sampled_from(("keep", "intervals", "full", "keep", "intervals", "none")))
    if mode == "keep":
        kept = draw(st.lists(st.sampled_from(units), min_size=1, max_size=len(units), unique=True))
        offload = ()
        if draw(st.integers(0, 3)) == 0:
            offload = tuple(
                draw(st.lists(st.sampled_from(kept), min_size=1, max_size=len(kept), unique=True))
            )
        return LayerChoice("keep", units=tuple(kept), offload=offload)
    if mode == "intervals":
        indices = range(len(spec.spans))
        kept = draw(st.lists(st.sampled_from(indices), max_size=len(spec.spans), unique=True))
        return LayerChoice("intervals", spans=tuple(sorted(kept)))
    return LayerChoice(mode)


@st.composite
def plans(draw, specs: tuple[LayerSpec, ...]) -> Plan:
    layers = tuple(draw(layer_choices(spec)) for spec in specs)
    if sum(bool(choice.offload) for choice in layers) > 1:  # one offload entry per config
        first = next(i for i, choice in enumerate(layers) if choice.offload)
        layers = tuple(
            choice if i == first else LayerChoice(choice.mode, choice.units, choice.spans)
            for i, choice in enumerate(layers)
        )
    save_collectives = draw(st.sampled_from(("auto", "auto", True, False)))
    return Plan(layers, save_collectives, draw(st.booleans()))


def _config(plan: Plan) -> dict:
    def choice_dict(choice: LayerChoice) -> dict:
        if choice.mode == "keep":
            return {"keep": list(choice.units)}
        # Hand-made policies are installed after apply, on layers it leaves alone.
        return {"mode": "none" if choice.mode == "intervals" else choice.mode}

    config: dict = {
        **choice_dict(plan.layers[0]),
        "overrides": [{"layers": [i], **choice_dict(c)} for i, c in enumerate(plan.layers) if i],
        "save_collectives": plan.save_collectives,
    }
    for index, choice in enumerate(plan.layers):
        if choice.offload:
            config["offload"] = {"units": list(choice.offload), "layers": [index], "min_bytes": 0}
    return config


def install(model: GeneratedStack, plan: Plan) -> None:
    actplan.apply(model, _config(plan))
    for index, (layer, choice) in enumerate(zip(model.layers, plan.layers, strict=True)):
        if choice.mode == "intervals":
            intervals = layer.spec.intervals()
            policy = IntervalPolicy(
                layer.recompute_intervals,
                [intervals[i] for i in choice.spans],
                layer_name=f"layers.{index}",
                save_collectives=plan.save_collectives is not False,
                watch_every_segment=plan.watch_first,
            )
            apply_gradient_checkpointing(layer, policy=policy, name=f"layers.{index}")
    watch_every_segment(model, plan.watch_first)


def watch_every_segment(model: GeneratedStack, on: bool) -> None:
    for layer in model.layers:
        state = checkpoint_state(layer)
        if state is not None and state.policy is not None:
            state.policy.watch_every_segment = on


@dataclass
class LayerPlanView:
    """What the installed wrapper of one layer does, read back from the layer itself."""

    checkpointed: bool
    has_policy: bool
    kept_ops: set[int] = field(default_factory=set)  # op indices inside a kept interval
    routing_saved: bool = False
    offloaded: bool = False


def installed_view(layer) -> LayerPlanView:
    state = checkpoint_state(layer)
    if state is None:
        return LayerPlanView(False, False)
    policy = state.policy
    if policy is None:
        return LayerPlanView(True, False)
    intervals = layer.spec.intervals()
    kept = [i for i, interval in enumerate(intervals) if interval in policy.kept_intervals]
    return LayerPlanView(
        True,
        True,
        layer.spec.ops_in(kept),
        routing_saved=policy.save_collectives,
        offloaded=bool(policy.offload_intervals),
    )


# ---------------------------------------------------------------------------------------------
# Running and measuring a step


@dataclass
class Run:
    capture: object
    activation_bytes: int
    backward: Counter
    held: dict


class _SpecOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten ops by (layer, program op) while the layers' ``spec_hook`` says which runs."""

    def __init__(self) -> None:
        super().__init__()
        self.where: tuple[int, int] | None = None
        self.counts: dict[tuple[int, int], Counter] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.where is not None:
            self.counts.setdefault(self.where, Counter())[func] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def recording(model: GeneratedStack, recorder: _SpecOps):
    for index, layer in enumerate(model.layers):
        layer.spec_hook = functools.partial(_attribute, recorder, index)
    try:
        with recorder:
            yield
    finally:
        for layer in model.layers:
            layer.spec_hook = None


def _attribute(recorder: _SpecOps, layer_index: int, op_index: int | None) -> None:
    recorder.where = None if op_index is None else (layer_index, op_index)


def run_step(model: GeneratedStack, seed: int, recorder: _SpecOps | None = None) -> Run:
    """One training step, metered: activation bytes at the end of the forward, the ops backward
    ran, what each layer held. ``recorder`` also counts the forward's ops per program op."""
    torch.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed also queues CUDA work
    model.zero_grad(set_to_none=True)
    with MemoryMeter(model) as meter:
        if recorder is None:
            loss = model()
        else:
            with recording(model, recorder):
                loss = model()
        meter.mark("forward_end")
    # Backward outside the meter (only the forward's end is read; tracking costs per op).
    with OpCounter() as backward:
        loss.backward()
    return Run(
        capture_step(model, loss),
        meter.report().marks["forward_end"].activation_bytes,
        backward.counts,
        held_by_layer(model),  # the layers are wrapped by hand: no installed plan
    )


def rerun_allowance(model: GeneratedStack, per_op: dict[tuple[int, int], Counter]) -> Counter:
    """Per aten op, how many runs backward may add to no checkpointing's: the expensive ops of
    checkpointed layers outside kept intervals, and routing ops of layers that do not save
    routing. Everything else the engine must serve from memory."""
    allowance: Counter = Counter()
    for index, layer in enumerate(model.layers):
        view = installed_view(layer)
        if not view.checkpointed:
            continue
        for (layer_index, op_index), counts in per_op.items():
            if layer_index != index:
                continue
            for func, count in counts.items():
                if func in ROUTING:
                    rerun = not (view.has_policy and view.routing_saved)
                else:
                    expensive = getattr(func, "_opname", "") in EXPENSIVE
                    rerun = expensive and (not view.has_policy or op_index not in view.kept_ops)
                if rerun:
                    allowance[func] += count
    return allowance


def assert_exact(reference: Run, run: Run, what: str) -> None:
    report = compare_steps(reference.capture, run.capture)
    assert report.loss_identical, (what, reference.capture.loss, run.capture.loss)
    assert report.max_abs_grad_diff == 0.0, (what, report.worst_param, report.max_abs_grad_diff)
    assert report.census_match, (what, report.census_diff)


def assert_no_kept_reruns(reference: Run, run: Run, allowance: Counter, what: str) -> None:
    for func, count in run.backward.items():
        if func in ROUTING or getattr(func, "_opname", "") in EXPENSIVE:
            extra = count - reference.backward.get(func, 0)
            assert extra <= allowance[func], (what, str(func), extra, allowance[func])


@dataclass
class KeptFlows:
    """Where a layer's kept outputs go, per kept unit, in bytes: the by-design margins of the
    bounds the main property checks (see ``kept_flows``)."""

    read_by_replay: Counter = field(default_factory=Counter)
    exposed: Counter = field(default_factory=Counter)
    routing: int = 0  # bytes of routing and integer outputs the layer holds whatever reads them

    def exposed_total(self) -> int:
        return sum(self.exposed.values())


def kept_flows(layer) -> KeptFlows:
    """The margins, derived from the program and the installed policy:

    * ``read_by_replay``: registers made by a kept unit's ops that an op outside every kept
      interval reads, or that the layer returns. The replay reruns that op, so the unit holds
      the register even where no autograd node saves it (``tanh`` and ``softmax`` save their
      output, a scale nothing): it stands in for what autograd saves downstream, which the
      unit's ``autograd`` figure does not count. Smallest case: ``tanh(linear(x))`` with the
      linear kept holds its output (256 bytes at B=2, T=4, D=8) against an autograd figure of 0;
      and when the tanh output is what the layer returns (the next layer saves it anyway), the
      step holds those 256 bytes more than no checkpointing (772 against 516).
    * ``exposed`` (no margin, counted for coverage): registers made by a kept unit's ops still
      referenced when an op outside every kept interval runs. The learnt fast path does not
      watch such segments; it holds such a register only if the learning call, which watched
      them, saw it read (see ``test_an_unread_kept_output_stays_dropped_on_the_learnt_path``).
    * ``routing``: each top-k router's routing and integer outputs (values, ids, orders, counts,
      and a copy of the weights when they are renormalised in place), held whatever reads them.
      Smallest case: a layer of a kept router and one linear holds 216 bytes more than no
      checkpointing (1820 against 1604): keeping the router saves nothing to pay for them.
    """
    spec, view = layer.spec, installed_view(layer)
    flows = KeptFlows()
    if not view.has_policy:
        return flows
    tokens = BATCH * spec.seq
    for index, op in enumerate(spec.ops):
        if op.kind == "route" and (view.routing_saved or index in view.kept_ops):
            flows.routing += tokens * (1 + op.variant % 2) * 40 + EXPERTS * 8
    kept_intervals = checkpoint_state(layer).policy.kept_intervals
    units_of_op: dict[int, set[str]] = {}
    for span, interval in zip(spec.spans, spec.intervals(), strict=True):
        if interval in kept_intervals:
            for index in range(span.start, span.end):
                units_of_op.setdefault(index, set()).add(span.unit)
    count = len(spec.ops)
    owner = [0]  # the register whose storage each register uses (flatten makes views only)
    for index, op in enumerate(spec.ops):
        owner.append(owner[op.inputs[0]] if op.kind == "flatten" else index + 1)
    returned = {count, *spec.unread(), *((spec.aux,) if spec.output != "tensor" else ())}
    read_outside = {owner[r] for r in returned}
    last_use = {owner[r]: count for r in returned}
    for index, op in enumerate(spec.ops):
        for register in op.inputs:
            if index not in view.kept_ops:
                read_outside.add(owner[register])
            last_use[owner[register]] = max(last_use.get(owner[register], 0), index)
    register_bytes = tokens * spec.dim * 4
    for register in range(1, count + 1):
        units = units_of_op.get(register - 1, ())
        if not units or owner[register] != register:
            continue
        end = count if not spec.release_dead else last_use.get(register, register - 1)
        # Alive across an op outside every kept interval, or to the end of the forward.
        exposed = end == count or any(i not in view.kept_ops for i in range(register, end + 1))
        for unit in units:
            flows.read_by_replay[unit] += register_bytes * (register in read_outside)
            flows.exposed[unit] += register_bytes * exposed
    return flows


def assert_units_hold_at_most_autograd(model: GeneratedStack, run: Run, what: str) -> None:
    for name, units in run.held.items():
        layer = model.get_submodule(name)
        routed_units = {
            span.unit
            for span in layer.spec.spans
            if any(op.kind == "route" for op in layer.spec.ops[span.start : span.end])
        }
        flows = kept_flows(layer)
        for unit, sizes in units.items():
            if unit == "routing" or unit in routed_units:
                # Routing outputs (and integer ones) are held whatever reads them, kept or not.
                continue
            bound = 1.05 * sizes["autograd"] + flows.read_by_replay[unit]
            assert sizes["held"] <= bound, (what, name, unit, sizes, flows)


def layer_totals(held: dict) -> dict[str, int]:
    return {name: sum(sizes["held"] for sizes in units.values()) for name, units in held.items()}


# ---------------------------------------------------------------------------------------------
# The main property


def _record_coverage(specs, plan: Plan) -> None:
    COVERAGE["examples"] += 1
    for spec in specs:
        COVERAGE["op_sequences"].add(spec.op_sequence)
        COVERAGE["placements"].add(spec.placement)
        COVERAGE["layers"].add((spec.op_sequence, spec.placement))
    for choice in plan.layers:
        COVERAGE["plans"][choice.mode + ("+offload" if choice.offload else "")] += 1


def _explained_mutation(model: GeneratedStack, error: KeptTensorMutatedError) -> bool:
    """Whether an error the main property hit is the engine refusing a real write into a held
    tensor: an in-place op of the vocabulary, inside a kept interval, writing into the output of
    an op that read a held tensor (so the kept unit holds it) and that backward then saved."""
    message = str(error)
    for layer in model.layers:
        view = installed_view(layer)
        for index in view.kept_ops:
            op = layer.spec.ops[index]
            if op.kind == "inplace" and f"in-place op aten.{INPLACE_OPS[op.variant]}" in message:
                return True
            # Top-k weights renormalised in place: with routing saved the replay gets a copy taken
            # before the write; without, the kept unit holds them like any output of its ops.
            renormalised = op.kind == "route" and op.variant >= 2 and not view.routing_saved
            if renormalised and "in-place op aten.div_" in message and "aten.topk" in message:
                return True
    return False


@_fuzz_settings(MAIN_EXAMPLES)
@given(data=st.data(), specs=stacks(), seed=st.integers(0, 2**16))
def test_generated_layers_are_exact_hold_less_and_never_rerun_kept_ops(data, specs, seed):
    plan = data.draw(plans(specs), label="plan")
    # Two identical models from one seed (cheaper than a deepcopy): the reference, not
    # checkpointed, and one under the plan.
    reference_model, model = GeneratedStack(list(specs), seed), GeneratedStack(list(specs), seed)
    recorder = _SpecOps()
    reference = run_step(reference_model, seed, recorder)
    # Four calls: the first learns each layer's path; "fast" ones take the learnt path,
    # "watched" ones watch every segment (watch_every_segment) though the path is learnt.
    order = (
        ("learning", "watched", "fast", "fast")
        if plan.watch_first
        else ("learning", "fast", "watched", "fast")
    )
    runs: list[tuple[str, Run]] = []
    with warnings.catch_warnings():
        # Kept units that hold nothing or offload nothing warn; generated plans do that often.
        warnings.simplefilter("ignore", UserWarning)
        install(model, plan)
        try:
            for index, kind in enumerate(order):
                if index:
                    watch_every_segment(model, kind == "watched")
                runs.append((kind, run_step(model, seed)))
        except KeptTensorMutatedError as error:
            assert _explained_mutation(model, error), error
            # The write itself is legal: with nothing kept the same program is exact.
            recomputed = GeneratedStack(list(specs), seed)
            actplan.apply(recomputed, {"mode": "full"})
            assert_exact(reference, run_step(recomputed, seed), "full, after the refusal")
            COVERAGE["mutation_errors_explained"] += 1
            _record_coverage(specs, plan)
            return
    _record_coverage(specs, plan)

    # Every call is exact and reruns no kept GEMM, attention kernel or saved routing op. What it
    # holds is bounded by no checkpointing's and by autograd's figures, up to by-design margins
    # (``kept_flows``): routing outputs held whatever reads them, kept outputs a rerun op reads,
    # and on the fast path kept outputs alive across segments it does not watch.
    allowance = rerun_allowance(model, recorder.counts)
    flows = {f"layers.{i}": kept_flows(layer) for i, layer in enumerate(model.layers)}
    margin = sum(f.routing + sum(f.read_by_replay.values()) for f in flows.values())
    exposed = sum(f.exposed_total() for f in flows.values())  # (coverage: the learnt path's case)
    for index, (kind, run) in enumerate(runs):
        what = f"call {index} ({kind})"
        assert_exact(reference, run, what)
        assert_no_kept_reruns(reference, run, allowance, what)
        bound = reference.activation_bytes + margin
        assert run.activation_bytes <= bound, (what, run.activation_bytes, reference.activation_bytes)
        assert_units_hold_at_most_autograd(model, run, what)

    # Calls on the learnt path hold the same, and no more than the watching path: what the
    # learning call dropped unread stays dropped where the learnt path does not watch.
    (fast, fast_again), watched = [r for k, r in runs if k == "fast"], dict(runs)["watched"]
    assert fast.held == fast_again.held
    assert fast.activation_bytes == fast_again.activation_bytes
    fast_totals, watched_totals = layer_totals(fast.held), layer_totals(watched.held)
    for name, total in fast_totals.items():
        assert total <= watched_totals.get(name, 0), (name, total, watched_totals, flows[name])
    assert fast.activation_bytes <= watched.activation_bytes
    COVERAGE["learnt_path_exposed"] += exposed > 0

    if any(installed_view(layer).offloaded for layer in model.layers):
        stats = offload_engine(model).stats
        assert stats.bytes_reloaded == stats.bytes_offloaded and stats.host_in_use_bytes == 0


# ---------------------------------------------------------------------------------------------
# Writes into held tensors


@st.composite
def mutation_cases(draw) -> tuple[LayerSpec, str]:
    """A layer whose kept unit holds a GEMM output ``y`` that is then written in place (inside
    the unit or after it) and read by an op that saves it for backward; and where the write
    happens (``inside`` or ``after`` the unit)."""
    dim = draw(st.sampled_from((8, 16)))
    seq = draw(st.sampled_from((4, 6)))
    prefix = draw(programs(dim, seq, 1, min_ops=0, max_ops=3))  # recomputed: nothing kept there
    gemm = len(prefix)  # the GEMM's op index; it reads the newest register and writes y
    y = gemm + 1
    where = draw(st.sampled_from(("inside", "after")))
    ops = [
        *prefix,
        Op(draw(st.sampled_from(("linear", "matmul"))), (gemm,), draw(st.integers(0, 1))),
        # An op that does not read y, then one that saves it (a * tanh(b) saves a).
        Op(draw(st.sampled_from(("tanh", "scale", "silu"))), (gemm,)),
        Op("mul", (y, gemm + 2)),
        *draw(programs(dim, seq, 1, min_ops=0, max_ops=2)),  # reads early registers only
    ]
    span_end = gemm + (2 if where == "inside" and draw(st.booleans()) else 1)
    spec = LayerSpec(
        dim=dim,
        seq=seq,
        heads=1,
        ops=tuple(ops),
        spans=(Span(gemm, span_end, draw(st.sampled_from(("mlp_up", "qkv_proj", "attn_proj")))),),
        shared_markers=draw(st.booleans()),
        output="tensor",
        aux=0,
        # Inside: right after the GEMM, before the unit closes; after: once the next op ran.
        mutation=(gemm if where == "inside" else gemm + 1, y),
    )
    return spec, where


@_fuzz_settings(MUTATION_EXAMPLES)
@given(case=mutation_cases(), seed=st.integers(0, 2**16), on_learnt_path=st.booleans())
def test_writing_into_a_held_gemm_output_is_refused_and_names_the_op(case, seed, on_learnt_path):
    spec, where = case
    COVERAGE["mutation_cases"][(where, on_learnt_path)] += 1
    COVERAGE["mutation_layers"].add((spec.op_sequence, spec.placement))
    reference = run_step(GeneratedStack([spec], seed), seed)

    # Recomputing the unit instead of keeping it is exact: the write itself is legal.
    full = GeneratedStack([spec], seed)
    actplan.apply(full, {"mode": "full"})
    assert_exact(reference, run_step(full, seed), "full")

    kept = GeneratedStack([spec], seed)
    (layer,) = kept.layers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        actplan.apply(kept, {"keep": [spec.spans[0].unit]})
        if on_learnt_path:
            # A clean call first (no write), so the failing call takes the learnt fast path.
            layer.mutate = False
            reference_clean = GeneratedStack([spec], seed)
            reference_clean.layers[0].mutate = False
            assert_exact(run_step(reference_clean, seed), run_step(kept, seed), "clean call")
            layer.mutate = True
        with pytest.raises(KeptTensorMutatedError) as raised:
            run_step(kept, seed)
    message = str(raised.value)
    assert "of aten.mm" in message or "of aten.addmm" in message, message  # the GEMM that made y
    # Seen in forward, the write is named; seen only in backward (an unwatched segment on the
    # fast path), the held output it changed is.
    assert "in-place op aten.mul_" in message or "changed in place after the forward" in message, message
    if not on_learnt_path:
        assert "in-place op aten.mul_" in message, message


class WriteAfterKeptProjection(nn.Module):
    """The minimal case the mutation property found: a kept projection of a 3D input (``mm``
    on a flattened view, its output reshaped back by ``_unsafe_view``), written in place after
    its unit closes, then saved for backward by a product. (The engine used to miss the write
    on the learnt path and give wrong gradients without an error.)"""

    recompute_intervals = RecomputeIntervalMap({"mlp_up": MarkerInterval("a", "b")})

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.write = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        checkpoint_record("a")
        y = self.proj(x)
        checkpoint_record("b")
        if self.write:
            y.mul_(2.0)
        return (y * torch.tanh(x)).sum()


def test_a_write_after_a_kept_3d_projection_is_refused_on_the_learnt_path():
    torch.manual_seed(0)
    layer = WriteAfterKeptProjection()
    x = torch.randn(2, 4, 8, requires_grad=True)
    imap = WriteAfterKeptProjection.recompute_intervals
    policy = IntervalPolicy(imap, imap.intervals_of(["mlp_up"]), layer_name="L")
    apply_gradient_checkpointing(layer, policy=policy, name="L")
    layer(x).backward()  # the learning call, no write: every segment watched
    layer.write = True
    # The learnt path does not watch the write; the replay's check of the held `mm` output must
    # see it through the `_unsafe_view` alias, whose version counter is its own.
    with pytest.raises(KeptTensorMutatedError, match=r"aten\.mm"):
        layer(x).backward()


class UnreadKeptOutput(nn.Module):
    """A kept projection nothing reads, still referenced (a local) when the forward goes on to
    save something: the minimal case of the fast path holding what the learning call dropped."""

    recompute_intervals = RecomputeIntervalMap({"mlp_up": MarkerInterval("a", "b")})

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8, bias=False)
        self.down = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        checkpoint_record("a")
        _unread = self.up(x)  # kept; nothing reads it, but the local keeps it referenced
        checkpoint_record("b")
        return self.down(x)


def test_an_unread_kept_output_stays_dropped_on_the_learnt_path():
    torch.manual_seed(0)
    x = nn.Parameter(torch.randn(2, 4, 8))

    def forward_end_bytes(layer: nn.Module) -> int:
        with MemoryMeter(layer) as meter:
            loss = layer(x * 1.0).sum()
            meter.mark("forward_end")
            loss.backward()
        return meter.report().marks["forward_end"].activation_bytes

    layer = UnreadKeptOutput()
    none_bytes = forward_end_bytes(layer)
    imap = UnreadKeptOutput.recompute_intervals
    policy = IntervalPolicy(imap, imap.intervals_of(["mlp_up"]), layer_name="L")
    apply_gradient_checkpointing(layer, policy=policy, name="L")
    learning_bytes = forward_end_bytes(layer)
    learning_held = policy.held_reports()["L"].held
    learnt_bytes = forward_end_bytes(layer)  # the learnt fast path
    assert learning_bytes <= none_bytes  # holds today
    assert learnt_bytes <= none_bytes  # was 516 > 260 before the learnt path kept the drop
    assert policy.held_reports()["L"].held == learning_held  # was 256 bytes, against none


class ReadsItOnlySometimes(UnreadKeptOutput):
    """``UnreadKeptOutput`` with a branch on global state after the kept unit, where the learnt
    path does not watch: on its learning call nothing reads up's output there, later it does."""

    read_it = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        checkpoint_record("a")
        up = self.up(x)
        checkpoint_record("b")
        out = self.down(x)
        return out + up.tanh() if self.read_it else out


def test_a_read_the_learnt_path_cannot_see_reaches_the_placeholder_not_a_wrong_value():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)
    layer = ReadsItOnlySometimes()
    imap = ReadsItOnlySometimes.recompute_intervals
    policy = IntervalPolicy(imap, imap.intervals_of(["mlp_up"]), layer_name="L")
    apply_gradient_checkpointing(layer, policy=policy, name="L")
    layer(x).sum().backward()  # learning call: up's output is dropped unread
    layer.zero_grad()
    layer.read_it = True
    layer(x).sum().backward()  # same markers, learnt path: the tanh is not watched
    # The replay reruns tanh on the placeholder: NaN where the gradient flows through it,
    # never a finite value that differs from no checkpointing.
    assert layer.up.weight.grad.isnan().all()
    assert not layer.down.weight.grad.isnan().any()


class DownReusesUpsStorage(nn.Module):
    """Two kept units: up's output, read only by ``tanh`` (which saves its own output), is
    dropped when the first unit closes, and down's output, which ``sin`` saves, is then
    allocated where it was (the allocator reuses the freed storage's address)."""

    recompute_intervals = RecomputeIntervalMap(
        {"mlp_up": MarkerInterval("a", "b"), "mlp_down": MarkerInterval("b", "c")}
    )

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8, bias=False)
        self.down = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        checkpoint_record("a")
        z = torch.tanh(self.up(x))
        checkpoint_record("b")
        w = self.down(z)
        checkpoint_record("c")
        return torch.sin(w)


def test_a_unit_autograd_figure_does_not_count_a_dead_storage_whose_address_was_reused():
    # The per-call bookkeeping is keyed by storage address: a dropped output's entry goes when
    # it is dropped, so a later output at the same address is not taken for it.
    torch.manual_seed(0)
    figures = []
    for _ in range(5):  # the allocator reuses the address almost always; one call could miss it
        layer = DownReusesUpsStorage()
        imap = DownReusesUpsStorage.recompute_intervals
        policy = IntervalPolicy(imap, imap.intervals_of(["mlp_up", "mlp_down"]), layer_name="L")
        apply_gradient_checkpointing(layer, policy=policy, name="L")
        layer(torch.randn(4, 8, requires_grad=True)).sum().backward()
        (up,) = imap.intervals_of(["mlp_up"])
        figures.append(policy.held_reports()["L"].autograd[up])
    assert figures == [4 * 8 * 4] * 5  # tanh's output: all autograd keeps for mlp_up's ops


# ---------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def report_coverage():
    """After this file's tests in this process, whatever their order (pytest-xdist may run a
    module's tests in any order on one worker): prints what the properties covered (``pytest
    -s``) and checks that the generated layers varied."""
    yield
    if not COVERAGE["examples"]:
        return  # the main property did not run here (deselected)
    line = (
        f"engine properties: {COVERAGE['examples']} main examples, "
        f"{len(COVERAGE['op_sequences'])} distinct op sequences, "
        f"{len(COVERAGE['placements'])} distinct marker placements, "
        f"{len(COVERAGE['layers'])} distinct layers (sequence and placement), "
        f"plans {dict(COVERAGE['plans'])}, "
        f"explained mutation errors {COVERAGE['mutation_errors_explained']}, "
        f"examples with kept outputs alive across unwatched segments {COVERAGE['learnt_path_exposed']}, "
        f"mutation cases (where, on the learnt path) {dict(COVERAGE['mutation_cases'])} "
        f"over {len(COVERAGE['mutation_layers'])} distinct layers"
    )
    print(line)
    assert len(COVERAGE["op_sequences"]) > 1 and len(COVERAGE["placements"]) > 1, line

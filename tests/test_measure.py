"""Tests for actplan.measure: the memory meter, the interleaved timer and the parity checks."""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from actplan.measure import (
    GradCensus,
    MemoryMeter,
    StepCapture,
    TimingStats,
    capture_step,
    compare_steps,
    grad_census,
    interleaved_timing,
    ratio,
)

FLOAT32_BYTES = 4

# ---------------------------------------------------------------------------------------------
# Memory meter: exact counting
# ---------------------------------------------------------------------------------------------


def test_meter_counts_known_allocation_and_its_release():
    with MemoryMeter() as meter:
        buffer = torch.empty(1000, dtype=torch.float32)
        assert meter.live_bytes == 1000 * FLOAT32_BYTES
        del buffer
        assert meter.live_bytes == 0
    report = meter.report()
    assert report.peak_live_bytes == 4000
    assert report.peak_label == "aten.empty.memory_format"
    assert report.timeline == [("aten.empty.memory_format", 4000), ("free", 0)]
    assert report.cuda_max_allocated_bytes is None


def test_meter_counts_views_and_in_place_results_once():
    with MemoryMeter() as meter:
        base = torch.zeros(1000)
        view = base.view(10, 100)
        transposed = view.t()
        base.add_(1)
        torch.mul(base, 2, out=base)
        view.mul_(3)
        assert meter.live_bytes == 4000
        del base, view
        # The transposed view still holds the storage.
        assert meter.live_bytes == 4000
        del transposed
        assert meter.live_bytes == 0


def test_meter_ignores_in_place_work_on_storages_from_before_the_window():
    existing = torch.zeros(1000)
    with MemoryMeter() as meter:
        existing.add_(1)
        torch.mul(existing, 2, out=existing)
        alias = existing[::2]
        assert meter.live_bytes == 0
        fresh = existing * 2
        assert meter.live_bytes == 4000
    assert alias.numel() == 500
    assert fresh.numel() == 1000


def test_meter_release_fires_only_when_the_storage_itself_is_freed():
    # Storage PyObjects are preserved while a tensor holds the storage: dropping every Python
    # handle to the original tensor and its storage object must not count as a free.
    with MemoryMeter() as meter:
        original = torch.empty(256)
        storage = original.untyped_storage()
        survivor = original[128:]
        del original, storage
        gc.collect()
        assert meter.live_bytes == 1024
        del survivor
        assert meter.live_bytes == 0


def test_meter_counts_tensor_literals_and_factories():
    with MemoryMeter() as meter:
        literal = torch.tensor([1.0, 2.0, 3.0])
        assert meter.live_bytes == 3 * FLOAT32_BYTES
        ones = torch.ones(10, dtype=torch.float64)
        assert meter.live_bytes == 12 + 80
    assert literal.sum() + ones.sum() == 16


def test_meter_follows_resize_of_a_tracked_storage():
    with MemoryMeter() as meter:
        grown = torch.empty(10)
        grown.resize_(1000)
        assert meter.live_bytes == 4000
        assert meter.report().peak_live_bytes == 4000


def test_meter_ignores_meta_and_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with MemoryMeter() as meter:
        meta = torch.empty(1_000_000, device="meta")
        with FakeTensorMode():
            fake = torch.empty(1_000_000)
            doubled = fake * 2
        assert meter.live_bytes == 0
    assert meta.is_meta and doubled.shape == (1_000_000,)


def test_meter_skips_sparse_tensors_without_failing():
    with MemoryMeter() as meter:
        dense = torch.eye(4)
        sparse = dense.to_sparse()
        assert meter.live_bytes == 4 * 4 * FLOAT32_BYTES  # the dense eye only
    assert sparse.is_sparse


def test_peak_tracks_a_transient():
    with MemoryMeter() as meter:
        kept = torch.empty(1000)
        transient = torch.empty(2000)
        del transient
        after = torch.empty(500)
        assert meter.live_bytes == 6000
    report = meter.report()
    assert report.peak_live_bytes == 12000
    assert report.peak_bytes == 12000  # nothing resident at entry
    assert max(live for _, live in report.timeline) == 12000
    assert kept.numel() + after.numel() == 1500


def test_timeline_is_bounded_and_keeps_peak_and_marks():
    quiet_steps = (50, 151, 230)
    with MemoryMeter(timeline_cap=16) as meter:
        for step in range(300):
            scratch = torch.empty(100)
            if step == 150:
                spike = torch.empty(10_000)
                del spike
            del scratch
            if step in quiet_steps:
                meter.mark(f"quiet{step}")  # a low point between higher samples
    report = meter.report()
    assert len(report.timeline) <= 16
    assert max(live for _, live in report.timeline) == report.peak_live_bytes == 40_400
    labels = [label for label, _ in report.timeline]
    assert [label for label in labels if label.startswith("quiet")] == [f"quiet{s}" for s in quiet_steps]


def test_timeline_stays_bounded_when_marks_outnumber_the_cap():
    with MemoryMeter(timeline_cap=16) as meter:
        for step in range(200):
            scratch = torch.empty(10)
            meter.mark(f"step{step}")
            del scratch
    assert len(meter.report().timeline) <= 16
    assert len(meter.report().marks) == 200


def test_meter_misuse_is_reported():
    meter = MemoryMeter()
    with pytest.raises(RuntimeError, match="measured nothing yet"):
        meter.report()
    with pytest.raises(RuntimeError, match="outside its window"):
        meter.mark("early")
    with meter, pytest.raises(RuntimeError, match="already active"), meter:
        pass


def test_memory_report_is_json_serialisable():
    with MemoryMeter() as meter:
        kept = torch.empty(8)
        meter.mark("here")
    encoded = json.loads(json.dumps(meter.report().to_dict()))
    assert encoded["marks"]["here"]["live_bytes"] == 32
    assert kept.numel() == 8


# ---------------------------------------------------------------------------------------------
# Memory meter: inside tensor subclasses (DTensor)
# ---------------------------------------------------------------------------------------------


def test_meter_sees_the_temporaries_a_dtensor_op_makes_inside_its_handler(tp_mesh):
    # Loss parallelism computes log-softmax on a vocabulary-sharded DTensor in a handler of its
    # own: a shifted copy of the logits and its exponential exist at once before the result is
    # made. A dispatch mode is off the stack while a subclass runs, so a meter that only saw
    # the op's output would count one copy of the logits where the step holds two.
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    rows, vocab = 64, 512
    logits_bytes = rows * vocab * FLOAT32_BYTES
    mesh = tp_mesh
    logits = distribute_tensor(torch.randn(rows, vocab), mesh, [Shard(1)])
    with loss_parallel(), MemoryMeter() as meter:
        result = torch.log_softmax(logits, dim=-1)
        assert meter.live_bytes == logits_bytes  # the result's local shard, nothing else
    del result
    report = meter.report()
    # shifted + exp(shifted) + two per-row reductions, then shifted + the result.
    assert report.peak_live_bytes >= 2 * logits_bytes
    assert report.peak_live_bytes < 3 * logits_bytes
    assert "aten.exp.default" in {label for label, _ in report.timeline}


def test_dtensor_shape_propagation_on_a_fake_run_is_no_allocation():
    # On fake tensors DTensor learns an op's output shape by running it on tensors of the
    # global shape, under the run's own fake mode. Those are not the rank's allocations: a rank
    # of 8 holds its shard's bytes, not the global tensor's 8x.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from actplan._torch_internals import dtensor_shape_propagation
    from actplan.measure import FakeRun
    from actplan.planning._rank_step import fake_world

    with dtensor_shape_propagation() as propagating:
        assert propagating is not None  # this torch has the hook; else the test would prove nothing
    world, rows, cols = 8, 64, 256
    shard_bytes = rows * cols * FLOAT32_BYTES
    with fake_world(world):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))  # outside the fake mode
        with FakeRun(materialize_meta=True):
            local = torch.randn(rows, cols)
            sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            with MemoryMeter() as meter:
                doubled = sharded * 2
                assert doubled.shape == (world * rows, cols)
                assert meter.live_bytes == shard_bytes
    assert meter.report().peak_live_bytes == shard_bytes


# ---------------------------------------------------------------------------------------------
# Memory meter: training steps
# ---------------------------------------------------------------------------------------------


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_marks_classify_activations_grads_and_optimizer_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.Adam(model.parameters())
    batch = torch.randn(16, 32)
    param_bytes = _param_bytes(model)

    with MemoryMeter(model, optimizer) as meter:
        loss = model(batch).square().mean()
        forward_end = meter.mark("forward_end")
        loss.backward()
        backward_end = meter.mark("backward_end")
        optimizer.step()
        step_end = meter.mark("step_end")

    assert forward_end.activation_bytes > 0
    assert forward_end.grad_bytes == forward_end.optimizer_bytes == 0
    assert backward_end.grad_bytes == param_bytes  # backward ops ran under the meter
    assert backward_end.optimizer_bytes == 0
    assert step_end.optimizer_bytes >= 2 * param_bytes  # Adam's two moments per parameter
    assert step_end.live_bytes == (step_end.activation_bytes + step_end.grad_bytes + step_end.optimizer_bytes)
    report = meter.report()
    assert report.param_bytes == param_bytes
    assert report.grad_bytes == report.optimizer_bytes == 0
    assert report.peak_live_bytes >= step_end.live_bytes
    assert report.end == step_end

    # The next step starts with grads and optimizer state resident.
    with MemoryMeter(model, optimizer) as second:
        model(batch).square().mean().backward()
    resident = second.report()
    assert resident.grad_bytes == param_bytes
    assert resident.optimizer_bytes == step_end.optimizer_bytes
    assert resident.peak_bytes == 2 * param_bytes + resident.optimizer_bytes + resident.peak_live_bytes


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(torch.relu(self.up(hidden)))


def _save_matmuls(ctx, op, *args, **kwargs):
    if op == torch.ops.aten.addmm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _Stack(nn.Module):
    def __init__(self, mode: str, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.mode = mode

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.mode == "full":
                hidden = checkpoint(block, hidden, use_reentrant=False)
            elif self.mode == "selective":
                hidden = checkpoint(
                    block,
                    hidden,
                    use_reentrant=False,
                    context_fn=lambda: create_selective_checkpoint_contexts(_save_matmuls),
                )
            else:
                hidden = block(hidden)
        return hidden.square().mean()


def _forward_end_activations(mode: str) -> tuple[int, torch.Tensor]:
    torch.manual_seed(0)
    model = _Stack(mode)
    batch = torch.randn(64, 32, requires_grad=True)
    with MemoryMeter(model) as meter:
        loss = model(batch)
        activations = meter.mark("forward_end").activation_bytes
        loss.backward()
    return activations, model.blocks[0].up.weight.grad


def test_checkpointing_shows_fewer_activation_bytes_at_forward_end():
    plain, plain_grad = _forward_end_activations("none")
    full, full_grad = _forward_end_activations("full")
    # Full checkpointing keeps only each block's input (64 x 32 floats) and the loss.
    assert full == 3 * 64 * 32 * FLOAT32_BYTES + FLOAT32_BYTES
    assert plain > 3 * full
    torch.testing.assert_close(full_grad, plain_grad, rtol=0, atol=0)


def test_meter_sees_tensors_cached_by_selective_checkpointing():
    # The SAC caching modes run inside ours: the addmm outputs they keep must show as live,
    # which a meter built on saved-tensor hooks would miss on torch 2.13.
    full, _ = _forward_end_activations("full")
    selective, _ = _forward_end_activations("selective")
    up_and_down_outputs = 3 * (64 * 128 + 64 * 32) * FLOAT32_BYTES
    assert selective >= full + up_and_down_outputs


# ---------------------------------------------------------------------------------------------
# Timer
# ---------------------------------------------------------------------------------------------


def test_interleaved_timing_rotates_order_and_counts_samples():
    calls: list[str] = []
    progress: list[str] = []
    runs = {name: (lambda name=name: calls.append(name)) for name in "ABC"}
    stats = interleaved_timing(runs, repeats=4, warmup=1, progress=progress.append)

    assert calls == list("ABC" + "BCA" + "CAB" + "ABC" + "BCA")
    assert progress == calls
    assert set(stats) == {"A", "B", "C"}
    assert all(len(s.samples) == 4 for s in stats.values())


def test_interleaved_timing_adds_rounds_until_settled():
    seen = []

    def settled(samples):
        seen.append(len(samples["a"]))
        return len(samples["a"]) >= 4

    stats = interleaved_timing(
        {"a": lambda: None, "b": lambda: None}, repeats=2, max_repeats=6, settled=settled
    )
    assert len(stats["a"].samples) == len(stats["b"].samples) == 4 and seen == [2, 3, 4]
    never = interleaved_timing({"a": lambda: None}, repeats=2, max_repeats=3, settled=lambda s: False)
    assert len(never["a"].samples) == 3  # the cap holds
    with pytest.raises(ValueError, match="max_repeats"):
        interleaved_timing({"a": lambda: None}, repeats=3, max_repeats=2)


def test_interleaved_timing_measures_wall_time():
    stats = interleaved_timing({"sleep": lambda: time.sleep(0.01), "noop": lambda: None}, repeats=3, warmup=0)
    assert stats["sleep"].min >= 0.01
    assert stats["noop"].max < stats["sleep"].min


def test_interleaved_timing_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one callable"):
        interleaved_timing({}, repeats=1)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        interleaved_timing({"a": lambda: None}, repeats=0)
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        interleaved_timing({"a": lambda: None}, repeats=1, warmup=-1)


def test_timing_stats_order_statistics():
    stats = TimingStats.from_samples([5.0, 1.0, 4.0, 2.0, 3.0])
    assert stats.samples == [5.0, 1.0, 4.0, 2.0, 3.0]  # round order is kept
    assert (stats.median, stats.q25, stats.q75, stats.min, stats.max) == (3.0, 2.0, 4.0, 1.0, 5.0)
    assert stats.spread == pytest.approx(2.0 / 3.0)
    single = TimingStats.from_samples([0.5])
    assert (single.median, single.q25, single.q75, single.spread) == (0.5, 0.5, 0.5, 0.0)


def test_ratio_pairs_samples_of_the_same_round():
    candidate = TimingStats.from_samples([2.0, 10.0, 3.0, 4.0, 5.0])
    baseline = TimingStats.from_samples([1.0, 10.0, 1.0, 2.0, 1.0])
    result = ratio(candidate, baseline)
    assert result.samples == [2.0, 1.0, 3.0, 2.0, 5.0]
    # The median of per-round ratios (2), not the ratio of medians (4 / 1).
    assert (result.median, result.q25, result.q75) == (2.0, 2.0, 3.0)
    assert result.spread == pytest.approx(0.5)

    steady = ratio(TimingStats.from_samples([2.0, 4.0, 6.0]), TimingStats.from_samples([1.0, 2.0, 3.0]))
    assert steady.median == 2.0 and steady.spread == 0.0


def test_ratio_refuses_unpaired_timings():
    with pytest.raises(ValueError, match="cannot pair timings of 2 and 3 rounds"):
        ratio(TimingStats.from_samples([1.0, 2.0]), TimingStats.from_samples([1.0, 2.0, 3.0]))


def test_ratio_refuses_a_zero_denominator_and_says_what_to_time():
    with pytest.raises(ValueError, match=r"non-positive sample \(0.0 s\).*time a run that takes measurable"):
        ratio(TimingStats.from_samples([1.0, 2.0]), TimingStats.from_samples([1.0, 0.0]))


# ---------------------------------------------------------------------------------------------
# Parity
# ---------------------------------------------------------------------------------------------


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 4)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.unused_scale = nn.Parameter(torch.ones(4))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.first(self.frozen(batch)))
        # Multiplying by zero gives the scale an all-zero gradient, not a missing one.
        return (self.second(hidden) + 0 * self.unused_scale).square().mean()


def _step() -> tuple[_Tiny, StepCapture]:
    torch.manual_seed(0)
    model = _Tiny()
    batch = torch.randn(5, 8)
    loss = model(batch)
    loss.backward()
    router = torch.topk(model.second.weight.sum(1), k=2).indices
    return model, capture_step(model, loss, extras={"router": router})


def test_grad_census_separates_nonzero_zero_and_none():
    model, capture = _step()
    census = grad_census(model)
    assert census == capture.census
    assert census.none == {"frozen.weight", "frozen.bias"}
    assert census.zero == {"unused_scale"}
    assert census.nonzero == {"first.weight", "first.bias", "second.weight", "second.bias"}
    assert census.category("unused_scale") == "zero"


def test_identical_steps_are_ok():
    _, baseline = _step()
    _, candidate = _step()
    report = compare_steps(baseline, candidate)
    assert report.ok
    assert report.loss_identical and report.loss_abs_diff == 0.0
    assert report.max_abs_grad_diff == 0.0 and report.worst_param is None
    assert report.grad_mismatches == [] and report.census_match and report.extras_match
    assert json.loads(json.dumps(report.to_dict()))["ok"] is True


def test_perturbed_grad_is_named():
    _, baseline = _step()
    _, candidate = _step()
    candidate.grads["second.weight"][0, 0] += 1e-3
    report = compare_steps(baseline, candidate)
    assert not report.ok
    assert report.grad_mismatches == ["second.weight"]
    assert report.worst_param == "second.weight"
    assert report.max_abs_grad_diff == pytest.approx(1e-3, rel=1e-3)
    assert report.loss_identical and report.census_match

    assert compare_steps(baseline, candidate, grad_atol=1e-2).ok


def test_missing_grad_is_a_census_mismatch():
    _, baseline = _step()
    _, candidate = _step()
    candidate.grads["first.bias"] = None
    candidate = StepCapture(
        loss=candidate.loss,
        grads=candidate.grads,
        census=GradCensus(
            nonzero=candidate.census.nonzero - {"first.bias"},
            zero=candidate.census.zero,
            none=candidate.census.none | {"first.bias"},
        ),
        extras=candidate.extras,
    )
    report = compare_steps(baseline, candidate)
    assert not report.ok and not report.census_match
    assert report.census_diff == {"nonzero->none": ["first.bias"]}
    assert "first.bias" in report.grad_mismatches


def test_detached_parameter_shows_up_in_census_diff():
    # The real failure: a module silently detached gets grad None while the loss stays finite.
    _, baseline = _step()
    torch.manual_seed(0)
    model = _Tiny()
    batch = torch.randn(5, 8)
    hidden = torch.relu(model.first(model.frozen(batch))).detach()
    loss = (model.second(hidden) + 0 * model.unused_scale).square().mean()
    loss.backward()
    report = compare_steps(baseline, capture_step(model, loss, extras=baseline.extras))
    assert report.loss_identical  # the loss cannot tell
    assert report.census_diff == {"nonzero->none": ["first.bias", "first.weight"]}
    assert not report.ok


def test_loss_differing_in_last_bit_is_not_identical():
    _, baseline = _step()
    _, candidate = _step()
    nudged = torch.nextafter(candidate.loss, torch.tensor(float("inf")))
    candidate = StepCapture(nudged, candidate.grads, candidate.census, candidate.extras)
    report = compare_steps(baseline, candidate)
    assert not report.loss_identical and not report.ok
    assert 0 < report.loss_abs_diff < 1e-6
    tolerant = compare_steps(baseline, candidate, loss_atol=1e-6)
    assert tolerant.ok and not tolerant.loss_identical


def test_changed_router_decision_fails_extras():
    _, baseline = _step()
    _, candidate = _step()
    candidate.extras["router"] = candidate.extras["router"].flip(0)
    report = compare_steps(baseline, candidate)
    assert not report.extras_match and report.extras_mismatches == ["router"]
    assert not report.ok


def test_nan_grad_against_a_number_is_an_infinite_diff():
    _, baseline = _step()
    _, candidate = _step()
    candidate.grads["second.bias"][0] = float("nan")
    report = compare_steps(baseline, candidate)
    assert report.grad_mismatches == ["second.bias"]
    assert report.to_dict()["max_abs_grad_diff"] == "inf"
    assert json.dumps(report.to_dict(), allow_nan=False)


def test_comparing_different_models_is_an_error():
    _, baseline = _step()
    other = nn.Linear(8, 4)
    other(torch.randn(2, 8)).sum().backward()
    with pytest.raises(ValueError, match="different parameters"):
        compare_steps(baseline, capture_step(other, torch.tensor(0.0)))


def test_op_counter_counts_executed_ops_only():
    from actplan.measure import OpCounter

    x = torch.randn(4, 4, requires_grad=True)
    with OpCounter() as counter:
        y = torch.mm(x, x).relu().sum()
        y.backward()
    aten = torch.ops.aten
    assert counter[aten.mm.default] == 3  # forward and two gradient GEMMs
    assert counter[aten.relu.default] == 1
    assert counter[aten.topk.default] == 0


@pytest.mark.compile
def test_meter_runs_compiled_code_only_when_asked():
    # A compiled region under a dispatch mode falls back to eager (and stays eager afterwards on
    # torch 2.13); with run_compiled the graph runs and the meter sees what it keeps. Compiled
    # with an activation budget of 0, the graph keeps only its input; eager keeps activations.
    layer = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(32, 64, requires_grad=True)

    def activations(run_compiled: bool) -> int:
        torch._dynamo.reset()  # each run compiles afresh (torch < 2.13 has no isolate_recompiles)
        compiled = torch.compile(layer, backend="aot_eager")
        with torch._functorch.config.patch(activation_memory_budget=0.0):
            compiled(x).sum().backward()  # compiles, outside the window
        with MemoryMeter(layer, run_compiled=run_compiled) as meter:
            out = compiled(x)
            meter.mark("forward_end")
            out.sum().backward()
        return meter.report().marks["forward_end"].activation_bytes

    eager_fallback, compiled_run = activations(False), activations(True)
    assert eager_fallback > 2 * 32 * 256 * FLOAT32_BYTES  # the hidden activations: eager ran
    assert compiled_run < eager_fallback / 4

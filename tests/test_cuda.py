"""What only a CUDA device can show: parity on the GPU in fp32 and bf16, the offload engine's
streams, events and pinned pool under stress, the memory meter against the allocator, and
Inductor-compiled layers. Skipped without a GPU; ``python -m bench.gpu.suite`` runs them.
"""

import copy

import pytest
import torch

import actplan
from actplan._engine.offload import OffloadedTensorMutatedError
from actplan._install.apply import find_layers
from actplan.evaluate.bench import OFFLOAD_VARIANTS, policy_config
from actplan.measure import MemoryMeter, SavedTensorMeter, capture_step, compare_steps
from actplan.units import MarkerInterval, RecomputeIntervalMap
from bench.gpu.context import deterministic_allowed
from bench.gpu.models import ModelSpec, batch_on

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
PRESETS = ("full", "attn", "matmuls", "megatron-selective")
# Big enough that every saved tensor is a real kernel's output, small enough for seconds per test.
SHAPES = {
    "dense": dict(dim=256, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=1024,
                  max_seq_len=512, seq_len=512, batch_size=2),
    "moe": dict(dim=256, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=768, n_experts=4, top_k=2,
                expert_ffn_dim=256, shared_expert_ffn_dim=128, vocab_size=1024, max_seq_len=512,
                seq_len=512, batch_size=2),
}  # fmt: skip
NOISE_FACTOR = 4.0


@pytest.fixture
def exact(record_property):
    """Deterministic algorithms for an exactness check, where torch allows it: on CUDA, cuBLAS
    needs ``CUBLAS_WORKSPACE_CONFIG`` set before it initialises (``python -m bench.gpu.suite``
    sets it). The two-run noise floor is then 0 and parity bit-exact; ops without a deterministic
    implementation only warn (``warn_only``) and keep the floor above 0. Without it, parity
    allows ``NOISE_FACTOR`` times the floor. Recorded as the test's ``deterministic`` property."""
    on = deterministic_allowed(CUDA)[0]
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if on:
        torch.use_deterministic_algorithms(True, warn_only=True)
    record_property("deterministic", on)
    try:
        yield on
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _bundle(model, dtype, **overrides):
    return ModelSpec(model, "tiny", dtype, {**SHAPES[model], **overrides}).build(CUDA)


def _step(model, batch, seed=0):
    torch.manual_seed(seed)
    loss = model(**batch)["loss"]
    loss.backward()
    captured = capture_step(model, loss)
    model.zero_grad(set_to_none=True)
    return captured


def _run(bundle, batch, config):
    model = copy.deepcopy(bundle.model)
    actplan.apply(model, config)
    return _step(model, batch)


def _offload_config(name):
    # Offload rows with every tensor eligible, so the small test model moves something.
    return {**OFFLOAD_VARIANTS[name], "offload": {**OFFLOAD_VARIANTS[name]["offload"], "min_bytes": 0}}


_FLOORS = {}


def _baseline_and_floor(model, dtype):
    """``none`` twice: the second run's difference is the noise floor (atomics in MoE
    dispatch and backward kernels can make two identical runs differ, unless deterministic
    algorithms are on: the floor is measured in the mode the test runs in)."""
    key = (model, dtype, torch.are_deterministic_algorithms_enabled())
    if key not in _FLOORS:
        bundle = _bundle(model, dtype)
        batch = batch_on(bundle, CUDA)
        first, second = _run(bundle, batch, "none"), _run(bundle, batch, "none")
        _FLOORS[key] = (bundle, batch, first, compare_steps(first, second))
    return _FLOORS[key]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("row", [*PRESETS, *OFFLOAD_VARIANTS])
def test_every_row_matches_no_checkpointing_on_cuda(model, dtype, row, exact, record_property):
    bundle, batch, baseline, floor = _baseline_and_floor(model, dtype)
    config = _offload_config(row) if row in OFFLOAD_VARIANTS else row
    report = compare_steps(
        baseline,
        _run(bundle, batch, config),
        grad_atol=NOISE_FACTOR * floor.max_abs_grad_diff,
        loss_atol=NOISE_FACTOR * floor.loss_abs_diff,
    )
    record_property("grad_floor", floor.max_abs_grad_diff)
    record_property("max_abs_grad_diff", report.max_abs_grad_diff)
    assert report.census_match, report.census_diff
    assert report.ok, (row, report.worst_param, report.max_abs_grad_diff, floor.max_abs_grad_diff)
    assert len(baseline.census.nonzero) > 0.9 * len(baseline.grads)


# ---------------------------------------------------------------------------------------------
# Offload under stress


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_offload_with_prefetch_depth_is_exact_and_moves_everything_back(prefetch, exact):
    bundle, batch, baseline, floor = _baseline_and_floor("dense", "fp32")
    model = copy.deepcopy(bundle.model)
    config = {"preset": "matmuls", "offload": {"units": "kept", "layer_input": True, "min_bytes": 0}}
    config["offload"]["prefetch"] = prefetch
    actplan.apply(model, config)
    engine = actplan.lowlevel.installed_plan(model).offload_engine
    report = compare_steps(
        baseline,
        _step(model, batch),
        grad_atol=NOISE_FACTOR * floor.max_abs_grad_diff,
        loss_atol=NOISE_FACTOR * floor.loss_abs_diff,
    )
    assert report.ok, report.worst_param
    stats = engine.snapshot()
    assert stats.bytes_offloaded > 0
    assert stats.bytes_reloaded + stats.bytes_reload_skipped == stats.bytes_offloaded
    assert stats.host_in_use_bytes == 0
    assert engine.pool.pin  # pinned on CUDA


def test_tiny_host_cap_falls_back_to_pageable_memory_and_stays_exact(exact):
    bundle, batch, baseline, floor = _baseline_and_floor("dense", "fp32")
    model = copy.deepcopy(bundle.model)
    actplan.apply(
        model, {"preset": "full", "offload": {"layer_input": True, "min_bytes": 0, "host_cap": 4096}}
    )
    with pytest.warns(UserWarning, match="host pool cap"):
        captured = _step(model, batch)
    report = compare_steps(
        baseline,
        captured,
        grad_atol=NOISE_FACTOR * floor.max_abs_grad_diff,
        loss_atol=NOISE_FACTOR * floor.loss_abs_diff,
    )
    assert report.ok, (report.worst_param, report.max_abs_grad_diff, floor.max_abs_grad_diff)
    stats = actplan.lowlevel.installed_plan(model).offload_engine.snapshot()
    assert stats.host_fallbacks > 0 and stats.host_reserved_bytes <= 4096
    assert stats.host_fallback_bytes_in_use == 0 and stats.host_in_use_bytes == 0


class _WritesAfterSave(torch.nn.Module):
    """Saves a large activation for backward, then writes to it in place at once, while the
    offload copy-out of that storage is still queued on the side stream.

    The compute stream is kept busy before the save, so the copy-out (which waits for that
    stream) cannot have started when the write is queued; ``written_in_flight`` records that
    the stream was still busy after the write, i.e. that the race really happened."""

    recompute_intervals = RecomputeIntervalMap({"mlp_act": MarkerInterval("act", "down")})

    def __init__(self, dim=4096):
        super().__init__()
        self.up = torch.nn.Linear(dim, dim, bias=False)
        self.down = torch.nn.Linear(dim, dim, bias=False)
        self.written_in_flight = False

    def forward(self, x):
        from actplan.markers import checkpoint_record

        with torch.no_grad():
            busy = x
            for _ in range(40):  # a few milliseconds of GEMMs queued ahead of the save
                busy = busy @ self.up.weight
        h = self.up(x)
        checkpoint_record("act")
        a = torch.sigmoid(h)  # autograd saves its output
        checkpoint_record("down")
        y = self.down(a)
        a.mul_(2)  # the write races the copy-out
        self.written_in_flight = not torch.cuda.current_stream().query()
        return y.square().mean()  # `a` dies here: only the engine can still see the write


def test_a_write_racing_a_copy_out_is_caught_by_the_version_counter():
    block = _WritesAfterSave().to(CUDA)
    x = torch.randn(4096, 4096, device=CUDA) / 64
    actplan.apply(
        block, {"preset": "none", "offload": {"units": ["mlp_act"], "min_bytes": 0, "skip_last": 0}}
    )
    loss = block(x)
    assert block.written_in_flight, "the GPU finished before the write was queued: no race to catch"
    with pytest.raises(OffloadedTensorMutatedError, match="in-place"):
        loss.backward()


def test_fifty_offload_steps_grow_neither_device_nor_pinned_memory():
    bundle = _bundle("dense", "bf16")
    batch = batch_on(bundle, CUDA)
    model = copy.deepcopy(bundle.model)
    config = {"preset": "matmuls", "offload": {"units": "kept", "layer_input": True, "min_bytes": 0}}
    actplan.apply(model, config)
    engine = actplan.lowlevel.installed_plan(model).offload_engine
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    allocated, peaks, reserved = [], [], []
    for _ in range(50):
        torch.cuda.reset_peak_memory_stats()
        model(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
        peaks.append(torch.cuda.max_memory_allocated())
        reserved.append(engine.pool.reserved_bytes)
        assert engine.pool.in_use_bytes == 0
    assert engine.stats.bytes_offloaded > 0
    # Step 1 builds the optimizer state and the pool; from then on nothing grows. Event-guarded
    # frees may land a little earlier or later in a step, so the peak may move, but not climb.
    assert len(set(allocated[2:])) == 1, allocated
    assert max(peaks[2:]) - min(peaks[2:]) <= 0.01 * min(peaks[2:]), peaks
    assert max(peaks[-10:]) <= max(peaks[2:12]), peaks
    assert len(set(reserved[1:])) == 1, reserved


# ---------------------------------------------------------------------------------------------
# The memory meter against the allocator


@pytest.mark.parametrize("preset", ["none", "full", "matmuls"])
def test_meter_peak_is_within_two_percent_of_max_memory_allocated(preset):
    bundle = _bundle("dense", "bf16", dim=1024, n_heads=8, ffn_dim=2816, seq_len=2048, max_seq_len=2048)
    batch = batch_on(bundle, CUDA)
    model = copy.deepcopy(bundle.model)
    actplan.apply(model, preset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        model(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # optimizer state, cuBLAS workspaces
    torch.cuda.synchronize()
    with MemoryMeter(model, optimizer) as meter:
        step()
        torch.cuda.synchronize()
    report = meter.report()
    assert report.cuda_max_allocated_bytes is not None
    off = abs(report.peak_live_bytes - report.cuda_max_allocated_bytes) / report.cuda_max_allocated_bytes
    assert off <= 0.02, (preset, report.peak_live_bytes, report.cuda_max_allocated_bytes, report.peak_label)


# ---------------------------------------------------------------------------------------------
# Inductor-compiled layers


def _layer_and_inputs(bundle):
    from actplan.planning._isolated import IsolatedLayer, capture_layer_inputs

    (_, args, kwargs) = capture_layer_inputs(bundle.model, batch_on(bundle, CUDA))[0]
    layer = find_layers(bundle.model)[0][1]
    return layer, IsolatedLayer(layer, args, kwargs, 0)


@pytest.mark.compile
@pytest.mark.parametrize("preset", ["matmuls", "full"])
def test_inductor_graph_saves_what_the_eager_plan_keeps(preset):
    bundle = _bundle("dense", "fp32", n_layers=1)
    layer, isolated = _layer_and_inputs(bundle)
    eager = copy.deepcopy(layer)
    actplan.apply(eager, preset)
    isolated.step(eager)
    with MemoryMeter(eager) as meter:
        retained = isolated.step(eager, meter)["retained"]
    torch._dynamo.reset()
    compiled = copy.deepcopy(layer)
    actplan.apply(compiled, preset)
    compiled.compile(fullgraph=True)
    isolated.step(compiled)
    args, kwargs = isolated._inputs()
    with SavedTensorMeter(bundle.model) as saved:
        compiled(*args, **kwargs)
    assert abs(saved.saved_bytes - retained) <= max(0.02 * retained, 8192), (
        preset,
        retained,
        saved.saved_bytes,
    )


@pytest.mark.compile
def test_inductor_compiled_plans_stay_within_the_compile_noise_floor():
    torch._dynamo.reset()
    bundle = _bundle("dense", "fp32")
    batch = batch_on(bundle, CUDA)

    def run(config, compile_layers):
        model = copy.deepcopy(bundle.model)
        actplan.apply(model, config)
        if compile_layers:
            for _, layer in find_layers(model):
                layer.compile(fullgraph=True)
        return _step(model, batch)

    eager = run("none", False)
    floor = compare_steps(eager, run("none", True))  # what compiling alone changes
    for preset in ("full", "matmuls"):
        report = compare_steps(
            eager,
            run(policy_config(preset), True),
            grad_atol=NOISE_FACTOR * floor.max_abs_grad_diff + 1e-7,
            loss_atol=NOISE_FACTOR * floor.loss_abs_diff + 1e-6,
        )
        assert report.ok, (preset, report.worst_param, report.max_abs_grad_diff, floor.max_abs_grad_diff)

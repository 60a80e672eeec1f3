"""Fake-tensor runs: the memory meter on a model built under ``FakeRun`` sees the same bytes as
on the real model, to the byte and at every point of the step; token counts follow the routing
assumption; what needs values is refused by name."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import actplan
from actplan.measure import (
    FakeRun,
    FakeValueError,
    MemoryMeter,
    RooflineClock,
    RoutingRecorder,
    balanced_counts,
)
from actplan.models import load_model, train_step

PRESETS = ["none", "full", "attn", "matmuls", "megatron-selective"]


def _metered_step(bundle, preset: str, device: torch.device, recorder=None):
    if preset != "none":
        actplan.apply(bundle.model, preset)
    optimizer = torch.optim.AdamW(bundle.model.parameters(), lr=1e-4)
    meter = MemoryMeter(bundle.model, optimizer)

    @contextlib.contextmanager
    def metered():
        with recorder if recorder is not None else contextlib.nullcontext(), meter:
            yield

    train_step(
        bundle.model,
        bundle.batch(0, device),
        optimizer,
        seed=0,
        context=metered(),
        after_forward=lambda loss: meter.mark("forward_end"),
    )
    return meter.report()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["dense", "moe", "mtp", "sparse"])
def test_fake_and_real_steps_hold_the_same_bytes_at_every_point(model):
    for preset in PRESETS:
        recorder = RoutingRecorder()
        real = _metered_step(load_model(model, "tiny"), preset, torch.device("cpu"), recorder)
        # The MoE model routes by values: the fake run replays the real run's token counts.
        with FakeRun(routing=recorder.counts or "balanced") as fake:
            bundle = load_model(model, "tiny")
            assert all(type(p).__name__ == "FakeTensor" for p in bundle.model.parameters())
            estimate = _metered_step(bundle, preset, fake.device)
        assert estimate.peak_bytes == real.peak_bytes, preset
        assert estimate.param_bytes == real.param_bytes > 0, preset
        assert estimate.marks["forward_end"] == real.marks["forward_end"], preset
        assert estimate.timeline == real.timeline, preset


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "size", "dtype"),
    [
        ("hf-llama", "tiny", torch.float32),
        ("hf-llama", "small", torch.float32),
        ("hf-gpt2", "tiny", torch.float32),
        ("hf-gpt2", "small", torch.float32),
        # transformers picks torch's grouped GEMM for its experts; its fake kernel takes bf16 only.
        ("hf-qwen3-moe", "tiny", torch.bfloat16),
        ("hf-qwen3-moe", "small", torch.bfloat16),
    ],
)
def test_hugging_face_models_hold_the_same_bytes_fake_and_real(model, size, dtype):
    """transformers reads position ids' values to tell packed batches; on fake tensors the run
    assumes one sequence per row (``FakeRun(packed=False)``), as the real batch is."""
    pytest.importorskip("transformers")
    import transformers.masking_utils  # noqa: F401  (imported before the run, as a user's script does)

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        for preset in ("none", "full", "matmuls"):
            recorder = RoutingRecorder()
            real = _metered_step(load_model(model, size), preset, torch.device("cpu"), recorder)
            with FakeRun(routing=recorder.counts or "balanced") as fake:
                estimate = _metered_step(load_model(model, size), preset, fake.device)
            assert estimate.peak_bytes == real.peak_bytes, preset
            assert estimate.marks["forward_end"] == real.marks["forward_end"], preset
    finally:
        torch.set_default_dtype(previous)


def test_a_fake_run_assumes_unpacked_rows_only_while_it_lasts():
    masking = pytest.importorskip("transformers.masking_utils")
    original = masking.find_packed_sequence_indices
    with FakeRun():
        assert masking.find_packed_sequence_indices is not original
    assert masking.find_packed_sequence_indices is original
    with FakeRun(packed=True):
        assert masking.find_packed_sequence_indices is original


def test_balanced_routing_gives_every_expert_an_equal_share():
    assert balanced_counts(10, 4) == [3, 3, 2, 2]
    assert balanced_counts(8, 4) == [2, 2, 2, 2]
    with FakeRun() as fake:
        ids = torch.randint(0, 4, (10,))
        counts = torch.bincount(ids, minlength=4)
        assert counts.tolist() == [3, 3, 2, 2]
        assert [len(part) for part in torch.randn(10, 2).split(counts.tolist())] == [3, 3, 2, 2]
        assert fake.bincount_calls == 1


def test_fake_moe_step_runs_under_balanced_routing():
    with FakeRun() as fake:
        bundle = load_model("moe", "tiny")
        report = _metered_step(bundle, "matmuls", fake.device)
        config = bundle.model.config
        # One count per MoE layer: the replay of a recomputed layer never routes again.
        assert fake.bincount_calls == config.n_layers - config.first_k_dense
    assert report.marks["forward_end"].activation_bytes > 0


def test_what_needs_values_is_refused_by_name():
    with FakeRun():
        x = torch.randn(8)
        with pytest.raises(FakeValueError, match=r"nonzero.*needs tensor values"):
            torch.nonzero(x > 0)
        with pytest.raises(FakeValueError, match="minlength"):
            torch.bincount(torch.randint(0, 4, (10,)))
    with FakeRun(routing=[[5, 5]]), pytest.raises(FakeValueError, match="do not fit"):
        torch.bincount(torch.randint(0, 2, (7,)), minlength=2)
    with pytest.raises(ValueError, match="routing must be"):
        FakeRun(routing="uniform")


OFFLOADS = {
    "full+offload": {"preset": "full", "offload": {"layer_input": True, "min_bytes": 0}},
    "matmuls+offload": {"preset": "matmuls", "offload": {"units": "kept", "min_bytes": 0}},
    "attn+offload, 1 layer, small pool": {
        "preset": "attn",
        "offload": {"units": "kept", "layer_input": True, "layers": [0], "min_bytes": 0, "host_cap": "4KiB"},
    },
}


def _offloaded_step(bundle, config, device, recorder=None):
    plan = actplan.apply(bundle.model, config)
    engine = plan.offload_engine
    engine.pool.trace = []
    optimizer = torch.optim.AdamW(bundle.model.parameters(), lr=1e-4)
    meter = MemoryMeter(bundle.model, optimizer)
    clock = RooflineClock("h100")
    engine.time_copies(clock.copy_timer())
    for seed in range(2):  # the second step reuses the pool's buffers; the clock times it
        timed = clock if seed else contextlib.nullcontext()
        with recorder if recorder is not None else contextlib.nullcontext(), meter, timed:
            train_step(bundle.model, bundle.batch(seed, device), optimizer, seed=seed)
    return meter.report(), engine.snapshot(), engine.pool.trace, (clock.seconds, clock.exposed_copies_seconds)


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("offload", list(OFFLOADS))
def test_offload_moves_the_same_bytes_on_fake_tensors_as_on_real_ones(model, offload):
    # The real engine decides what moves and when; on fake tensors its host buffers are fake
    # and its copies move no values, so device and host bytes follow the real run's exactly.
    recorder = RoutingRecorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the small pool's fallback warning, in both runs
        real, real_moved, real_host, real_clock = _offloaded_step(
            load_model(model, "tiny"), OFFLOADS[offload], torch.device("cpu"), recorder
        )
        with FakeRun(routing=recorder.counts or "balanced") as fake:
            estimate, moved, host, clock = _offloaded_step(
                load_model(model, "tiny"), OFFLOADS[offload], fake.device
            )
    assert real_moved.bytes_offloaded > 0
    assert estimate.timeline == real.timeline
    assert estimate.peak_bytes == real.peak_bytes
    assert host == real_host and max(host) > 0
    assert moved == real_moved
    # A real run's copies are timed as an estimate's are: the same step, the same waits.
    assert clock == pytest.approx(real_clock, rel=1e-9, abs=1e-15)
    assert real_clock[1] > 0 or "1 layer" in offload


@pytest.mark.parametrize("preset", ["none", "full", "matmuls"])
def test_torch_memtracker_agrees_on_the_fake_peak(preset):
    # An independent meter: torch's own MemTracker (a private torch API, hence the guard), on a
    # step where activations are most of the peak. It also counts module buffers (the RoPE
    # table), which the meter leaves out of the resident bytes; the peaks agree within 1%.
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    from actplan.models import build_model, loss_of

    with FakeRun() as fake:
        bundle = build_model("dense", "tiny", seq_len=64, batch_size=8)
        if preset != "none":
            actplan.apply(bundle.model, preset)
        optimizer = torch.optim.AdamW(bundle.model.parameters(), lr=1e-4)
        tracker = mem_tracker.MemTracker()
        tracker.track_external(bundle.model, optimizer)
        meter = MemoryMeter(bundle.model, optimizer)
        with tracker, meter:
            loss_of(bundle.model(**bundle.batch(0, fake.device))).backward()
            optimizer.step()
        ours = meter.report()
        theirs = next(iter(tracker.get_tracker_snapshot("peak").values()))
    assert ours.param_bytes == theirs[mem_tracker._MemRefType.PARAM]
    assert abs(theirs["Total"] / ours.peak_bytes - 1) < 0.01, (theirs, ours.peak_bytes)
    activations = theirs[mem_tracker._MemRefType.ACT] + theirs[mem_tracker._MemRefType.TEMP]
    assert activations > ours.param_bytes  # the regime the comparison is meant for


@pytest.mark.parametrize("model", ["dense", "moe", "mtp", "sparse", "hf-llama"])
def test_the_long_size_is_activation_dominated_as_llm_training_is(model):
    """The benches' ``long`` size: activations alive at the end of forward are at least twice
    the parameters, gradients and AdamW state, and two thirds of the step's peak without
    checkpointing (measured on fake tensors: nothing is computed)."""
    if model.startswith("hf-"):
        pytest.importorskip("transformers")
        import transformers.masking_utils  # noqa: F401
    with FakeRun() as fake:
        bundle = load_model(model, "long")
        optimizer = torch.optim.AdamW(bundle.model.parameters(), lr=1e-4)
        train_step(bundle.model, bundle.batch(0, fake.device), optimizer, seed=0)  # AdamW state
        with MemoryMeter(bundle.model, optimizer) as meter:
            loss = bundle.model(**bundle.batch(0, fake.device))["loss"]
            activations = meter.mark("forward_end").activation_bytes
            loss.backward()
        report = meter.report()
    static = report.param_bytes + report.optimizer_bytes + report.param_bytes  # + gradients
    assert activations >= 2 * static, (activations, static)
    assert activations >= 2 / 3 * report.peak_bytes, (activations, report.peak_bytes)

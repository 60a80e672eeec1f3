"""Offload: byte-exact round trips, gradient parity, dedup, the host pool, memory, errors."""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import actplan
from actplan._engine.host_pool import HostPool, size_class
from actplan._engine.offload import OffloadedTensorMutatedError, OffloadEngine
from actplan._engine.offload_moves import Handle, Moved
from actplan._install.apply import offload_engine  # the model's own engine slot
from actplan.config import ConfigError
from actplan.markers import checkpoint_record
from actplan.measure import MemoryMeter, capture_step, compare_steps
from actplan.models import build_model
from actplan.units import MarkerInterval, RecomputeIntervalMap

# ---------------------------------------------------------------------------------------------
# Engine round trip


@given(st.integers(min_value=0, max_value=1 << 40))
def test_size_class_covers_the_request_and_wastes_little(nbytes):
    size = size_class(nbytes)
    assert size >= nbytes
    assert size >= 512
    if nbytes > 512:
        assert size - nbytes < max(nbytes / 8, 512)
    assert size_class(size) == size


DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.float16]


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(2**30), 2**30, shape, generator=gen, dtype=dtype)


def _views(base: torch.Tensor, data) -> list[torch.Tensor]:
    """Several saved tensors on one storage: the base, transposes, slices, strided views."""
    views = [base]
    if base.dim() >= 2:
        views.append(base.transpose(0, 1))
        views.append(base[:, ::2])
    if base.dim() >= 1 and base.shape[0] > 1:
        start = data.draw(st.integers(0, base.shape[0] - 1))
        views.append(base[start:])
    if base.dim() == 3:
        views.append(base.permute(2, 0, 1))
    return views


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple),
    storages=st.integers(1, 3),
)
def test_round_trip_is_byte_exact_and_moves_each_storage_once(data, dtype, shape, storages):
    engine = OffloadEngine(min_bytes=0, host_cap_bytes=1 << 20)
    group = engine.begin_group("layer", 0)
    saved, expected, unique_bytes = [], [], 0
    for index in range(storages):
        base = _random_tensor(dtype, shape, seed=index)
        unique_bytes += base.untyped_storage().nbytes()
        for view in _views(base, data):
            saved.append(engine.offload(view, group))
            expected.append((view.clone(), view.shape, view.stride(), view.storage_offset()))
        del base, view
    moved_storages = sum(1 for s in range(storages) if _random_tensor(dtype, shape, s).numel())
    assert engine.stats.bytes_offloaded == unique_bytes
    assert engine.stats.storages_moved == moved_storages
    restored = [s.materialize() if isinstance(s, Handle) else s for s in saved]
    for tensor, (values, shape_, stride, offset) in zip(restored, expected, strict=True):
        assert tensor.dtype == values.dtype
        assert tensor.shape == shape_ and tensor.stride() == stride and tensor.storage_offset() == offset
        assert torch.equal(tensor, values)
    assert engine.stats.bytes_reloaded == unique_bytes
    assert engine.pool.in_use_bytes == 0


def test_offload_skips_parameters_buffers_small_and_subclass_tensors():
    model = nn.Linear(4, 4)
    model.register_buffer("table", torch.randn(64))
    engine = OffloadEngine(min_bytes=64)
    engine.attach(model)
    group = engine.begin_group("layer", 0)
    assert engine.offload(model.weight, group) is model.weight
    assert engine.offload(model.table, group) is model.table
    small = torch.randn(4)
    assert engine.offload(small, group) is small
    conj = torch.randn(64, dtype=torch.complex64).conj()
    assert engine.offload(conj, group) is conj
    assert engine.stats.skipped_parameters == 2
    assert engine.stats.skipped_small == 1
    assert engine.stats.skipped_other == 1
    assert engine.stats.bytes_offloaded == 0


def test_prefetch_reloads_the_layer_before_the_one_in_use():
    for prefetch, expected in ((0, [False, False, True]), (1, [False, True, True]), (2, [True, True, True])):
        engine = OffloadEngine(min_bytes=0, prefetch=prefetch)
        groups, handles = [], []
        for layer in range(3):
            group = engine.begin_group(f"layer {layer}", layer)
            handles.append(engine.offload(torch.randn(16), group))
            groups.append(group)
        handles[2].materialize()
        assert [g.loaded for g in groups] == expected, prefetch


def test_prefetch_counts_layers_not_groups():
    # Layers 0, 2 and 3 offload; layer 1 does not. Prefetch 1 reaches one layer back only.
    engine = OffloadEngine(min_bytes=0, prefetch=1)
    groups, handles = {}, {}
    for position in (0, 2, 3):
        groups[position] = engine.begin_group(f"layer {position}", position, position)
        handles[position] = engine.offload(torch.randn(16), groups[position])
    handles[3].materialize()
    assert [groups[p].loaded for p in (0, 2, 3)] == [False, True, True]
    handles[2].materialize()
    assert not groups[0].loaded
    handles[0].materialize()
    assert groups[0].loaded


def test_prefetch_loads_every_group_after_the_first_ahead_of_use():
    # Backward walks the layers from last to first; with prefetch k, only the first group used
    # may be loaded on demand. (Before the fix, a group a prefetch had loaded prefetched
    # nothing further, so every other layer was loaded on demand.)
    for prefetch in (1, 2, 3):
        engine = OffloadEngine(min_bytes=0, prefetch=prefetch)
        groups, handles = [], []
        for layer in range(6):
            group = engine.begin_group(f"layer {layer}", layer)
            handles.append(engine.offload(torch.randn(16), group))
            groups.append(group)
        on_demand = []
        for layer in reversed(range(6)):
            if not groups[layer].loaded:
                on_demand.append(layer)
            handles[layer].materialize()
            in_flight = [p for p, g in enumerate(groups) if g.loaded and p < layer]
            assert in_flight == list(range(max(layer - prefetch, 0), layer)), (prefetch, layer)
        assert on_demand == [5], prefetch


class _ManualEvent:
    """A copy that runs when the test says it completes, like a CUDA copy still in flight.
    ``done_after`` lets it finish by itself on that many-th ``query()``."""

    def __init__(self, run, done_after: int | None = None) -> None:
        self.run, self.done, self.queries, self.done_after = run, False, 0, done_after

    def query(self) -> bool:
        self.queries += 1
        if self.done_after is not None and self.queries >= self.done_after:
            self.complete()
        return self.done

    def synchronize(self) -> None:
        self.complete()

    def complete(self) -> None:
        if not self.done:
            self.run()
            self.done = True


class _DeferredCopies:
    """A copy back-end whose copy-outs read the device storage only when they complete, so a
    write racing an unfinished copy-out happens on a CPU too."""

    def __init__(self, done_after: int | None = None) -> None:
        self.events: list[_ManualEvent] = []
        self.done_after = done_after

    def copy_out(self, source, host):
        event = _ManualEvent(lambda: host.copy_(source), self.done_after)
        self.events.append(event)
        return event

    def copy_in(self, host, target, after):
        if after is not None:
            after.synchronize()
        target.copy_(host)

    def keep_until_done(self, tensor, event):
        pass

    def use(self, event):
        pass


def _deferred_engine(done_after: int | None = None) -> tuple[OffloadEngine, _DeferredCopies]:
    copies = _DeferredCopies(done_after)
    return OffloadEngine(min_bytes=0, copies=lambda device: copies), copies


def test_an_unfinished_copy_out_serves_the_device_copy_exactly():
    engine, copies = _deferred_engine()
    tensor = torch.randn(64)
    expected = tensor.clone()
    handle = engine.offload(tensor, engine.begin_group("layers.0", 0))
    del tensor
    assert not copies.events[0].done
    assert torch.equal(handle.materialize(), expected)
    assert engine.stats.bytes_reload_skipped == 64 * 4 and engine.stats.bytes_reloaded == 0


def test_a_write_racing_an_unfinished_copy_out_is_an_error_after_the_tensor_died():
    engine, _ = _deferred_engine()
    tensor = torch.randn(64)
    handle = engine.offload(tensor, engine.begin_group("layers.0 (Block)", 0))
    tensor.mul_(2)  # the copy-out has not run yet
    del tensor  # only the engine's alias is left to see the write
    with pytest.raises(OffloadedTensorMutatedError, match=r"layers\.0 \(Block\).*in-place"):
        handle.materialize()


def test_a_write_found_when_the_copy_out_finishes_during_the_reload_is_an_error():
    # The first query (at use) says "running", the second (when the reload starts) "done":
    # the host copy then holds the written value, and the reload must not hand it out.
    engine, copies = _deferred_engine(done_after=2)
    tensor = torch.randn(64)
    handle = engine.offload(tensor, engine.begin_group("layers.0", 0))
    tensor.add_(1)
    del tensor
    with pytest.raises(OffloadedTensorMutatedError, match="in-place"):
        handle.materialize()
    assert copies.events[0].done


def test_a_write_to_a_device_copy_served_in_place_of_a_reload_is_an_error():
    engine, _ = _deferred_engine()
    tensor = torch.randn(8, 8)
    view = tensor.view(-1)  # shares the storage and the version counter
    group = engine.begin_group("layers.0", 0)
    first, second = engine.offload(tensor, group), engine.offload(tensor.t(), group)
    del tensor
    first.materialize()  # reload skipped: the device storage itself is served
    view.mul_(2)
    with pytest.raises(OffloadedTensorMutatedError, match="in-place"):
        second.materialize()


def test_stream_copies_keep_every_device_buffer_from_reuse_until_their_copy_is_done(monkeypatch):
    # The CUDA back-end's wiring, on a CPU: every device tensor a side-stream copy reads or
    # writes is recorded on that stream, so the caching allocator cannot hand its memory to
    # someone else while the copy runs (e.g. a backward that aborts after a prefetch).
    from actplan._engine import host_pool

    class Stream:
        def __init__(self, device=None):
            self.device = device

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

    class Event:
        def record(self, stream):
            self.stream = stream

    recorded = []
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: recorded.append((self, stream)))
    copies = host_pool.StreamCopies(torch.device("cuda"))
    source, host, target = torch.randn(16), torch.empty(16), torch.empty(16)
    copies.copy_out(source, host)
    copies.copy_in(host, target, None)
    assert [(t is source, s) for t, s in recorded if t is source] == [(True, copies.out_stream)]
    assert [(t is target, s) for t, s in recorded if t is target] == [(True, copies.in_stream)]
    assert torch.equal(target, source)


def test_a_tensor_changed_in_place_after_offload_is_an_error():
    engine = OffloadEngine(min_bytes=0)
    tensor = torch.randn(32)
    handle = engine.offload(tensor, engine.begin_group("layers.0 (Block)", 0))
    tensor.add_(1)
    with pytest.raises(OffloadedTensorMutatedError, match=r"layers\.0 \(Block\).*in-place"):
        handle.materialize()


# ---------------------------------------------------------------------------------------------
# Host pool


def test_pool_reuses_by_size_class_and_respects_its_cap():
    pool = HostPool(cap_bytes=8192, pin=False)
    first = pool.acquire(3000)
    pool.release(first)
    again = pool.acquire(2900)
    assert again.tensor.data_ptr() == first.tensor.data_ptr() and pool.reuses == 1
    held = [again, pool.acquire(4000)]
    assert pool.reserved_bytes <= 8192
    with pytest.warns(UserWarning, match="host pool cap"):
        spill = pool.acquire(4000)
    assert not spill.pooled and pool.fallbacks == 1
    assert pool.reserved_bytes <= 8192
    for buffer in [*held, spill]:
        pool.release(buffer)
    assert pool.in_use_bytes == 0 and pool.fallback_bytes_in_use == 0
    # Idle buffers of another class are evicted to make room before falling back.
    big = pool.acquire(8000)
    assert big.pooled and pool.fallbacks == 1
    pool.release(big)
    assert pool.trim() > 0 and pool.reserved_bytes == 0


class _CollectingEvent:
    """A copy event whose wait runs a garbage collection, as any allocation inside acquire can."""

    def synchronize(self) -> None:
        gc.collect()

    def query(self) -> bool:
        return True


def test_pool_release_from_a_finalizer_inside_acquire_does_not_deadlock():
    # A real offloaded storage (Moved) in a reference cycle: only the collector frees it, and its
    # __del__ returns its host buffer to the pool. Here that collection runs while acquire holds
    # the pool's lock (waiting on a reused buffer's event), on the same thread.
    engine = OffloadEngine(min_bytes=0, pin=False)
    pool = engine.pool
    pool.release(pool.acquire(3000), _CollectingEvent())
    outcome: list[object] = []

    def acquire_during_collection() -> None:
        gc_was_enabled = gc.isenabled()
        gc.disable()  # keep the cycle alive until the collection inside acquire
        try:
            cycle: list[object] = [Moved(engine, torch.randn(1024), 4096)]
            cycle.append(cycle)
            del cycle
            outcome.append(pool.acquire(3000))
        finally:
            if gc_was_enabled:
                gc.enable()

    worker = threading.Thread(target=acquire_during_collection, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "HostPool.acquire deadlocked on a release from a finalizer"
    assert outcome and outcome[0].pooled
    # The finalizer's release was applied: only the buffer just acquired is in use, and the
    # released one is reused by the next request of its size.
    assert pool.in_use_bytes == size_class(3000)
    again = pool.acquire(4096)
    assert pool.reuses == 2 and again.pooled


# ---------------------------------------------------------------------------------------------
# Parity on the reference models

OFFLOAD_CONFIGS = {
    "full+input": {"preset": "full", "offload": {"layer_input": True, "min_bytes": 0}},
    "kept+input": {"preset": "matmuls", "offload": {"units": "kept", "layer_input": True, "min_bytes": 0}},
    "attn-kept": {"preset": "attn", "offload": {"units": ["attn_core"], "min_bytes": 0}},
    "none+units": {"preset": "none", "offload": {"units": ["attn_norm", "attn_core"], "min_bytes": 0}},
}


def _step(model, batch, seed=3):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    loss = out["loss"] if isinstance(out, dict) else out
    loss.backward()
    return capture_step(model, loss)


@pytest.fixture(scope="module", params=["dense", "moe", "sparse", "mtp"])
def reference(request):
    bundle = build_model(request.param, "tiny")
    batch = bundle.make_batch(0)
    return bundle, batch, _step(copy.deepcopy(bundle.model), batch)


@pytest.mark.parametrize("config", list(OFFLOAD_CONFIGS))
def test_offload_is_exact_on_every_reference_model(reference, config):
    bundle, batch, baseline = reference
    model = copy.deepcopy(bundle.model)
    actplan.apply(model, OFFLOAD_CONFIGS[config])
    report = compare_steps(baseline, _step(model, batch))
    assert report.loss_identical and report.max_abs_grad_diff == 0.0, (config, report.worst_param)
    assert report.census_match, report.census_diff
    stats = actplan.lowlevel.installed_plan(model).offload_engine.stats
    assert stats.bytes_offloaded > 0 and stats.bytes_reloaded == stats.bytes_offloaded
    assert stats.host_in_use_bytes == 0


@pytest.mark.parametrize("preset", ["none", "matmuls"])
def test_offloading_moe_units_is_exact_and_keeps_routing(preset):
    bundle = build_model("moe", "tiny", n_layers=3)
    batch = bundle.make_batch(0)
    baseline = _step(copy.deepcopy(bundle.model), batch)
    model = copy.deepcopy(bundle.model)
    units = (
        ["moe_router", "moe_dispatch", "moe_experts"] if preset == "none" else ["moe_router", "moe_experts"]
    )
    actplan.apply(model, {"preset": preset, "offload": {"units": units, "layers": [1, 2], "min_bytes": 0}})
    report = compare_steps(baseline, _step(model, batch))
    assert report.ok and report.max_abs_grad_diff == 0.0, report.worst_param
    assert actplan.lowlevel.installed_plan(model).offload_engine.stats.tensors_offloaded > 0


def test_offload_with_overrides_mixing_modes_is_exact():
    bundle = build_model("dense", "tiny", n_layers=4, dropout=0.1)
    batch = bundle.make_batch(0)
    baseline = _step(copy.deepcopy(bundle.model), batch)
    model = copy.deepcopy(bundle.model)
    plan = actplan.apply(
        model,
        {
            "preset": "full",
            "overrides": [{"layers": [1], "keep": ["mlp_up"]}],
            "offload": {"layers": "0-2", "layer_input": True, "min_bytes": 0},
        },
    )
    assert [layer.offload_input for layer in plan.layers] == [True, True, True, False]
    assert "offload layer input" in plan.summary()
    report = compare_steps(baseline, _step(model, batch))
    assert report.ok and report.max_abs_grad_diff == 0.0


# ---------------------------------------------------------------------------------------------
# Dedup, memory, steady state


def test_storage_shared_across_layers_is_moved_once():
    # One indexer feeds three consumer layers: its top-k ids are each consumer's input.
    bundle = build_model("sparse", "tiny", index_every=4, n_layers=4)
    batch = bundle.make_batch(0)
    model = copy.deepcopy(bundle.model)
    actplan.apply(model, {"preset": "full", "offload": {"layer_input": True, "min_bytes": 0, "skip_last": 0}})
    config = model.config
    hidden = config.batch_size * config.seq_len * config.dim * 4
    ids = config.batch_size * config.seq_len * config.index_topk * 8
    _step(model, batch)
    stats = actplan.lowlevel.installed_plan(model).offload_engine.stats
    assert stats.dedup_hits == 2
    assert stats.bytes_offloaded == 4 * hidden + ids


def _forward_end(model, batch):
    with MemoryMeter(model) as meter:
        torch.manual_seed(0)
        loss = model(**batch)["loss"]
        meter.mark("forward_end")
        loss.backward()
    return meter.report()


def test_device_tier_bytes_at_forward_end_drop_by_the_offloaded_bytes():
    bundle = build_model("dense", "tiny", n_layers=4)
    batch = bundle.make_batch(0)
    for preset, offload in (("full", {"layer_input": True}), ("matmuls", {"units": "kept"})):
        plain = copy.deepcopy(bundle.model)
        actplan.apply(plain, preset)
        offloaded = copy.deepcopy(bundle.model)
        actplan.apply(offloaded, {"preset": preset, "offload": {**offload, "min_bytes": 0}})
        before = _forward_end(plain, batch).marks["forward_end"].activation_bytes
        engine = actplan.lowlevel.installed_plan(offloaded).offload_engine
        report = _forward_end(offloaded, batch)
        moved = engine.stats.bytes_offloaded
        after = report.marks["forward_end"].activation_bytes
        assert moved > 0
        assert before - after == moved, (preset, before, after, moved)


def test_pool_is_empty_after_each_step_and_does_not_grow():
    bundle = build_model("dense", "tiny", n_layers=3)
    batch = bundle.make_batch(0)
    model = copy.deepcopy(bundle.model)
    actplan.apply(
        model, {"preset": "matmuls", "offload": {"units": "kept", "layer_input": True, "min_bytes": 0}}
    )
    engine = actplan.lowlevel.installed_plan(model).offload_engine
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    reserved = []
    for _ in range(20):
        model(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert engine.pool.in_use_bytes == 0
        reserved.append(engine.pool.reserved_bytes)
    assert reserved[0] > 0 and len(set(reserved[1:])) == 1 and reserved[-1] == reserved[0]
    assert engine.pool.acquires - engine.pool.reuses == engine.pool.acquires // 20


def test_tiny_cap_falls_back_reports_it_and_stays_exact():
    bundle = build_model("dense", "tiny", n_layers=3)
    batch = bundle.make_batch(0)
    baseline = _step(copy.deepcopy(bundle.model), batch)
    model = copy.deepcopy(bundle.model)
    actplan.apply(
        model, {"preset": "matmuls", "offload": {"units": "kept", "min_bytes": 0, "host_cap": 6000}}
    )
    with pytest.warns(UserWarning, match="host pool cap"):
        captured = _step(model, batch)
    assert compare_steps(baseline, captured).ok
    stats = actplan.lowlevel.installed_plan(model).offload_engine.snapshot()
    assert stats.host_fallbacks > 0 and stats.host_reserved_bytes <= 6000
    assert stats.host_in_use_bytes == 0 and stats.host_fallback_bytes_in_use == 0


def test_offload_that_moves_nothing_warns_once_per_layer():
    bundle = build_model("dense", "tiny", n_layers=3)
    model = copy.deepcopy(bundle.model)
    actplan.apply(model, {"preset": "full", "offload": {"layer_input": True, "min_bytes": "1GiB"}})
    with pytest.warns(UserWarning, match=r"moved nothing.*min_bytes") as caught:
        _step(model, bundle.make_batch(0))
        _step(model, bundle.make_batch(0))
    moved_nothing = [w for w in caught if "moved nothing" in str(w.message)]
    assert len(moved_nothing) == 2  # layers 0 and 1
    # Reported at the user's line (the forward call in this file), not inside the engine.
    assert {w.filename for w in moved_nothing} == {__file__}


def test_remove_restores_the_layers():
    bundle = build_model("dense", "tiny", n_layers=2)
    model = copy.deepcopy(bundle.model)
    actplan.apply(model, {"preset": "none", "offload": {"units": ["mlp_up"], "skip_last": 0}})
    assert actplan.lowlevel.installed_plan(model).offload_engine is not None
    assert all("forward" in layer.__dict__ for layer in model.layers)
    actplan.remove(model)
    assert offload_engine(model) is None
    assert not any("forward" in layer.__dict__ for layer in model.layers)


class _MutatingBlock(nn.Module):
    recompute_intervals = RecomputeIntervalMap({"mlp_act": MarkerInterval("act", "act_end")})

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.proj(x)
        checkpoint_record("act")
        y = torch.sin(h)  # saves h
        checkpoint_record("act_end")
        h.mul_(2)  # autograd refuses this in backward; offload must too
        return y.sum(), h


def test_in_place_change_of_an_offloaded_tensor_fails_like_autograd():
    block = _MutatingBlock()
    x = torch.randn(4, 64)
    loss, _ = block(x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    actplan.apply(
        block, {"preset": "none", "offload": {"units": ["mlp_act"], "min_bytes": 0, "skip_last": 0}}
    )
    loss, _ = block(x)
    with pytest.raises(OffloadedTensorMutatedError, match="in-place"):
        loss.backward()


# ---------------------------------------------------------------------------------------------
# Config errors


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"preset": "full", "offload": {"units": ["moe_experts"]}}, "does not declare"),
        ({"preset": "full", "offload": {"units": ["mlp_up"]}}, "fully recomputed.*layer_input"),
        ({"preset": "attn", "offload": {"units": ["mlp_up"]}}, "recomputes mlp_up"),
        ({"preset": "full", "offload": {"units": "kept"}}, "none of them keeps a unit"),
        ({"preset": "none", "offload": {"layer_input": True}}, "not checkpointed"),
        ({"preset": "full", "offload": {"layer_input": True, "host_cap": 100}}, "below the smallest"),
        ({"preset": "full", "offload": {}}, "move nothing"),
        ({"preset": "full", "offload": {"layer_input": True, "layers": [0], "skip_last": 0}}, "both given"),
        ({"preset": "full", "offload": {"layer_input": True, "layers": [7]}}, "out of range"),
        ({"preset": "full", "offload": {"layer_input": True, "min_bytes": "ten"}}, "byte size"),
    ],
)
def test_offload_config_errors_name_the_problem(config, message):
    model = build_model("dense", "tiny", n_layers=2).model
    with pytest.raises(ConfigError, match=message):
        actplan.apply(model, config)


def test_kept_follows_each_layer_and_skips_layers_that_keep_nothing():
    model = build_model("dense", "tiny", n_layers=3).model
    plan = actplan.plan_for(
        model,
        {"preset": "attn", "overrides": [{"layers": [0], "mode": "full"}], "offload": {"units": "kept"}},
    )
    assert [layer.describe_offload() for layer in plan.layers] == ["", "attn_core", ""]


def test_default_skips_the_last_layer_and_errors_when_that_leaves_none():
    model = build_model("dense", "tiny", n_layers=2).model
    plan = actplan.plan_for(model, {"preset": "full", "offload": {"layer_input": True}})
    assert [layer.offload_input for layer in plan.layers] == [True, False]
    one = build_model("dense", "tiny", n_layers=1).model
    with pytest.raises(ConfigError, match="skip_last: 0"):
        actplan.plan_for(one, {"preset": "full", "offload": {"layer_input": True}})


def test_compiled_offload_is_rejected_before_anything_else():
    model = build_model("dense", "tiny", n_layers=2).model
    with pytest.raises(ConfigError, match="eager"):
        actplan.parallelize(model, None, {"preset": "full", "offload": {"layer_input": True}}, compile=True)


def test_warnings_are_quiet_when_offload_moves_tensors():
    bundle = build_model("dense", "tiny", n_layers=2)
    model = copy.deepcopy(bundle.model)
    actplan.apply(model, {"preset": "full", "offload": {"layer_input": True, "min_bytes": 0}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, bundle.make_batch(0))

"""The eager engine: kept units hold only what is read, kept GEMMs and kernels run once,
routing never reruns, and the engine watches only the segments that save."""

import copy
import warnings

import pytest
import torch
from torch import nn

import actplan
from actplan._engine.boundary import apply_gradient_checkpointing
from actplan._engine.policy import IntervalPolicy
from actplan.markers import checkpoint_record
from actplan.measure import MemoryMeter, OpCounter, capture_step, compare_steps
from actplan.models import build_model, load_model
from actplan.units import MarkerInterval, RecomputeIntervalMap

aten = torch.ops.aten
PRESETS = ["full", "attn", "matmuls", "megatron-selective"]


def _step(model, batch, seed=3):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    loss = out["loss"]
    loss.backward()
    return capture_step(model, loss)


def _activation_bytes(model, batch):
    # The second step is metered: the first one teaches each layer its path.
    _step(model, batch, seed=1)
    with MemoryMeter(model) as meter:
        torch.manual_seed(2)
        loss = model(**batch)["loss"]
        meter.mark("forward_end")
        loss.backward()
    return meter.report().marks["forward_end"].activation_bytes


MODELS = ["dense", "moe", "mtp", "sparse", "hf-llama", "hf-qwen3", "hf-qwen3-moe"]


@pytest.fixture(scope="module", params=MODELS)
def reference(request):
    if request.param.startswith("hf-"):
        pytest.importorskip("transformers")
    bundle = load_model(request.param, "tiny")
    batch = bundle.make_batch(0)
    none = copy.deepcopy(bundle.model)
    return bundle, batch, _step(none, batch), _activation_bytes(none, batch)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_holds_at_most_none_and_stays_exact(reference, preset):
    bundle, batch, baseline, none_bytes = reference
    model = copy.deepcopy(bundle.model)
    actplan.apply(model, preset)
    for step in range(2):  # the learning call and a call on the learnt path
        report = compare_steps(baseline, _step(model, batch))
        assert report.loss_identical and report.max_abs_grad_diff == 0.0, (preset, step, report.worst_param)
        assert report.census_match, report.census_diff
    assert _activation_bytes(model, batch) <= none_bytes, preset
    for unit, sizes in actplan.lowlevel.installed_plan(model).held_by_unit().items():
        # What each kept unit holds is at most what autograd keeps for the same ops, give or
        # take the small integer outputs (ids, counts) held whatever reads them; routing and
        # collective outputs are held by contract.
        assert unit == "routing" or sizes["held"] <= 1.05 * sizes["autograd"], (preset, unit, sizes)


def _counts(model, batch, seed):
    torch.manual_seed(seed)
    out = model(**batch)
    with OpCounter() as backward:
        out["loss"].backward()
    return backward


@pytest.mark.parametrize("model_name", ["dense", "moe"])
def test_kept_gemms_and_attention_kernels_run_once(model_name):
    bundle = build_model(model_name, "tiny")
    batch = bundle.make_batch(0)
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    runs = {}
    for preset in ("none", "full", "attn", "matmuls"):
        model = copy.deepcopy(bundle.model)
        actplan.apply(model, preset)
        for seed in range(2):  # learnt path on the second call
            runs[preset] = _counts(model, batch, seed)
    layers = len(list(actplan.lowlevel.find_layers(bundle.model)))
    assert runs["none"][sdpa] == 0
    assert runs["full"][sdpa] == layers  # whole-layer checkpointing reruns every kernel
    assert runs["attn"][sdpa] == 0 and runs["matmuls"][sdpa] == 0
    # matmuls keeps every GEMM whose output backward or the replay reads: backward runs
    # exactly the GEMMs of no checkpointing.
    assert runs["matmuls"][aten.mm.default] == runs["none"][aten.mm.default]
    assert runs["full"][aten.mm.default] > runs["none"][aten.mm.default]


def test_routing_is_never_replayed_on_the_learnt_path():
    bundle = build_model("moe", "tiny")
    batch = bundle.make_batch(0)
    model = copy.deepcopy(bundle.model)
    actplan.apply(model, "full")
    for seed in range(3):
        backward = _counts(model, batch, seed)
        assert backward[aten.topk.default] == 0 and backward[aten.bincount.default] == 0, seed
        assert backward[aten.sort.stable] == 0 and backward[aten.mm.default] > 0


class Chain(nn.Module):
    """One kept unit whose GEMM feeds a chain of elementwise ops; backward reads only the
    chain's exp (saved by exp itself) and the GEMM's input (a layer input)."""

    recompute_intervals = RecomputeIntervalMap({"mlp_up": MarkerInterval("a", "b")})

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 32, bias=False)

    def forward(self, x):
        checkpoint_record("a")
        h = self.lin(x)
        scaled = h * 0.5 + 1.0
        e = scaled.exp()
        checkpoint_record("b")
        return e.sum()


def test_a_unit_holds_only_the_outputs_something_reads():
    torch.manual_seed(0)
    layer = Chain()
    x = torch.randn(8, 16, requires_grad=True)
    expected = torch.autograd.grad(layer(x), [x, layer.lin.weight])
    imap = Chain.recompute_intervals
    policy = IntervalPolicy(imap, imap.intervals_of(["mlp_up"]), layer_name="L")
    apply_gradient_checkpointing(layer, policy=policy, name="L")
    for _ in range(2):
        with OpCounter() as counter:
            got = torch.autograd.grad(layer(x), [x, layer.lin.weight])
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert counter[aten.mm.default] == 3  # forward once, two GEMMs in backward: never rerun
        assert counter[aten.exp.default] == 1
        report = policy.held_reports()["L"]
        (interval,) = imap.intervals_of(["mlp_up"])
        assert report.held == {interval: 8 * 32 * 4}  # the exp output, nothing else


class Branching(nn.Module):
    """A layer whose second call runs a unit the first did not."""

    recompute_intervals = RecomputeIntervalMap(
        {"qkv_proj": MarkerInterval("a", "b"), "moe_router": MarkerInterval("r", "s")}
    )

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.route = False

    def forward(self, x):
        checkpoint_record("a")
        h = torch.tanh(self.lin(x))
        checkpoint_record("b")
        if self.route:
            checkpoint_record("r")
            order = h.argsort(dim=-1)  # routing, in a unit the first call never ran
            checkpoint_record("s")
            h = h * order.float()
        return (h * h).sum()


def test_a_call_off_the_learnt_path_watches_everything_and_relearns():
    torch.manual_seed(0)
    base = Branching()
    x = torch.randn(4, 8, requires_grad=True)
    imap = Branching.recompute_intervals
    layer = copy.deepcopy(base)
    policy = IntervalPolicy(imap, imap.intervals_of(["qkv_proj"]), layer_name="L")
    apply_gradient_checkpointing(layer, policy=policy, name="L")
    for call in range(4):
        base.route = layer.route = call % 2 == 1
        want = torch.autograd.grad(base(x), [x])[0]
        with OpCounter() as counter:
            loss = layer(x)
            got = torch.autograd.grad(loss, [x])[0]
        assert torch.equal(got, want), call
        if layer.route:  # the routing call: the sort ran once, never in the replay
            assert counter[aten.sort.default] == 1, call
    assert policy.learnt.layout(layer) is not None


def test_second_backward_through_one_forward_names_the_layer():
    layer = Chain()
    imap = Chain.recompute_intervals
    apply_gradient_checkpointing(
        layer, policy=IntervalPolicy(imap, imap.intervals_of(["mlp_up"]), layer_name="L"), name="layers.4"
    )
    loss = layer(torch.randn(2, 16, requires_grad=True))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"layers\.4: backward ran a second time"):
        loss.backward()


def test_outputs_read_by_python_outside_the_dispatcher_are_held():
    # Split sizes read with .tolist() from a kept count: never a placeholder in the replay.
    class Splits(nn.Module):
        recompute_intervals = RecomputeIntervalMap({"moe_dispatch": MarkerInterval("a", "b")})

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, ids):
            checkpoint_record("a")
            counts = torch.bincount(ids, minlength=3) * 1
            checkpoint_record("b")
            parts = self.lin(x).split(counts.tolist())
            return sum(torch.tanh(p).sum() * (i + 1) for i, p in enumerate(parts))

    torch.manual_seed(0)
    layer = Splits()
    x = torch.randn(6, 4, requires_grad=True)
    ids = torch.tensor([0, 2, 2, 1, 0, 2])
    want = torch.autograd.grad(layer(x, ids), [x])[0]
    imap = Splits.recompute_intervals
    apply_gradient_checkpointing(layer, policy=IntervalPolicy(imap, imap.intervals_of(["moe_dispatch"])))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            assert torch.equal(torch.autograd.grad(layer(x, ids), [x])[0], want)


class RoutedInsideKept(nn.Module):
    """A router kept as a unit, whose top-k reads a tensor the replay recomputes anyway."""

    recompute_intervals = RecomputeIntervalMap({"moe_router": MarkerInterval("r", "e")})

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4)

    def forward(self, x):
        logits = self.gate(x)
        checkpoint_record("r")
        weights, ids = logits.softmax(-1).topk(2, dim=-1)
        checkpoint_record("e")
        return (torch.tanh(x[:, :2]) * weights * ids.float()).sum()


def test_routing_inside_a_kept_unit_never_reruns_and_parameters_are_free_inputs():
    layer = RoutedInsideKept()
    x = torch.randn(5, 8, requires_grad=True)
    want = torch.autograd.grad(layer(x), [x])[0]
    imap = RoutedInsideKept.recompute_intervals
    apply_gradient_checkpointing(layer, policy=IntervalPolicy(imap, imap.intervals_of(["moe_router"])))
    for _ in range(2):
        with OpCounter() as counter:
            got = torch.autograd.grad(layer(x), [x])[0]
        assert torch.equal(got, want)
        assert counter[aten.topk.default] == 1

    # A cheap op reading only a parameter (and a recomputed input) reruns rather than holds,
    # even when something else is held.
    class ScaleThenProj(nn.Module):
        recompute_intervals = RecomputeIntervalMap({"mlp_up": MarkerInterval("a", "b")})

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8, bias=False)
            self.scale = nn.Parameter(torch.full((8,), 2.0))

        def forward(self, x):
            checkpoint_record("a")
            h = self.lin(x)
            scaled = x * self.scale
            checkpoint_record("b")
            return (torch.tanh(h) * scaled).sum()

    layer = ScaleThenProj()
    imap = ScaleThenProj.recompute_intervals
    policy = IntervalPolicy(imap, imap.intervals_of(["mlp_up"]), layer_name="L")
    apply_gradient_checkpointing(layer, policy=policy, name="L")
    for _ in range(2):
        layer(x).backward()
    (interval,) = imap.intervals_of(["mlp_up"])
    assert policy.held_reports()["L"].held == {interval: 5 * 8 * 4}  # h only; x * scale reruns


class CastOfAKeptGemm(nn.Module):
    """A kept GEMM and a cheap op on its output, both read again by the recomputed tail."""

    recompute_intervals = RecomputeIntervalMap({"mlp_up": MarkerInterval("a", "b")})

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        checkpoint_record("a")
        h = self.lin(x)
        doubled = h.to(torch.float64)  # cheap, held because it reads the held GEMM output
        checkpoint_record("b")
        return (torch.tanh(h).double() * torch.sin(doubled)).sum()


def test_a_cheap_op_on_a_held_output_reruns_rather_than_holding_both():
    # h is held (the recomputed tanh reads it); the cast reads only h, so the replay reruns it
    # from h: holding its output too would hold both, where autograd keeps each once.
    torch.manual_seed(0)
    # h only (before: + 5 x 8 x 8)
    assert_keeping_gemm_holds(CastOfAKeptGemm(), torch.randn(5, 8, requires_grad=True), 5 * 8 * 4)


def assert_keeping_gemm_holds(layer: nn.Module, x: torch.Tensor, held_bytes: int) -> None:
    """With unit ``mlp_up`` kept, on the learning call and on the learnt path: gradients exact,
    ``held_bytes`` held, and the layer's one GEMM never rerun."""
    want = torch.autograd.grad(layer(x), [x, layer.lin.weight])
    imap = layer.recompute_intervals
    policy = IntervalPolicy(imap, imap.intervals_of(["mlp_up"]), layer_name="L")
    apply_gradient_checkpointing(layer, policy=policy, name="L")
    (interval,) = imap.intervals_of(["mlp_up"])
    for _ in range(2):  # the learning call, then the learnt path
        with OpCounter() as counter:
            got = torch.autograd.grad(layer(x), [x, layer.lin.weight])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert policy.held_reports()["L"].held == {interval: held_bytes}
        assert counter[torch.ops.aten.mm.default] == 3  # the GEMM once, its two gradients


class CastGemm(nn.Module):
    """A kept GEMM whose output only a dtype cast reads; the recomputed tail saves the cast."""

    recompute_intervals = RecomputeIntervalMap({"mlp_up": MarkerInterval("a", "b")})

    def __init__(self, gemm_dtype: torch.dtype, cast_dtype: torch.dtype):
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False, dtype=gemm_dtype)
        self.cast_dtype = cast_dtype

    def forward(self, x):
        checkpoint_record("a")
        cast = self.lin(x).to(self.cast_dtype)  # nothing references the GEMM output after this
        checkpoint_record("b")
        return torch.sin(cast).sum()


@pytest.mark.parametrize(
    "gemm_dtype,cast_dtype,held_bytes",
    [
        (torch.float32, torch.float64, 5 * 8 * 4),  # widened: hold the GEMM output, rerun the cast
        (torch.float64, torch.float32, 5 * 8 * 4),  # narrowed: hold the cast, drop the GEMM output
    ],
)
def test_a_cast_of_a_kept_gemm_holds_the_smaller_of_the_two(gemm_dtype, cast_dtype, held_bytes):
    # The GEMM output is unreferenced once cast; it is kept alive until the forward ends so that
    # holding it (and rerunning the cast) can be chosen when it is the smaller (before: the
    # widened cast, 5 x 8 x 8 bytes, was held whatever the sizes).
    torch.manual_seed(0)
    x = torch.randn(5, 8, dtype=gemm_dtype, requires_grad=True)
    assert_keeping_gemm_holds(CastGemm(gemm_dtype, cast_dtype), x, held_bytes)


def test_mutation_messages_offer_only_fixes_that_work():
    from actplan._engine.region import mutation_error

    kept = "interval [a, b) of unit 'mlp_up'"
    plain = str(mutation_error("L", "aten.add_", "aten.mm", kept))
    assert "do not keep that unit" in plain and "save_collectives" not in plain
    routed = str(mutation_error("L", "aten.add_", "aten.topk", kept, routing=True))
    assert "save_collectives: false and do not keep that unit" in routed
    seen_late = str(mutation_error("L", None, "aten.topk", None, routing=True))
    assert "was changed in place after the forward" in seen_late and "save_collectives: false" in seen_late


class ReadAfterLastSave(nn.Module):
    """A kept GEMM's output read by a rerun in-place add after the last saved tensor."""

    recompute_intervals = RecomputeIntervalMap({"attn_proj": MarkerInterval("a", "b")})

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        checkpoint_record("a")
        o = self.lin(x)  # saves x and the weight; nothing saves o
        out = x * 2
        out.add_(o)  # reruns in the replay, but after the replay has stopped
        checkpoint_record("b")
        return out


def test_an_output_read_only_after_the_last_saved_tensor_is_not_held():
    torch.manual_seed(0)
    layer = ReadAfterLastSave()
    x = torch.randn(4, 16, requires_grad=True)
    want = torch.autograd.grad(layer(x).sum(), [x])[0]
    imap = ReadAfterLastSave.recompute_intervals
    policy = IntervalPolicy(imap, imap.intervals_of(["attn_proj"]), layer_name="L")
    apply_gradient_checkpointing(layer, policy=policy, name="L")
    for _ in range(2):
        got = torch.autograd.grad(layer(x).sum(), [x])[0]
        assert torch.equal(got, want)
        assert not any(policy.held_reports()["L"].held.values())


def test_a_read_the_engine_cannot_see_gives_nan_not_a_wrong_gradient():
    # .tolist() of a float output bypasses the dispatcher: documented as unsupported, and
    # it must fail loudly. The placeholder standing in for the dropped output is NaN.
    class Scales(nn.Module):
        recompute_intervals = RecomputeIntervalMap({"mlp_up": MarkerInterval("a", "b")})

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3, bias=False)

        def forward(self, x):
            checkpoint_record("a")
            scales = self.lin(x).sum(0).tolist()
            checkpoint_record("b")
            return sum(torch.tanh(x * s).sum() for s in scales)

    layer = Scales()
    imap = Scales.recompute_intervals
    apply_gradient_checkpointing(layer, policy=IntervalPolicy(imap, imap.intervals_of(["mlp_up"])))
    x = torch.randn(5, 4, requires_grad=True)
    (grad,) = torch.autograd.grad(layer(x), [x])
    assert torch.isnan(grad).all()


class IndicesChangedInPlace(nn.Module):
    """A router whose top-k indices are changed in place after top-k saved them for its own
    backward: plain autograd refuses the backward (version counter)."""

    recompute_intervals = RecomputeIntervalMap({"moe_router": MarkerInterval("r", "e")})

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 6)

    def forward(self, x):
        logits = self.gate(x)
        checkpoint_record("r")
        weights, ids = logits.topk(2, dim=-1)
        checkpoint_record("e")
        ids.add_(1)
        return (weights * ids.float()).sum() + torch.tanh(logits).sum()


@pytest.mark.parametrize("keep", [[], ["moe_router"]], ids=["router-recomputed", "router-kept"])
def test_top_k_indices_changed_in_place_are_refused_as_autograd_refuses_them(keep):
    layer = IndicesChangedInPlace()
    x = torch.randn(5, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(layer(x), [x])
    imap = IndicesChangedInPlace.recompute_intervals
    apply_gradient_checkpointing(layer, policy=IntervalPolicy(imap, imap.intervals_of(keep), layer_name="L"))
    # Before the check, the replay handed top-k's backward the changed indices: an index error
    # (or, with values still in range, a wrong gradient).
    refused = r"L: in-place op aten\.add_\.Tensor .* aten\.topk"
    with pytest.raises(actplan.KeptTensorMutatedError, match=refused):
        torch.autograd.grad(layer(x), [x])

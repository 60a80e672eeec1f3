"""The interval policy: which ops are saved, and marker errors."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from actplan._engine.boundary import apply_gradient_checkpointing
from actplan._engine.policy import IntervalPolicy, KeptTensorMutatedError, MarkerError
from actplan._engine.region import TracedRegion
from actplan.markers import MARKER_OP, checkpoint_record
from actplan.measure import OpCounter
from actplan.units import MarkerInterval, RecomputeIntervalMap

IMAP = RecomputeIntervalMap(
    {
        "qkv_proj": MarkerInterval("proj", "act"),
        "mlp_act": MarkerInterval("act", "end"),
    }
)


def _traced(policy: IntervalPolicy) -> TracedRegion:
    # The compiled engine's region for one call, driven op by op as torch's SAC would.
    return TracedRegion(policy.plan, policy.learnt)


class Toy(nn.Module):
    recompute_intervals = IMAP

    def __init__(self, markers=("proj", "act", "end")):
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)
        self.markers = markers

    def forward(self, x):
        m = iter(self.markers)
        checkpoint_record(next(m, "proj"))
        h = self.lin(x)
        checkpoint_record(next(m, "act"))
        h = torch.tanh(h)
        checkpoint_record(next(m, "end"))
        return h.sum()


def run_toy(keep, markers=("proj", "act", "end")):
    torch.manual_seed(0)
    toy = Toy(markers)
    pol = IntervalPolicy(IMAP, IMAP.intervals_of(keep), layer_name="layers.0 (Toy)")
    apply_gradient_checkpointing(toy, policy=pol)
    x = torch.randn(4, 8, requires_grad=True)
    with OpCounter() as counter:
        toy(x).backward()
    return counter.counts


def test_kept_interval_ops_run_once_and_others_replay():
    aten = torch.ops.aten
    none_kept = run_toy([])
    assert none_kept[aten.mm.default] == 4  # forward, replay, grads of weight and input
    kept = run_toy(["qkv_proj"])
    assert kept[aten.mm.default] == none_kept[aten.mm.default] - 1
    # tanh output is what backward needs: replayed unless mlp_act is kept.
    assert run_toy(["qkv_proj"])[aten.tanh.default] == 2
    assert run_toy(["qkv_proj", "mlp_act"])[aten.tanh.default] == 1


@pytest.mark.parametrize(
    "markers,match",
    [
        (("proj", "bogus", "end"), "unknown marker 'bogus'"),
        (
            ("proj", "act", "act"),
            "unbalanced marker 'act': it ends interval \\[proj, act\\).*expected marker 'proj' before it",
        ),
        (("proj", "end", "end"), "unbalanced marker 'end'.*expected marker 'act'"),
        (("proj", "proj", "act"), "starts interval \\[proj, act\\) of unit 'qkv_proj' again"),
        (
            ("proj", "act", "proj"),
            "\\[proj, act\\) of unit 'qkv_proj' is still open when the forward "
            "returns; expected marker 'act'",
        ),
    ],
)
def test_marker_errors_name_layer_marker_and_expectation(markers, match):
    with pytest.raises(MarkerError, match=match) as err:
        run_toy(["qkv_proj"], markers)
    assert "layers.0 (Toy)" in str(err.value)


def test_wrongly_nested_markers():
    imap = RecomputeIntervalMap(
        {"attn_core": MarkerInterval("a", "c"), "attn_proj": MarkerInterval("b", "d")}
    )
    region = _traced(IntervalPolicy(imap, [], layer_name="L"))
    ctx = SelectiveCheckpointContext(is_recompute=False)
    region.decide(ctx, MARKER_OP, "a")
    region.decide(ctx, MARKER_OP, "b")
    with pytest.raises(MarkerError, match=r"wrongly nested marker 'c'.*expected marker 'd' first"):
        region.decide(ctx, MARKER_OP, "c")


def test_properly_nested_and_shared_markers_are_accepted():
    imap = RecomputeIntervalMap(
        {
            "moe_experts": MarkerInterval("a", "z"),
            "moe_act": MarkerInterval("a", "m"),
            "moe_combine": MarkerInterval("m", "z"),
        }
    )
    pol = IntervalPolicy(imap, imap.intervals_of(["moe_experts"]), layer_name="L")
    region = _traced(pol)
    ctx = SelectiveCheckpointContext(is_recompute=False)
    for marker in ("a", "m", "z"):
        region.decide(ctx, MARKER_OP, marker)
        assert region.decide(ctx, torch.ops.aten.mm.default) is (
            CheckpointPolicy.MUST_SAVE if marker != "z" else CheckpointPolicy.PREFER_RECOMPUTE
        )


def test_empty_kept_interval_warns_once():
    imap = RecomputeIntervalMap({"rope": MarkerInterval("a", "b"), "attn_core": MarkerInterval("b", "c")})
    pol = IntervalPolicy(imap, imap.intervals_of(["rope"]), layer_name="layers.2 (X)")
    ctx = SelectiveCheckpointContext(is_recompute=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        region = _traced(pol)
        for marker in ("a", "b"):
            region.decide(ctx, MARKER_OP, marker)
            region.decide(ctx, torch.ops.aten.add.Tensor)
        region.decide(ctx, MARKER_OP, "c")
        assert not caught
        for _ in range(3):
            region = _traced(pol)
            region.decide(ctx, MARKER_OP, "a")
            region.decide(ctx, MARKER_OP, "b")
    assert len(caught) == 1
    assert "layers.2 (X)" in str(caught[0].message) and "'rope' ran no op" in str(caught[0].message)
    assert caught[0].filename == __file__  # the caller's line, not the engine's


def test_routing_collective_and_device_to_host_ops_are_always_saved():
    region = _traced(IntervalPolicy(IMAP, [], layer_name="L"))
    ctx = SelectiveCheckpointContext(is_recompute=False)
    aten = torch.ops.aten
    saved = CheckpointPolicy.MUST_SAVE
    assert region.decide(ctx, aten.topk.default) is saved
    assert region.decide(ctx, aten.sort.default) is saved
    assert region.decide(ctx, aten._local_scalar_dense.default) is saved
    assert region.decide(ctx, torch.ops._c10d_functional.all_to_all_single.default) is saved
    assert region.decide(ctx, torch.ops._c10d_functional.wait_tensor.default) is saved
    assert region.decide(ctx, aten.mm.default) is CheckpointPolicy.PREFER_RECOMPUTE
    fake_gpu = torch.empty(2, device="meta")
    assert region.decide(ctx, aten._to_copy.default, fake_gpu, device=torch.device("cpu")) is saved
    cpu = torch.empty(2)
    assert region.decide(ctx, aten._to_copy.default, cpu, dtype=torch.float16) is not saved
    opted_out = _traced(IntervalPolicy(IMAP, [], layer_name="L", save_collectives=False))
    assert opted_out.decide(ctx, aten.topk.default) is CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("keep", [["moe_router"], []])
def test_an_in_place_change_of_a_saved_routing_output_names_save_collectives(keep):
    # A compiled layer's region sees the write: routing outputs are saved whatever is kept, so
    # the fix offered must be save_collectives: false (with the unit not kept), kept router or not.
    imap = RecomputeIntervalMap({"moe_router": MarkerInterval("r", "e"), "mlp_up": MarkerInterval("e", "f")})
    region = _traced(IntervalPolicy(imap, imap.intervals_of(keep), layer_name="L"))
    aten = torch.ops.aten
    values, ids = torch.rand(5, 2), torch.zeros(5, 2, dtype=torch.long)
    ctx = SelectiveCheckpointContext(is_recompute=False)
    region.decide(ctx, MARKER_OP, "r")
    ctx.op_output = (values, ids)
    assert region.decide(ctx, aten.topk.default) is CheckpointPolicy.MUST_SAVE
    ctx.op_output = None
    region.decide(ctx, MARKER_OP, "e")
    with pytest.raises(KeptTensorMutatedError) as err:
        region.decide(ctx, aten.add_.Tensor, ids, 1)
    message = str(err.value)
    assert "aten.topk" in message and "out-of-place" in message
    assert "set save_collectives: false and do not keep" in message


def test_random_and_view_ops_replay_even_when_kept():
    region = _traced(IntervalPolicy(IMAP, IMAP.intervals_of(["qkv_proj"]), layer_name="L"))
    ctx = SelectiveCheckpointContext(is_recompute=False)
    aten = torch.ops.aten
    region.decide(ctx, MARKER_OP, "proj")
    for view_op in (aten.view.default, aten.transpose.int, aten.t.default, aten._unsafe_view.default):
        assert region.decide(ctx, view_op) is CheckpointPolicy.PREFER_RECOMPUTE
    assert region.decide(ctx, aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert region.decide(ctx, aten.native_dropout.default, torch.empty(1), 0.1, True) is (
        CheckpointPolicy.PREFER_RECOMPUTE
    )
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.empty(1)
    assert region.decide(ctx, sdpa, q, q, q, 0.0) is CheckpointPolicy.MUST_SAVE
    assert region.decide(ctx, sdpa, q, q, q, dropout_p=0.2) is CheckpointPolicy.PREFER_RECOMPUTE


def test_recompute_calls_replay_forward_decisions():
    # Some torch releases ask the policy again during recompute; answers must match, whatever
    # the torch version (no version check: the answers are always logged).
    region = _traced(IntervalPolicy(IMAP, IMAP.intervals_of(["qkv_proj"]), layer_name="L"))
    fwd = SelectiveCheckpointContext(is_recompute=False)
    aten = torch.ops.aten
    sequence = [
        (MARKER_OP, ("proj",)),
        (aten.mm.default, ()),
        (MARKER_OP, ("act",)),
        (aten.mm.default, ()),
        (aten.tanh.default, ()),
    ]
    forward = [region.decide(fwd, op, *args) for op, args in sequence]
    rec = SelectiveCheckpointContext(is_recompute=True)
    replay = [region.decide(rec, op, *args) for op, args in sequence]
    assert replay == forward
    assert forward[1] is CheckpointPolicy.MUST_SAVE and forward[3] is CheckpointPolicy.PREFER_RECOMPUTE


def test_kept_intervals_must_be_declared():
    with pytest.raises(ValueError, match="not declared"):
        IntervalPolicy(IMAP, [MarkerInterval("x", "y")], layer_name="L")


class NormThenProj(nn.Module):
    """F.rms_norm decomposes on CPU into ops that add eps in place."""

    recompute_intervals = RecomputeIntervalMap(
        {"attn_norm": MarkerInterval("norm", "proj"), "qkv_proj": MarkerInterval("proj", "end")}
    )

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        checkpoint_record("norm")
        h = torch.nn.functional.rms_norm(x, (8,), self.weight)
        checkpoint_record("proj")
        y = self.lin(h)
        checkpoint_record("end")
        return y.sum()


@pytest.mark.parametrize("keep", [["qkv_proj"], ["attn_norm"], ["attn_norm", "qkv_proj"]])
def test_keeping_a_norm_that_adds_eps_in_place_is_exact(keep):
    # Nothing reads the mean F.rms_norm writes its epsilon into once the norm is done, so a
    # kept norm never holds the mutated temporary; its cheap ops read only the layer input,
    # so they rerun rather than hold their outputs.
    layer = NormThenProj()
    x = torch.randn(4, 8, requires_grad=True)
    layer(x).backward()
    expected = [x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
    x.grad = None
    layer.zero_grad(set_to_none=True)
    imap = NormThenProj.recompute_intervals
    apply_gradient_checkpointing(layer, policy=IntervalPolicy(imap, imap.intervals_of(keep), layer_name="L"))
    with OpCounter() as counter:
        layer(x).backward()
    got = [x.grad, *(p.grad for p in layer.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert counter[torch.ops.aten.rsqrt.default] == 2


class MutatesHeld(nn.Module):
    recompute_intervals = RecomputeIntervalMap({"qkv_proj": MarkerInterval("a", "b")})

    def __init__(self, inside: bool):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.inside = inside

    def forward(self, x):
        checkpoint_record("a")
        h = self.lin(x)
        if self.inside:
            h.add_(1.0)
        checkpoint_record("b")
        y = torch.tanh(h)  # recomputed: reads h in the replay
        if not self.inside:
            h.mul_(3.0)
        return (y * h).sum()


@pytest.mark.parametrize("inside", [True, False])
def test_in_place_change_of_a_held_tensor_is_a_clear_error(inside):
    layer = MutatesHeld(inside)
    imap = MutatesHeld.recompute_intervals
    pol = IntervalPolicy(imap, imap.intervals_of(["qkv_proj"]), layer_name="L")
    apply_gradient_checkpointing(layer, policy=pol, name="layers.0 (MutatesHeld)")
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(KeptTensorMutatedError, match=r"layers.0 \(MutatesHeld\)") as err:
        layer(x).backward()
    assert "unit 'qkv_proj'" in str(err.value) and "out-of-place" in str(err.value)
    if inside:  # seen in forward, where the in-place op is named
        assert "in-place op aten.add_" in str(err.value)


class InPlaceInsideKept(nn.Module):
    """F.dropout on CPU (empty_like, bernoulli_, div_) and in-place updates inside a
    kept unit, of tensors made outside it: the replay rebuilds what they write into."""

    recompute_intervals = RecomputeIntervalMap(
        {"mlp_up": MarkerInterval("up", "gap"), "mlp_act": MarkerInterval("act", "end")}
    )

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 8)

    def forward(self, x):
        checkpoint_record("up")
        h = self.up(x)
        checkpoint_record("gap")
        scaled = h * 1.5  # outside every interval: always recomputed
        checkpoint_record("act")
        scaled.mul_(2.0)
        with torch.no_grad():
            scaled.clamp_(-3.0, 3.0)
        h = torch.nn.functional.dropout(torch.tanh(scaled), 0.3, training=True)
        checkpoint_record("end")
        return self.down(h).sum()


@pytest.mark.parametrize("keep", [["mlp_act"], ["mlp_up", "mlp_act"], ["mlp_up"]])
def test_in_place_and_cpu_dropout_inside_kept_units_are_exact(keep):
    torch.manual_seed(0)
    base = InPlaceInsideKept()
    x = torch.randn(6, 8, requires_grad=True)

    def grads(layer):
        torch.manual_seed(1)
        loss = layer(x)
        loss.backward()
        out = [loss.detach(), x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
        x.grad = None
        return out

    expected = grads(copy.deepcopy(base))
    layer = copy.deepcopy(base)
    imap = InPlaceInsideKept.recompute_intervals
    apply_gradient_checkpointing(layer, policy=IntervalPolicy(imap, imap.intervals_of(keep), layer_name="L"))
    for got, want in zip(grads(layer), expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("where", ["inside", "after"])
def test_in_place_change_of_a_routing_output_replays_on_a_copy(where):
    # Routers that normalise their top-k weights in place (Mixtral's `weights /= sum`), inside
    # the router's unit or after it: the replay is served the top-k output as it was made and
    # reruns the update on it. Top-k runs once, on the learning call and on the learnt path.
    class Router(nn.Module):
        recompute_intervals = RecomputeIntervalMap({"moe_router": MarkerInterval("r", "e")})

        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 4)

        def forward(self, x):
            checkpoint_record("r")
            weights, order = self.gate(x).softmax(-1).topk(2, dim=-1)
            if where == "inside":
                weights /= weights.sum(-1, keepdim=True)
            checkpoint_record("e")
            if where == "after":
                weights /= weights.sum(-1, keepdim=True)
            return (torch.tanh(x[:, :2]) * weights * order).sum()

    torch.manual_seed(0)
    layer = Router()
    x = torch.randn(3, 4, requires_grad=True)
    want = torch.autograd.grad(layer(x), [x, layer.gate.weight])
    apply_gradient_checkpointing(
        layer, policy=IntervalPolicy(Router.recompute_intervals, (), layer_name="L"), name="layers.7 (Router)"
    )
    for _ in range(2):
        with OpCounter() as counter:
            got = torch.autograd.grad(layer(x), [x, layer.gate.weight])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert counter[torch.ops.aten.topk.default] == 1


def test_kept_interval_that_never_runs_warns_once():
    class Conditional(Toy):
        def forward(self, x):
            checkpoint_record("proj")
            h = self.lin(x)
            checkpoint_record("act")  # mlp_act's interval [act, end) opens ...
            checkpoint_record("end")  # ... and closes with no op: "ran no op"
            return h.sum()

    class Skipping(nn.Module):
        recompute_intervals = RecomputeIntervalMap(
            {"qkv_proj": MarkerInterval("a", "b"), "mlp_act": MarkerInterval("c", "d")}
        )

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            checkpoint_record("a")
            h = self.lin(x)
            checkpoint_record("b")
            return h.sum()

    imap = Skipping.recompute_intervals
    layer = apply_gradient_checkpointing(
        Skipping(),
        policy=IntervalPolicy(imap, imap.intervals_of(["mlp_act"]), layer_name="L"),
        name="layers.1",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            layer(torch.randn(2, 8, requires_grad=True)).backward()
    assert len(caught) == 1
    assert "layers.1: kept interval [c, d) of unit 'mlp_act' never ran (marker 'c' was not emitted)" in str(
        caught[0].message
    )


def test_marker_error_names_the_failing_layer_when_layers_share_a_policy():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Toy() for _ in range(3))
            self.layers[2].markers = ("proj", "act", "proj")  # leaves [proj, act) open

        def forward(self, x):
            return sum(layer(x) for layer in self.layers)

    import actplan

    model = Stack()
    plan = actplan.apply(model, {"mode": "selective", "keep": ["qkv_proj"]})
    states = [actplan._engine.boundary.checkpoint_state(m) for _, m in actplan.lowlevel.find_layers(model)]
    policies = {id(state.policy) for state in states}
    assert len(policies) == 1
    assert plan.layers[2].name == "layers.2"
    with pytest.raises(MarkerError, match=r"^layers.2 \(Toy\): unbalanced markers"):
        model(torch.randn(2, 8, requires_grad=True))


@pytest.mark.parametrize(
    ("markers", "match"),
    [
        (("proj", "act", "proj"), r"^layers.2 \(Toy\): unbalanced markers"),
        (("proj", "oops", "end"), r"^layers.2 \(Toy\): unknown marker 'oops'"),
    ],
)
def test_wrong_markers_raise_under_full_recompute_too(markers, match):
    # Full recompute decides nothing by markers; the first eager call still checks them.
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Toy() for _ in range(3))
            self.layers[2].markers = markers

        def forward(self, x):
            return sum(layer(x) for layer in self.layers)

    import actplan

    model = Stack()
    actplan.apply(model, "full")
    with pytest.raises(MarkerError, match=match):
        model(torch.randn(2, 8, requires_grad=True))
    # Once a layer's markers have passed, its later calls are not checked again: no cost.
    healthy = Stack()
    healthy.layers[2].markers = ("proj", "act", "end")
    actplan.apply(healthy, "full")
    for _ in range(2):
        healthy(torch.randn(2, 8, requires_grad=True)).backward()
    states = [actplan._engine.boundary.checkpoint_state(m) for _, m in actplan.lowlevel.find_layers(healthy)]
    assert all(state.marker_check is None for state in states)

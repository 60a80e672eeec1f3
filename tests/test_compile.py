"""Markers and the interval policy inside a layer compiled with fullgraph=True."""

import copy

import pytest
import torch

import actplan
from actplan._engine.policy import _Region
from actplan._install.apply import find_layers
from actplan.models import build_model

pytestmark = [pytest.mark.compile, pytest.mark.slow]


def test_policy_sees_markers_in_order_in_a_fullgraph_compiled_layer(monkeypatch):
    torch._dynamo.reset()
    seen = []
    original = _Region.on_marker

    def spy(self, marker):
        seen.append(marker)
        return original(self, marker)

    monkeypatch.setattr(_Region, "on_marker", spy)
    bundle = build_model("dense", "tiny", n_layers=1)
    batch = bundle.make_batch(0)
    eager = copy.deepcopy(bundle.model)
    compiled = copy.deepcopy(bundle.model)
    actplan.apply(eager, "matmuls")
    actplan.apply(compiled, "matmuls")
    for _, layer in find_layers(compiled):
        layer.compile(fullgraph=True, backend="aot_eager")

    eager_loss = eager(**batch)["loss"]
    eager_loss.backward()
    seen.clear()
    loss = compiled(**batch)["loss"]
    loss.backward()

    order = [m for m in seen if m != "actplan.layer_end"]
    expected = [
        "attn_norm",
        "qkv_proj",
        "qk_norm",
        "rope",
        "attn_core",
        "attn_proj",
        "attn_residual",
        "mlp_norm",
        "mlp_up",
        "mlp_act",
        "mlp_down",
        "mlp_residual",
    ]
    assert order[: len(expected)] == expected
    assert "actplan.layer_end" in seen
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)
    pairs = zip(eager.named_parameters(), compiled.named_parameters(), strict=True)
    for (name, p_eager), (_, p_comp) in pairs:
        torch.testing.assert_close(p_comp.grad, p_eager.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_many_selective_layers_compile_into_one_graph_per_plan():
    # One policy object per distinct plan: dynamo guards on it, so per-layer
    # objects would recompile every layer and, past the recompile limit, make
    # fullgraph=True fail outright.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    bundle = build_model("dense", "tiny", n_layers=12)
    batch = bundle.make_batch(0)
    config = {"preset": "matmuls", "overrides": [{"layers": {"every": 3}, "keep": ["attn_core"]}]}
    eager = copy.deepcopy(bundle.model)
    compiled = copy.deepcopy(bundle.model)
    actplan.apply(eager, config)
    actplan.apply(compiled, config)
    for _, layer in find_layers(compiled):
        layer.compile(fullgraph=True, backend="aot_eager")
    eager_loss = eager(**batch)["loss"]
    eager_loss.backward()
    loss = compiled(**batch)["loss"]
    loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-6)
    unique_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert unique_graphs == 2, unique_graphs


def test_inductor_compiled_selective_layers_match_eager():
    # The marker op has no outputs; it must survive Inductor's lowering too.
    torch._dynamo.reset()
    bundle = build_model("dense", "tiny", n_layers=2)
    batch = bundle.make_batch(0)
    baseline = copy.deepcopy(bundle.model)
    baseline_loss = baseline(**batch)["loss"]
    baseline_loss.backward()
    compiled = copy.deepcopy(bundle.model)
    actplan.apply(compiled, "matmuls")
    for _, layer in find_layers(compiled):
        layer.compile(fullgraph=True)
    loss = compiled(**batch)["loss"]
    loss.backward()
    torch.testing.assert_close(loss, baseline_loss)
    pairs = zip(baseline.named_parameters(), compiled.named_parameters(), strict=True)
    for (name, p_base), (_, p_comp) in pairs:
        torch.testing.assert_close(p_comp.grad, p_base.grad, msg=name)


# ---------------------------------------------------------------------------------------------
# The plan takes effect inside the compiled graph


def _eager_retained(layer, isolated, preset: str) -> int:
    from actplan.measure import MemoryMeter

    eager = copy.deepcopy(layer)
    actplan.apply(eager, preset)
    isolated.step(eager)
    with MemoryMeter(eager) as meter:
        figures = isolated.step(eager, meter)
    return figures["retained"]


def _compiled_saved(layer, isolated, preset: str, owner) -> int:
    from actplan.measure import SavedTensorMeter

    torch._dynamo.reset()
    compiled = copy.deepcopy(layer)
    actplan.apply(compiled, preset)
    compiled.compile(fullgraph=True, backend="aot_eager")
    isolated.step(compiled)  # compile first, outside the window
    args, kwargs = isolated._inputs()
    with SavedTensorMeter(owner) as meter:
        compiled(*args, **kwargs)
    return meter.saved_bytes


@pytest.mark.parametrize("preset", ["full", "matmuls", {"mode": "selective", "keep": ["mlp_up"]}])
def test_compiled_graph_saves_what_the_eager_plan_keeps(preset):
    # Eager: the memory meter's retained bytes of the layer alone (what the plan leaves alive
    # at the end of its forward). Compiled: the storages the compiled graph saves for
    # backward. Same plan, same bytes: the policy shaped the compiled graph.
    from actplan.planning._isolated import IsolatedLayer, capture_layer_inputs

    bundle = build_model("dense", "tiny", n_layers=1, batch_size=8, seq_len=32)
    (_, args, kwargs) = capture_layer_inputs(bundle.model, bundle.make_batch(0))[0]
    layer = find_layers(bundle.model)[0][1]
    isolated = IsolatedLayer(layer, args, kwargs, 0)
    eager = _eager_retained(layer, isolated, preset)
    compiled = _compiled_saved(layer, isolated, preset, bundle.model)
    # The compiled graph also saves a few small tensors (RNG and mask state, about 5 KB).
    assert abs(compiled - eager) <= max(0.02 * eager, 8192), (preset, eager, compiled)
    if preset == "full":
        none = _compiled_saved(layer, isolated, "none", bundle.model)
        assert none > 10 * compiled


def test_compiled_plan_gradients_within_the_compile_noise_floor():
    # Compiling reorders floating-point work, so compiled and eager gradients differ a
    # little even without checkpointing. That two-run difference is the noise floor; a plan
    # compiled must not add to it beyond a small factor.
    torch._dynamo.reset()
    bundle = build_model("dense", "tiny", n_layers=2, dropout=0.0)
    batch = bundle.make_batch(0)

    def grads(config, compile_layers):
        model = copy.deepcopy(bundle.model)
        if config is not None:
            actplan.apply(model, config)
        if compile_layers:
            for _, layer in find_layers(model):
                layer.compile(fullgraph=True, backend="aot_eager")
        loss = model(**batch)["loss"]
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    eager_loss, eager = grads(None, False)
    _, floor = grads(None, True)
    noise = max((floor[n] - eager[n]).abs().max().item() for n in eager)
    for config in ("full", "matmuls"):
        loss, compiled = grads(config, True)
        torch.testing.assert_close(loss, eager_loss, rtol=0, atol=1e-6)
        worst = max((compiled[n] - eager[n]).abs().max().item() for n in eager)
        assert worst <= 4 * noise + 1e-7, (config, worst, noise)


def test_recompute_uses_the_graph_its_forward_ran_with():
    # Two forwards with different shapes before either backward: the layer has two compiled
    # graphs (the second call recompiles). Each backward must replay its own forward's graph.
    torch._dynamo.reset()
    bundle = build_model("dense", "tiny", n_layers=2)
    short, long = bundle.make_batch(0), bundle.make_batch(1)
    long = {k: torch.cat([v, v], dim=1) for k, v in long.items()}

    def run(compile_layers):
        model = copy.deepcopy(bundle.model)
        actplan.apply(model, "matmuls")
        if compile_layers:
            for _, layer in find_layers(model):
                layer.compile(fullgraph=True, backend="aot_eager", dynamic=False)
        first = model(**short)["loss"]
        second = model(**long)["loss"]
        (first + second).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    eager, compiled = run(False), run(True)
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-5, atol=1e-6, msg=name)

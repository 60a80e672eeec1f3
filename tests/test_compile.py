"""Markers and the interval policy inside a layer compiled with fullgraph=True."""

import copy

import pytest
import torch

import actplan
from actplan.apply import find_layers
from actplan.models import build_model
from actplan.policy import _Region

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

"""Exactness on the dense model: loss, per-parameter gradients and the grad census.

On CPU in fp32 eager every plan must give bit-identical loss and gradients to
no checkpointing, with dropout on.
"""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actplan
from actplan._engine.boundary import checkpoint_state
from actplan._install.apply import find_layers, installed_plan
from actplan.measure import MemoryMeter, OpCounter
from actplan.models import build_model
from actplan.models.dense import DecoderLayer
from helpers import assert_exact, step_and_capture, with_plan

UNITS = [u.value for u in DecoderLayer.recompute_intervals.units]


@pytest.fixture(scope="module")
def bundle():
    return build_model("dense", "tiny", dropout=0.1, n_layers=3)


@pytest.fixture(scope="module")
def baseline(bundle):
    return step_and_capture(copy.deepcopy(bundle.model), bundle.make_batch(0))


def exact_under(bundle, baseline, config):
    """``config`` applied to a copy of the model: bit for bit the baseline's step. The copy."""
    model = with_plan(bundle.model, config)
    assert_exact(baseline, step_and_capture(model, bundle.make_batch(0)), config)
    return model


def test_baseline_census_is_meaningful(baseline):
    # Every parameter gets a non-zero gradient, so a detached path would show.
    assert len(baseline.census.nonzero) == len(baseline.grads)
    assert not baseline.census.none and not baseline.census.zero


@pytest.mark.parametrize("unit", UNITS)
def test_each_unit_kept_alone_is_exact(bundle, baseline, unit):
    exact_under(bundle, baseline, {"mode": "selective", "keep": [unit]})


@pytest.mark.parametrize("preset", ["none", "full", "attn", "matmuls", "megatron-selective"])
def test_presets_are_exact(bundle, baseline, preset):
    exact_under(bundle, baseline, preset)


def test_all_units_kept_is_exact(bundle, baseline):
    exact_under(bundle, baseline, {"mode": "selective", "keep": UNITS})


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    keep=st.lists(st.sampled_from(UNITS), unique=True),
    layers=st.one_of(
        st.just("all"),
        st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True),
        st.builds(lambda k: {"first": k}, st.integers(1, 3)),
        st.builds(lambda k: {"last": k}, st.integers(1, 3)),
        st.builds(lambda n: {"every": n}, st.integers(1, 3)),
    ),
    use_recompute=st.booleans(),
)
def test_random_unit_subsets_and_layer_selectors_are_exact(bundle, baseline, keep, layers, use_recompute):
    if use_recompute:
        config = {"mode": "selective", "recompute": keep, "layers": layers}
    elif keep:
        config = {"mode": "selective", "keep": keep, "layers": layers}
    else:  # keeping nothing is written `mode: full` (`keep: []` is refused as doing nothing)
        config = {"mode": "full", "layers": layers}
    exact_under(bundle, baseline, config)


def test_overrides_mix_modes_exactly(bundle, baseline):
    model = exact_under(
        bundle,
        baseline,
        {
            "preset": "matmuls",
            "overrides": [{"layers": [0], "mode": "full"}, {"layers": "2", "mode": "none"}],
        },
    )
    modes = [layer.mode for layer in installed_plan(model).layers]
    assert modes == ["full", "selective", "none"]


def count_ops(bundle, config):
    model = copy.deepcopy(bundle.model)
    if config is not None:
        actplan.apply(model, config)
    with OpCounter() as counter:
        step_and_capture(model, bundle.make_batch(0))
    return counter.counts


def test_recompute_happens_and_kept_ops_are_not_replayed():
    bundle = build_model("dense", "tiny", n_layers=2)  # no dropout: recompute may stop early
    aten = torch.ops.aten
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    none = count_ops(bundle, None)
    full = count_ops(bundle, "full")
    # Full recompute replays every layer's attention and (early-stopped) projections.
    assert full[sdpa] == 2 * none[sdpa]
    assert full[aten.mm.default] > none[aten.mm.default]
    # Keeping the attention core: the kernel runs once per layer, as without checkpointing.
    assert count_ops(bundle, "attn")[sdpa] == none[sdpa]
    # matmuls keeps every projection the replay needs: no extra GEMM runs at all.
    assert count_ops(bundle, "matmuls")[aten.mm.default] == none[aten.mm.default]
    qkv = count_ops(bundle, {"mode": "selective", "keep": ["qkv_proj"]})
    n_layers = 2
    assert qkv[aten.mm.default] == full[aten.mm.default] - 3 * n_layers  # q, k, v not replayed


def activation_bytes(bundle, config):
    model = copy.deepcopy(bundle.model)
    if config is not None:
        actplan.apply(model, config)
    batch = bundle.make_batch(0)
    with MemoryMeter(model) as meter:
        loss = model(**batch)["loss"]
        sample = meter.mark("forward_end")
        loss.backward()
    return sample.activation_bytes


def test_activation_bytes_are_ordered_none_matmuls_full():
    bundle = build_model("dense", "tiny", n_layers=4, vocab_size=32, seq_len=32, batch_size=2)
    none = activation_bytes(bundle, None)
    matmuls = activation_bytes(bundle, "matmuls")
    full = activation_bytes(bundle, "full")
    assert none > matmuls > full
    assert full <= bundle.activation_floor_bytes(bundle.make_batch(0)) * 1.10


def test_apply_keeps_state_dict_and_remove_restores():
    bundle = build_model("dense", "tiny")
    model = bundle.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    plan = actplan.apply(model, "matmuls")
    assert installed_plan(model) is plan
    assert list(model.state_dict()) == list(before)
    assert [id(p) for p in model.parameters()] == params
    assert all("forward" in layer.__dict__ for _, layer in find_layers(model))
    # Re-applying replaces the previous plan instead of double-wrapping.
    actplan.apply(model, "full")
    assert actplan.remove(model) == len(find_layers(model))
    assert installed_plan(model) is None
    assert all("forward" not in m.__dict__ for m in model.modules())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_kept_unit_costs_exactly_its_outputs():
    # Views are replayed, not cached: caching the projection's input reshape would
    # pin the norm output as well (one more hidden-size tensor per layer).
    bundle = build_model("dense", "tiny", n_layers=2)
    config = bundle.model.config
    tokens = config.batch_size * config.seq_len
    full = activation_bytes(bundle, "full")
    mlp_up = activation_bytes(bundle, {"mode": "selective", "keep": ["mlp_up"]})
    assert mlp_up - full == config.n_layers * 2 * tokens * config.ffn_dim * 4
    attn = activation_bytes(bundle, "attn")
    out_and_lse = tokens * config.dim * 4 + tokens * config.n_heads * 4
    assert attn - full == config.n_layers * out_and_lse


def test_layers_with_the_same_plan_share_one_policy():
    bundle = build_model("dense", "tiny", n_layers=4)
    actplan.apply(bundle.model, {"preset": "matmuls", "overrides": [{"layers": "3", "keep": ["attn_core"]}]})
    policies = [checkpoint_state(layer).policy for _, layer in find_layers(bundle.model)]
    assert policies[0] is policies[1] is policies[2]
    assert policies[3] is not policies[0]
    assert policies[0].layer_name == "DecoderLayer (layers 0-2)"
    assert policies[3].layer_name == "DecoderLayer (layers.3)"

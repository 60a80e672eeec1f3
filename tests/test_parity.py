"""Exactness: loss, per-parameter gradients and the grad census, bit for bit.

On CPU in fp32 eager every plan must give bit-identical loss and gradients to no
checkpointing, with dropout on. One suite runs over every reference model (``MODELS``): the
presets and each model's own plans (its units, its layer selectors), every parameter trained
in the baseline, no warning on the way. The dense model's property test and engine checks
follow; each model's own behaviour (routing run once, ids shared, depths trained) stays in its
test file.
"""

import copy
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import actplan
from actplan._engine.boundary import checkpoint_state
from actplan._install.apply import find_layers, installed_plan
from actplan.measure import MemoryMeter, OpCounter, StepCapture
from actplan.models import build_model, moe, mtp, sparse
from actplan.models.dense import DecoderLayer
from helpers import assert_exact, step_and_capture, with_plan

UNITS = [u.value for u in DecoderLayer.recompute_intervals.units]
PRESETS = ["none", "full", "attn", "matmuls", "megatron-selective"]


def _routing(out: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"expert_ids.{i}": ids for i, ids in enumerate(out["expert_ids"])}


@dataclass(frozen=True)
class ParityModel:
    """A reference model for the parity suite: ``build()`` gives the model and its batch;
    ``plans`` are its own plans beyond the presets; ``extras`` picks outputs compared too (a
    MoE model's routing); ``trains`` names parameters that must be among the trained."""

    build: Callable[[], tuple[nn.Module, dict[str, Any]]]
    plans: tuple[Any, ...] = ()
    extras: Callable[[dict[str, Any]], dict[str, torch.Tensor]] | None = None
    trains: tuple[str, ...] = ()
    seed: int = 5


def _built(module, *args, **kwargs) -> Callable[[], tuple[nn.Module, dict[str, Any]]]:
    def build():
        model, config = module.build(*args, **kwargs)
        return model, module.make_batch(config)

    return build


def _dense():
    bundle = build_model("dense", "tiny", dropout=0.1, n_layers=3)
    return bundle.model, bundle.make_batch(0)


_MOE_PLANS = (
    {"mode": "selective", "keep": ["moe_experts"], "layers": "1-2"},
    {"mode": "selective", "keep": ["moe_act", "moe_dispatch", "moe_combine"], "layers": "1-2"},
    {"mode": "selective", "recompute": ["moe_experts", "shared_experts"], "layers": "1-2"},
    {"preset": "matmuls", "overrides": [{"layers": "2", "keep": ["moe_router", "shared_experts"]}]},
)
_MTP_DEPTHS = [2, 3]  # find_layers: the 2 main layers, then the 2 depths

MODELS: dict[str, ParityModel] = {
    "dense": ParityModel(
        _dense,
        plans=(
            {"mode": "selective", "keep": UNITS},
            *({"mode": "selective", "keep": [unit]} for unit in UNITS),
            {
                "preset": "matmuls",
                "overrides": [{"layers": [0], "mode": "full"}, {"layers": "2", "mode": "none"}],
            },
        ),
    ),
    **{
        f"moe-{router}": ParityModel(
            _built(moe, "tiny", dropout=0.1, router=router),
            plans=_MOE_PLANS,
            extras=_routing,
            trains=("router",),
            seed=7,
        )
        for router in ("softmax", "sigmoid")
    },
    "mtp": ParityModel(
        _built(mtp, "tiny", dropout=0.1, n_layers=2, mtp_depths=2),
        plans=(
            {"mode": "full", "layers": _MTP_DEPTHS},
            {"preset": "matmuls", "layers": _MTP_DEPTHS},
            {"mode": "selective", "keep": ["mlp_up"], "layers": {"last": 2}},
        ),
        trains=("mtp.",),
    ),
    "sparse": ParityModel(
        _built(sparse, "tiny", dropout=0.1),
        plans=(
            {"mode": "selective", "keep": ["sparse_indexer"]},
            {"mode": "selective", "recompute": ["sparse_indexer"]},
        ),
        trains=(".indexer.",),
    ),
}


@dataclass(frozen=True)
class Subject:
    model: nn.Module
    batch: dict[str, Any]
    baseline: StepCapture
    step: Callable[[nn.Module], StepCapture]


@functools.cache
def subject(name: str) -> Subject:
    """``MODELS[name]`` built, with its no-checkpoint step (built once per test process)."""
    spec = MODELS[name]
    model, batch = spec.build()
    step = functools.partial(step_and_capture, batch=batch, seed=spec.seed, extras=spec.extras)
    return Subject(model, batch, step(copy.deepcopy(model)), step)


@pytest.mark.parametrize("name", MODELS)
def test_the_baseline_trains_every_parameter(name):
    # Every parameter gets a non-zero gradient, so a path detached under a plan would show.
    census = subject(name).baseline.census
    assert len(census.nonzero) == len(subject(name).baseline.grads) and not census.none and not census.zero
    for part in MODELS[name].trains:
        assert any(part in param for param in census.nonzero), part


@pytest.mark.parametrize(
    ("name", "plan"),
    [(name, plan) for name, spec in MODELS.items() for plan in (*PRESETS, *spec.plans)],
    ids=lambda value: value if isinstance(value, str) else str(value).replace(" ", ""),
)
def test_every_plan_is_exact_on_every_model(name, plan):
    s = subject(name)
    model = with_plan(s.model, plan)
    with warnings.catch_warnings():
        # Nothing to warn about: a unit no layer ran, a layer whose markers never came (the
        # sparse model's consumers share the source layers' class but never run the indexer).
        warnings.simplefilter("error")
        candidate = s.step(model)
    assert_exact(s.baseline, candidate, plan)


# ---------------------------------------------------------------------------------------------
# The dense model: random plans, layer selectors, what a plan replays and holds
# ---------------------------------------------------------------------------------------------


def exact_under(config):
    """``config`` applied to a copy of the dense model: bit for bit its baseline step. The copy."""
    dense = subject("dense")
    model = with_plan(dense.model, config)
    assert_exact(dense.baseline, dense.step(model), config)
    return model


@settings(max_examples=20, deadline=None)
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
def test_random_unit_subsets_and_layer_selectors_are_exact(keep, layers, use_recompute):
    if use_recompute:
        config = {"mode": "selective", "recompute": keep, "layers": layers}
    elif keep:
        config = {"mode": "selective", "keep": keep, "layers": layers}
    else:  # keeping nothing is written `mode: full` (`keep: []` is refused as doing nothing)
        config = {"mode": "full", "layers": layers}
    exact_under(config)


def test_overrides_mix_modes_exactly():
    model = exact_under(MODELS["dense"].plans[-1])
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

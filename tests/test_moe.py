"""The MoE reference model, single process: routing never recomputed, the dense layers, ties,
the aux loss (every plan's exactness, routing compared: ``test_parity.py``)."""

import copy
from functools import partial

import pytest
import torch

import actplan
from actplan._install.apply import find_layers, installed_plan
from actplan.measure import OpCounter, compare_steps
from actplan.models import moe
from helpers import step_and_capture

PRESETS = ["none", "full", "attn", "matmuls", "megatron-selective"]
ROUTING_OPS = (torch.ops.aten.topk.default, torch.ops.aten.sort.stable, torch.ops.aten.bincount.default)


def routing(out):
    return {f"expert_ids.{i}": ids for i, ids in enumerate(out["expert_ids"])}


train_step = partial(step_and_capture, seed=7, extras=routing)  # routing compared too


@pytest.fixture(scope="module", params=["softmax", "sigmoid"])
def bundle(request):
    model, config = moe.build("tiny", dropout=0.1, router=request.param)
    batch = moe.make_batch(config)
    return model, batch, train_step(copy.deepcopy(model), batch)


def run(bundle, config):
    model, batch, baseline = bundle
    candidate = copy.deepcopy(model)
    actplan.apply(candidate, config)
    with OpCounter() as counter:
        capture = train_step(candidate, batch)
    return compare_steps(baseline, capture), counter, candidate


def test_layers_dense_first_then_moe():
    model, config = moe.build("tiny")
    classes = [type(layer).__name__ for _, layer in find_layers(model)]
    assert classes == ["DecoderLayer"] * config.first_k_dense + ["MoEDecoderLayer"] * (
        config.n_layers - config.first_k_dense
    )


@pytest.mark.parametrize("config", PRESETS[1:])
def test_routing_ops_run_once_under_every_plan(bundle, config):
    # Forward only: the replay takes top-k, the expert sort and the token counts from
    # the cache, so it cannot route differently.
    _, counts_none, _ = run(bundle, "none")
    _, counts, candidate = run(bundle, config)
    for op in ROUTING_OPS:
        assert counts[op] == counts_none[op] > 0, op
    assert all(layer.routing_saved for layer in installed_plan(candidate).layers[1:])


def test_save_collectives_false_lets_full_recompute_reroute(bundle):
    _, counts_none, _ = run(bundle, "none")
    report, counts, candidate = run(bundle, {"mode": "full", "save_collectives": False})
    assert report.ok  # deterministic here, but the router ran again
    assert counts[torch.ops.aten.topk.default] == 2 * counts_none[torch.ops.aten.topk.default]
    assert not any(layer.routing_saved for layer in installed_plan(candidate).layers)


def test_dense_full_layers_stay_plain_checkpoints_unless_asked():
    model, _ = moe.build("tiny")
    plan = actplan.plan_for(model, "full")
    assert [layer.routing_saved for layer in plan.layers] == [False, True, True]
    plan = actplan.plan_for(model, {"mode": "full", "save_collectives": True})
    assert all(layer.routing_saved for layer in plan.layers)


def test_exact_score_ties_route_identically_in_forward_and_recompute():
    # A zero router makes every expert score equal: top-k then breaks ties, and a
    # recomputed router could break them differently; the saved one cannot.
    model, config = moe.build("tiny")
    with torch.no_grad():
        for _, layer in find_layers(model):
            if hasattr(layer, "moe"):
                layer.moe.router.weight.zero_()
    batch = moe.make_batch(config)
    baseline = train_step(copy.deepcopy(model), batch)
    assert all((ids == ids[0]).all() for ids in baseline.extras.values()), "scores must tie"
    for plan in ("full", "matmuls", {"mode": "selective", "keep": ["moe_experts"], "layers": "1-2"}):
        candidate = copy.deepcopy(model)
        actplan.apply(candidate, plan)
        report = compare_steps(baseline, train_step(candidate, batch))
        assert report.ok, (plan, report.worst_param, report.extras_mismatches)


def test_aux_loss_reaches_the_router():
    model, config = moe.build("tiny", aux_loss_coef=1.0)
    batch = moe.make_batch(config)
    out = model(**batch)
    out["aux_loss"].backward()
    router = find_layers(model)[1][1].moe.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_a_rank_routing_its_own_sequence_shard_scales_its_balance_loss():
    # Under sequence parallelism (RoutesItsOwnTokens sets token_shards to the TP degree) each
    # rank's balance loss is its shard's, and DTensor sums the router's gradient over the
    # shards: each rank's share is divided by the shards, so the router trains on their mean.
    model, config = moe.build("tiny", aux_loss_coef=1.0, simulated_ep=2)
    batch = moe.make_batch(config)
    whole = model(**batch)["aux_loss"]
    for _, layer in find_layers(model)[1:]:
        layer.moe.experts.token_shards = 2
    assert model(**batch)["aux_loss"].item() == pytest.approx(whole.item() / 2, rel=1e-6)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="top_k"):
        moe.build("tiny", top_k=9)
    with pytest.raises(ValueError, match="router must be"):
        moe.build("tiny", router="relu")


def test_parallelize_refuses_expert_layouts_it_cannot_shard_naming_the_fix():
    # Experts over 2 of 4 ranks (on torch's fake process group): parallelize shards each expert
    # over the ranks holding the same ones, inside their layer, which it finds by the layout a
    # 2-D mesh gives (consecutive blocks); another grouping, experts in no layer, a mesh of TP
    # alone (no FSDP), compiled layers or a group that does not divide the ranks are refused.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from actplan.planning._rank_step import fake_world

    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))
        strided = dist.new_group([0, 2])
        model, _ = moe.build("tiny", ep_group=strided)
        with pytest.raises(ValueError, match=r"holds ranks \[0, 2\], where parallelize expects \[0, 1\]"):
            actplan.parallelize(model, mesh, "full")
        blocks = init_device_mesh("cpu", (2, 2), mesh_dim_names=("expert_dp", "ep"))["ep"].get_group()
        model, _ = moe.build("tiny", ep_group=blocks)
        with pytest.raises(ValueError, match="would break the compiled layer's one graph"):
            actplan.parallelize(model, mesh, "full", compile=True)
        model, config = moe.build("tiny", ep_group=blocks)
        model.stray = moe.GroupedExperts(config, model.expert_group)  # in no layer
        with pytest.raises(ValueError, match="GroupedExperts sits in no layer parallelize shards"):
            actplan.parallelize(model, mesh, "full")
        tp_alone = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        model, _ = moe.build("tiny", ep_group=blocks)
        with pytest.raises(ValueError, match="a mesh of tensor parallelism alone has no FSDP"):
            actplan.parallelize(model, tp_alone, "full")
        three = dist.new_group([0, 1, 2])
        model, _ = moe.build("tiny", n_experts=3, top_k=1, ep_group=three)
        with pytest.raises(ValueError, match="group 3, of 4 in all"):
            actplan.parallelize(model, mesh, "full")

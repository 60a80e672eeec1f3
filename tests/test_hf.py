"""Hugging Face decoder models, unmodified: parity, grad census, memory ordering, state_dict."""

from __future__ import annotations

import copy

import pytest
import torch

import actplan
from actplan.config import ConfigError
from actplan.integrations import hf
from actplan.measure import MemoryMeter, capture_step, compare_steps

transformers = pytest.importorskip("transformers")

SHAPES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def tiny(kind: str):
    torch.manual_seed(0)
    SHAPES["use_cache"] = False
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPES))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPES))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPES, head_dim=16))
    return model.train()


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def step(model):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return capture_step(model, loss)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def reference(request):
    model = tiny(request.param)
    return request.param, model, step(copy.deepcopy(model))


@pytest.mark.parametrize("config", ["full", "attn", "matmuls", {"mode": "selective", "keep": ["qkv_proj"]}])
def test_presets_are_exact_on_unmodified_models(reference, config):
    kind, model, baseline = reference
    candidate = copy.deepcopy(model)
    plan = actplan.apply(candidate, config)
    assert len(plan.layers) == 3
    report = compare_steps(baseline, step(candidate))
    assert report.loss_identical and report.max_abs_grad_diff == 0.0, (kind, config, report.worst_param)
    assert report.census_match and len(baseline.census.nonzero) == len(baseline.grads)


def tiny_moe(norm_topk_prob: bool):
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        **SHAPES,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        norm_topk_prob=norm_topk_prob,
    )
    return transformers.Qwen3MoeForCausalLM(config).train()


@pytest.mark.parametrize("config", ["full", "attn", "matmuls"])
def test_qwen3_moe_is_exact_with_routing_saved(config):
    model = tiny_moe(norm_topk_prob=False)
    baseline = step(copy.deepcopy(model))
    plan = actplan.apply(model, config)
    assert [u.value for u in plan.layers[1].kept_units if u.value.startswith("moe")] == (
        ["moe_router", "moe_experts"] if config == "matmuls" else []
    )
    assert plan.layers[1].routing_saved
    report = compare_steps(baseline, step(model))
    assert report.ok and report.max_abs_grad_diff == 0.0, report.worst_param


def test_in_place_router_normalisation_needs_recomputed_routing():
    model = tiny_moe(norm_topk_prob=True)
    baseline = step(copy.deepcopy(model))
    actplan.apply(model, "full")
    with pytest.raises(actplan.KeptTensorMutatedError, match="save_collectives: false"):
        step(model)
    actplan.apply(model, {"preset": "attn", "save_collectives": False})
    assert compare_steps(baseline, step(model)).ok


def test_units_follow_the_architecture():
    qwen3 = actplan.plan_for(tiny("qwen3"), "megatron-selective").layers[0]
    llama = actplan.plan_for(tiny("llama"), "megatron-selective").layers[0]
    assert "qk_norm" in [u.value for u in qwen3.kept_units]
    assert "qk_norm" not in [u.value for u in llama.kept_units]
    assert "attn_core" not in [u.value for u in llama.kept_units]


def _forward_end_bytes(model, config) -> int:
    model = copy.deepcopy(model)
    actplan.apply(model, config)
    with MemoryMeter(model) as meter:
        loss = model(input_ids=IDS, labels=IDS).loss
        meter.mark("forward_end")
        loss.backward()
    return meter.report().marks["forward_end"].activation_bytes


def test_memory_ordering():
    model = tiny("llama")
    full, matmuls, none = (_forward_end_bytes(model, c) for c in ("full", "matmuls", "none"))
    assert full < matmuls < none


def test_state_dict_and_save_pretrained_are_unaffected(tmp_path):
    model = tiny("qwen3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    actplan.apply(model, "matmuls")
    assert list(model.state_dict()) == list(before)
    model.save_pretrained(tmp_path)
    reloaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in before.items())
    actplan.remove(model)
    assert not hf.is_declared(model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert "recompute_intervals" not in model.model.layers[0].__dict__


def test_the_kv_cache_is_turned_off_while_a_plan_is_installed():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SHAPES, "use_cache": True})).train()
    baseline = step(copy.deepcopy(model))
    with pytest.warns(UserWarning, match="use_cache = False"):
        actplan.apply(model, {"mode": "selective", "keep": ["qkv_proj"]})
    assert model.config.use_cache is False
    assert compare_steps(baseline, step(model)).ok
    actplan.remove(model)
    assert model.config.use_cache is True


def test_hf_gradient_checkpointing_and_actplan_together_is_an_error():
    model = tiny("llama")
    model.gradient_checkpointing_enable()
    with pytest.raises(ConfigError, match="gradient_checkpointing_disable"):
        actplan.apply(model, "full")
    model.gradient_checkpointing_disable()
    actplan.apply(model, "full")


def test_unknown_decoder_layers_are_named():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    with pytest.raises(ConfigError, match=r"declares no checkpointable layers|no decoder layer"):
        actplan.apply(transformers.GPT2LMHeadModel(config), "full")


def test_verify_passes_on_a_tiny_llama():
    from actplan.models import ModelBundle
    from actplan.verify import verify

    model = tiny("llama")
    bundle = ModelBundle("llama", "tiny", model, lambda seed: {"input_ids": IDS, "labels": IDS}, "tiny llama")
    report = verify(bundle, "matmuls", steps=2, check_recompute=True)
    assert report.ok, report.problems()


def test_cli_verify_passes_on_the_reference_llama(capsys):
    from actplan.cli import main

    assert main(["verify", "--model", "hf-llama", "--config", "matmuls", "--steps", "2", "--quiet"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_unknown_reference_kind_is_named():
    from actplan.models import load_model

    with pytest.raises(ValueError, match="kinds: llama, qwen2, qwen3, qwen3-moe"):
        load_model("hf-gpt9", "tiny")


def test_bench_runs_the_reference_llama():
    from actplan.bench import run_bench

    result = run_bench("hf-llama", "tiny", ("none", "full", "matmuls"), repeats=1, warmup=0, reference=False)
    assert all(row.parity_ok for row in result.rows)
    rows = {row.name: row for row in result.rows}
    assert rows["full"].activation_bytes < rows["none"].activation_bytes

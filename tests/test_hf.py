"""Hugging Face decoder models, unmodified: parity, grad census, memory ordering, state_dict."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import actplan
from actplan._install.apply import offload_engine  # the model's own engine slot
from actplan.config import ConfigError
from actplan.integrations import hf
from actplan.measure import MemoryMeter, OpCounter, capture_step, compare_steps
from actplan.models import hf as hf_models
from actplan.units import MarkerInterval
from doc_blocks import DOCS, block_with, run_trainer_example

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


# ---------------------------------------------------------------------------------------------
# Every reference architecture: built-in or derived layout, exact, and below no checkpointing

BUILT_IN = {"llama", "mistral", "qwen2", "qwen3", "qwen3-moe"}
OFFLOAD = {
    "preset": "matmuls",
    "offload": {"units": "kept", "layer_input": True, "min_bytes": 0, "skip_last": 0},
}
CONFIGS = {
    "full": "full",
    "attn": "attn",
    "matmuls": "matmuls",
    "megatron-selective": "megatron-selective",
    "offload": OFFLOAD,
}


def _step_batch(model, batch, metered=False):
    # A training step; metered, also the activation bytes live at the end of the forward.
    torch.manual_seed(3)
    model.zero_grad(set_to_none=True)
    if not metered:
        loss = model(**batch).loss
        loss.backward()
        return capture_step(model, loss), None
    with MemoryMeter(model) as meter:
        loss = model(**batch).loss
        meter.mark("forward_end")
        loss.backward()
    return capture_step(model, loss), meter.report().marks["forward_end"].activation_bytes


@pytest.fixture(scope="module", params=hf_models.REFERENCE_KINDS)
def architecture(request):
    model, make_batch = hf_models.reference_model(request.param, "tiny", layers=2)
    batch = make_batch(0)
    baseline, none_bytes = _step_batch(copy.deepcopy(model), batch, metered=True)
    return request.param, model, batch, baseline, none_bytes


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_architecture_is_exact_and_holds_less_than_none(architecture, config):
    kind, model, batch, baseline, none_bytes = architecture
    candidate = copy.deepcopy(model)
    plan = actplan.apply(candidate, CONFIGS[config])
    assert len(plan.checkpointed) == 2
    sources = {layer.source for layer in hf.find_decoder_layers(candidate)}
    assert sources == ({"built-in"} if kind in BUILT_IN else {"derived"}), (kind, sources)
    for call in range(2):  # the learning call, then the learnt path (metered)
        captured, held = _step_batch(candidate, batch, metered=call == 1)
        report = compare_steps(baseline, captured)
        assert report.loss_identical and report.max_abs_grad_diff == 0.0, (kind, config, report.worst_param)
        assert report.census_match and len(baseline.census.nonzero) == len(baseline.grads), report.census_diff
    assert held < none_bytes, (kind, config, held, none_bytes)
    if config == "offload":
        stats = actplan.lowlevel.installed_plan(candidate).offload_engine.stats
        assert stats.bytes_offloaded > 0 and stats.bytes_reloaded == stats.bytes_offloaded


def _units(kind: str) -> dict[str, list]:
    model, _ = hf_models.reference_model(kind, "tiny", layers=2)
    (_, layer), *_ = hf.decoder_layers(model)
    return {unit.value: list(spans) for unit, spans in hf.known_interval_map(layer).items()}


def test_derived_layouts_read_names_in_context():
    gpt2 = _units("gpt2")
    # c_proj is the attention output under the attention module, the MLP down projection elsewhere.
    assert gpt2["attn_proj"] == [MarkerInterval("attn.c_proj:enter", "attn.c_proj:exit")]
    assert gpt2["mlp_down"] == [MarkerInterval("mlp.c_proj:enter", "mlp.c_proj:exit")]
    assert gpt2["attn_core"] == [MarkerInterval("attn:projected", "attn.c_proj:enter")]
    # Gemma 2: a pre-MLP norm of its own, so post_attention_layernorm is a post-norm.
    gemma2 = _units("gemma2")
    assert gemma2["attn_post_norm"][0].start == "post_attention_layernorm:enter"
    assert gemma2["mlp_norm"][0].start == "pre_feedforward_layernorm:enter"
    assert gemma2["mlp_post_norm"][0].start == "post_feedforward_layernorm:enter"
    # OLMo 2: no pre-attention norm, so both norms are post-norms.
    olmo2 = _units("olmo2")
    assert "attn_norm" not in olmo2 and "mlp_norm" not in olmo2 and "qk_norm" in olmo2
    assert olmo2["attn_post_norm"][0].start == "post_attention_layernorm:enter"
    # Llama-style naming: post_attention_layernorm is the norm before the MLP.
    assert _units("phi3")["mlp_norm"][0].start == "post_attention_layernorm:enter"
    assert [i.start for i in _units("phi3")["mlp_up"]] == ["mlp.gate_up_proj:enter"]
    # MLA projections and latent norms; the shared experts beside the routed ones.
    deepseek = [u for u in _units("deepseek-v3")]
    assert {"qkv_proj", "qk_norm", "mlp_up"} <= set(deepseek)
    qwen2_moe = _units("qwen2-moe")
    assert [i.start for i in qwen2_moe["shared_experts"]] == [
        "mlp.shared_expert:enter",
        "mlp.shared_expert_gate:enter",
    ]
    assert [i.start for i in qwen2_moe["moe_router"]] == ["mlp.gate:enter"]


UNSEEN = {
    # Families with no built-in layout and no reference model: other names for the same roles.
    "gpt-neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**SHAPES_2)),
    "gpt-j": lambda: transformers.GPTJForCausalLM(transformers.GPTJConfig(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64)),
    "opt": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
        word_embed_proj_dim=64, max_position_embeddings=64)),
    "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **SHAPES_2, num_experts=4, num_experts_per_tok=2)),
}  # fmt: skip
SHAPES_2 = {**SHAPES, "num_hidden_layers": 2, "use_cache": False}


@pytest.mark.parametrize("family", list(UNSEEN))
def test_derivation_holds_on_families_it_has_no_table_for(family):
    # GPT-J registers k, v, q in that order (the attention core starts after the last of them
    # to run), OPT has its MLP directly on the layer, OLMoE routes with QK-norm.
    torch.manual_seed(0)
    model = UNSEEN[family]().train()
    model.config.use_cache = False
    baseline = step(copy.deepcopy(model))
    plan = actplan.apply(model, "matmuls")
    assert all(layer.mode == "selective" and layer.kept_units for layer in plan.layers)
    for _ in range(2):
        report = compare_steps(baseline, step(model))
        assert report.ok and report.max_abs_grad_diff == 0.0, (family, report.worst_param)


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


def test_moe_presets_keep_the_expert_units_and_save_routing():
    model = tiny_moe(norm_topk_prob=False)
    for config in ("full", "attn", "matmuls"):
        plan = actplan.plan_for(model, config)
        assert [u.value for u in plan.layers[1].kept_units if u.value.startswith("moe")] == (
            ["moe_router", "moe_experts"] if config == "matmuls" else []
        )
        assert plan.layers[1].routing_saved


@pytest.mark.parametrize("config", ["full", "matmuls"])
def test_routers_that_normalise_top_k_weights_in_place_are_exact(config):
    # norm_topk_prob=True divides top-k's output in place (Mixtral's router always does): the
    # routing output is held from before the write, and top-k never reruns in backward.
    model = tiny_moe(norm_topk_prob=True)
    baseline = step(copy.deepcopy(model))
    actplan.apply(model, config)
    for _ in range(2):
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=IDS, labels=IDS).loss
        with OpCounter() as backward:
            loss.backward()
        assert compare_steps(baseline, capture_step(model, loss)).ok
        assert backward[torch.ops.aten.topk.default] == 0


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


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("config", ["matmuls", OFFLOAD], ids=["matmuls", "offload"])
def test_torch_save_of_a_planned_hf_model_loads_it_declared_without_the_plan(kind, config, tmp_path):
    model, make_batch = hf_models.reference_model(kind, "tiny", layers=2)
    batch = make_batch(0)
    baseline, _ = _step_batch(copy.deepcopy(model), batch)
    actplan.apply(model, config)
    _step_batch(model, batch)  # the learning call, so the runtime state is populated
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)

    # The declaration (marker hooks, units) comes back; the plan does not.
    assert hf.is_declared(loaded) and actplan.lowlevel.installed_plan(loaded) is None
    assert offload_engine(loaded) is None
    assert compare_steps(baseline, _step_batch(loaded, batch)[0]).ok
    actplan.apply(loaded, config)
    for _ in range(2):
        assert compare_steps(baseline, _step_batch(loaded, batch)[0]).ok
    actplan.remove(loaded)
    assert not hf.is_declared(loaded)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in loaded.modules())


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
    model.activation_checkpointing_enable()
    with pytest.raises(ConfigError, match="gradient_checkpointing_disable") as err:
        actplan.apply(model, "full")
    assert "model.activation_checkpointing_disable()" in str(err.value)
    model.activation_checkpointing_disable()
    actplan.apply(model, "full")


@pytest.mark.parametrize("config", ["full", "matmuls"])
def test_hf_gradient_checkpointing_switched_on_after_apply_is_named_at_the_first_forward(config):
    # What the Trainer does at train() for TrainingArguments(gradient_checkpointing=True): without
    # the check, torch's CheckpointError ("a different number of tensors was saved") in backward.
    model = tiny("llama")
    baseline = step(copy.deepcopy(model))
    actplan.apply(model, config)
    model.activation_checkpointing_enable()
    with pytest.raises(ConfigError, match=r"switched on after actplan\.apply") as err:
        model(input_ids=IDS, labels=IDS)
    message = str(err.value)
    assert message.startswith("model.layers.0 (LlamaDecoderLayer): ")
    assert "TrainingArguments(gradient_checkpointing=False)" in message
    assert "model.gradient_checkpointing_disable()" in message
    with torch.no_grad():  # nothing is checkpointed without gradients: no error
        model(input_ids=IDS)
    model.activation_checkpointing_disable()
    assert compare_steps(baseline, step(model)).ok


@pytest.mark.slow
def test_the_trainer_with_gradient_checkpointing_on_a_planned_model_names_the_setting(tmp_path):
    pytest.importorskip("accelerate")
    model = tiny("llama")
    actplan.apply(model, "matmuls")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, save_strategy="no",
        report_to="none", use_cpu=True, disable_tqdm=True, gradient_checkpointing=True,
    )
    train = [{"input_ids": row, "labels": row} for row in IDS]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=train)
    with pytest.raises(ConfigError, match=r"TrainingArguments\(gradient_checkpointing=False\)"):
        trainer.train()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_a_kv_cache_in_a_planned_training_forward_is_named():
    # Without the check: "the replay in backward ran aten.cat.default where the forward ran
    # aten.lift_fresh.default", with no word of the cache.
    model = tiny("llama")
    baseline = step(copy.deepcopy(model))
    actplan.apply(model, "matmuls")
    with pytest.raises(ConfigError, match=r"KV cache.*\(use_cache=True\)") as err:
        model(input_ids=IDS, labels=IDS, use_cache=True)
    assert "use_cache=False" in str(err.value) and "actplan.remove(model)" in str(err.value)
    cache = transformers.DynamicCache(config=model.config)
    with pytest.raises(ConfigError, match=r"KV cache.*cache=DynamicCache"):
        model(input_ids=IDS, labels=IDS, past_key_values=cache, use_cache=False)
    with torch.no_grad():  # generation: no backward, no replay, the cache is fine
        out = model(input_ids=IDS, use_cache=True)
    assert out.past_key_values.get_seq_length() == IDS.shape[1]
    assert compare_steps(baseline, step(model)).ok  # training as usual afterwards


def test_the_use_cache_warning_points_at_the_callers_line():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SHAPES, "use_cache": True}))
    for install in (lambda: actplan.apply(model, "matmuls"), lambda: hf.declare(model)):
        actplan.remove(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            install()
        (warning,) = [w for w in caught if "use_cache = False" in str(w.message)]
        assert warning.filename == __file__, warning.filename


def mamba():
    # No MLP beside its mixer: a layer whose units derivation cannot tell.
    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, state_size=4)
    return transformers.MambaForCausalLM(config).train()


MAMBA_LAYOUT = {
    "attn_norm": ["norm"],
    "qkv_proj": ["mixer.in_proj"],
    "attn_core": [("mixer.in_proj:exit", "mixer.out_proj:enter")],
    "attn_proj": ["mixer.out_proj"],
}


def test_an_unsure_layout_is_the_hugging_face_error_with_the_modules_and_the_fix():
    model = mamba()
    for call in (lambda: actplan.apply(model, "full"), lambda: actplan.plan_for(model, "full")):
        with pytest.raises(ConfigError) as err:
            call()
        text = str(err.value)
        assert "recompute_intervals" not in text
        assert "MambaBlock (backbone.layers.0 and 1 more): no MLP projections" in text
        assert "submodules: norm, mixer, mixer.conv1d" in text and "mixer.out_proj" in text
        assert "actplan.apply(model, config, layouts={'MambaBlock': {" in text
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_layouts_given_to_apply_or_declare_are_used_and_kept():
    model = mamba()
    baseline = step(copy.deepcopy(model))
    plan = actplan.apply(model, "matmuls", layouts={"MambaBlock": MAMBA_LAYOUT})
    assert [u.value for u in plan.layers[0].kept_units] == ["qkv_proj", "attn_core", "attn_proj"]
    assert compare_steps(baseline, step(model)).ok
    # Declared by hand, then applied (and applied again): the layout survives.
    actplan.remove(model)
    hf.declare(model, layouts={"MambaBlock": MAMBA_LAYOUT})
    for config in ("attn", "matmuls"):
        plan = actplan.apply(model, config)
        assert "attn_core" in [u.value for u in plan.layers[1].kept_units]
        assert compare_steps(baseline, step(model)).ok
    assert hf.declared_layouts(model) == {"MambaBlock": MAMBA_LAYOUT}
    actplan.remove(model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_layout_overrides_a_derived_one_and_none_leaves_a_class_alone():
    model, _ = hf_models.reference_model("gemma2", "tiny", layers=2)
    mine = {
        "qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "mlp_up": ["mlp.up_proj"],
    }
    plan = actplan.apply(model, "matmuls", layouts={"Gemma2DecoderLayer": mine})
    assert [u.value for u in plan.layers[0].kept_units] == ["qkv_proj", "mlp_up"]
    with pytest.raises(ConfigError, match="none of them usable"):
        actplan.apply(model, "full", layouts={"Gemma2DecoderLayer": None})


class Holder(nn.Module):
    """A module of your own around a transformers model."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def test_a_transformers_model_inside_your_own_module_is_declared_too():
    inner = tiny("llama")
    baseline = step(Holder(copy.deepcopy(inner)))
    model = Holder(inner)
    plan = actplan.apply(model, "matmuls")
    assert [layer.name for layer in plan.layers] == [f"inner.model.layers.{i}" for i in range(3)]
    assert any(m._forward_pre_hooks for m in inner.modules())  # the markers' hooks
    for _ in range(2):
        assert compare_steps(baseline, step(model)).ok
    actplan.remove(model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_verify_passes_on_a_tiny_llama():
    from actplan.evaluate.verify import verify
    from actplan.models import ModelBundle

    model = tiny("llama")
    bundle = ModelBundle("llama", "tiny", model, lambda seed: {"input_ids": IDS, "labels": IDS}, "tiny llama")
    report = verify(bundle, "matmuls", steps=2, check_recompute=True)
    assert report.ok, report.problems()


def test_cli_verify_passes_on_the_reference_llama(capsys):
    from actplan.cli import main

    args = ["verify", "--model", "hf-llama", "--size", "tiny", "--config", "matmuls", "--steps", "2"]
    assert main([*args, "--quiet"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_cli_units_name_the_models_own_modules(capsys, monkeypatch):
    # GPT-2 has LayerNorm and a GELU MLP: its units once read "RMSNorm" and "SwiGLU".
    from actplan.cli import main

    monkeypatch.setenv("COLUMNS", "250")
    assert main(["units", "--model", "hf-gpt2", "--size", "tiny"]) == 0
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if "│" in line}
    assert "ln_1 (LayerNorm)" in rows["attn_norm"] and "mlp.c_fc (Conv1D)" in rows["mlp_up"]
    assert "mlp.act (" in rows["mlp_act"]
    assert not any("RMSNorm before" in row or "SiLU(gate) * up (2f" in row for row in rows.values())


def test_cli_units_and_explain_show_a_derived_layout(capsys, monkeypatch):
    from actplan.cli import main

    monkeypatch.setenv("COLUMNS", "250")
    assert main(["units", "--model", "hf-olmo2", "--size", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "Hugging Face layouts of 'hf-olmo2'" in out
    row = next(line for line in out.splitlines() if "mlp_post_norm" in line and "derived" in line)
    assert "post_feedforward_layernorm" in row
    assert main(["explain", "--model", "hf-olmo2", "--size", "tiny", "--config", "attn"]) == 0
    assert "Olmo2DecoderLayer derived" in capsys.readouterr().out


def test_unknown_reference_kind_is_named():
    from actplan.models import load_model

    with pytest.raises(ValueError, match="kinds: llama, mistral, qwen2, qwen3, qwen3-moe, gpt2, mixtral"):
        load_model("hf-gpt9", "tiny")


def test_bench_runs_the_reference_llama():
    from actplan.evaluate.bench import run_bench

    result = run_bench("hf-llama", "tiny", ("none", "full", "matmuls"), repeats=1, warmup=0, reference=False)
    assert all(row.parity_ok for row in result.rows)
    rows = {row.name: row for row in result.rows}
    assert rows["full"].activation_bytes < rows["none"].activation_bytes


HF_DOC = DOCS / "huggingface.md"


def _doc_block(needle: str) -> str:
    return block_with(HF_DOC, needle)


@pytest.mark.slow
def test_the_trainer_example_runs_and_matches_training_without_the_plan(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    runs = run_trainer_example(HF_DOC, "transformers.Qwen2MoeConfig(")
    weights = [{k: v.clone() for k, v in run["model"].state_dict().items()} for run in runs]
    with_plan, without = weights
    assert with_plan.keys() == without.keys()
    changed = [k for k in without if not torch.equal(with_plan[k], without[k])]
    assert not changed, changed[:5]


def test_the_layout_example_runs():
    namespace: dict = {}
    exec(compile(_doc_block('layouts={"MambaBlock"'), str(HF_DOC), "exec"), namespace)
    assert [u.value for u in namespace["plan"].layers[0].kept_units] == ["qkv_proj", "attn_core", "attn_proj"]

"""The multi-token-prediction reference model: structure, shared embed/head, exactness.

On CPU in fp32 eager every plan must give bit-identical loss and gradients to no
checkpointing (dropout on), and every MTP parameter must keep a non-zero
gradient under every plan: a whole depth training with ``grad is None`` while the
loss stays finite is the failure this file guards against.
"""

import copy
import dataclasses
import typing

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import actplan
from actplan._install.apply import find_layers, interval_map_of
from actplan.measure import compare_steps
from actplan.models import mtp
from actplan.models.dense import Attention, DecoderLayer, SwiGLU
from helpers import step_and_capture

N_LAYERS, DEPTHS = 2, 2
DEPTH_LAYERS = list(range(N_LAYERS, N_LAYERS + DEPTHS))  # find_layers: main stack, then depths

PLANS = {
    "none": "none",
    "full": "full",
    "attn": "attn",
    "matmuls": "matmuls",
    "megatron-selective": "megatron-selective",
    "depths-full": {"mode": "full", "layers": DEPTH_LAYERS},
    "depths-matmuls": {"preset": "matmuls", "layers": DEPTH_LAYERS},
    "depths-keep-mlp_up": {"mode": "selective", "keep": ["mlp_up"], "layers": {"last": DEPTHS}},
}


@pytest.fixture(scope="module")
def built():
    return mtp.build("tiny", dropout=0.1, n_layers=N_LAYERS, mtp_depths=DEPTHS)


@pytest.fixture(scope="module")
def baseline(built):
    model, config = built
    return step_and_capture(copy.deepcopy(model), mtp.make_batch(config, 0))


def mtp_nonzero(capture):
    return {name for name in capture.census.nonzero if name.startswith("mtp.")}


def test_baseline_census_is_meaningful(built, baseline):
    model, _ = built
    # Every parameter, every MTP one included, gets a non-zero gradient without checkpointing.
    assert baseline.census.nonzero == frozenset(name for name, _ in model.named_parameters())
    mtp_names = {name for name, _ in model.named_parameters() if name.startswith("mtp.")}
    assert len(mtp_names) > 0
    assert mtp_nonzero(baseline) == mtp_names
    assert torch.isfinite(baseline.loss)


@pytest.fixture(scope="module")
def plan_steps(built):
    """One training step per plan, run on first use and shared by the tests below."""
    model, config = built
    cache = {}

    def run(plan):
        if plan not in cache:
            candidate = copy.deepcopy(model)
            installed = actplan.apply(candidate, PLANS[plan])
            cache[plan] = (installed, step_and_capture(candidate, mtp.make_batch(config, 0)))
        return cache[plan]

    return run


def test_every_mtp_parameter_keeps_a_gradient_under_every_plan(baseline, plan_steps):
    expected = mtp_nonzero(baseline)
    assert expected, "no MTP parameter has a non-zero gradient even without checkpointing"
    for plan in PLANS:
        installed, step = plan_steps(plan)
        assert mtp_nonzero(step) == expected, plan
        assert not {n for n in step.census.none | step.census.zero if n.startswith("mtp.")}, plan
        if plan.startswith("depths-"):  # the depth-only plans leave the main stack alone
            modes = [layer.mode for layer in installed.layers]
            assert modes[:N_LAYERS] == ["none"] * N_LAYERS
            assert all(mode != "none" for mode in modes[N_LAYERS:])


def test_census_catches_a_depth_silently_detached(built, baseline):
    # The peer bug: reentrant checkpoint around a layer returning a dict drops the
    # graph, the depth trains with grad None, and the loss stays finite. The census
    # comparison used above must see it.
    model, config = built
    model = copy.deepcopy(model)
    depth = model.mtp[0]
    plain_forward = depth.forward

    def reentrant_forward(hidden_states, token_embeddings, *, freqs_cis):
        return checkpoint(
            lambda h, e: plain_forward(h, e, freqs_cis=freqs_cis),
            hidden_states,
            token_embeddings,
            use_reentrant=True,
        )

    depth.forward = reentrant_forward
    step = step_and_capture(model, mtp.make_batch(config, 0))
    assert torch.isfinite(step.loss)
    lost = mtp_nonzero(baseline) - mtp_nonzero(step)
    assert lost and all(name.startswith("mtp.0.") for name in lost)
    assert not compare_steps(baseline, step).census_match


def test_embed_and_head_are_shared_not_copied(built):
    model, _ = built
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    assert len(names) == len(set(names)) == len(list(model.parameters()))
    assert not [n for n in names if n.startswith("mtp.") and ("embed" in n or "lm_head" in n)]
    vocab_shaped = [n for n, p in model.named_parameters() if p.shape[0] == model.config.vocab_size]
    assert sorted(vocab_shaped) == ["embed.weight", "lm_head.weight"]


def test_depths_contribute_to_shared_embed_and_head_gradients(built):
    model, config = built
    batch = mtp.make_batch(config, 0)
    with_mtp = step_and_capture(copy.deepcopy(model), batch)
    without = step_and_capture(mtp.MTPModel(dataclasses.replace(config, mtp_loss_weight=0.0)), batch)
    # The shared embedding and head, and the main stack feeding depth 1, all get
    # gradient from the depth losses.
    for name in ("lm_head.weight", "embed.weight", "layers.0.attn.q_proj.weight"):
        assert not torch.equal(with_mtp.grads[name], without.grads[name]), name
    # With weight 0 the depths still run but contribute exactly nothing to anything.
    assert without.census.zero == frozenset(n for n, _ in model.named_parameters() if n.startswith("mtp."))


def test_loss_combines_main_and_depth_losses(built):
    model, config = built
    out = model(**mtp.make_batch(config, 1))
    assert len(out["mtp_losses"]) == config.mtp_depths
    expected = out["main_loss"] + config.mtp_loss_weight * torch.stack(out["mtp_losses"]).mean()
    assert torch.equal(out["loss"], expected)
    assert all(loss.ndim == 0 and torch.isfinite(loss) for loss in out["mtp_losses"])


def head_calls(model, batch):
    """Every lm_head output of one forward: main logits, then depth 1, depth 2, ..."""
    outputs = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach()))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        handle.remove()
    return outputs


def test_depth_k_sees_token_t_plus_k_and_predicts_t_plus_k_plus_1():
    model, config = mtp.build("tiny", mtp_depths=3)
    model.eval()
    batch = mtp.make_batch(config, 0)
    seq, p = config.seq_len, 10
    before = head_calls(model, batch)
    assert [o.shape[1] for o in before] == [seq - k for k in range(config.mtp_depths + 1)]
    # Each depth's loss scores its logits against labels shifted by k.
    out = model(**batch)
    for k, logits in enumerate(before[1:], start=1):
        assert torch.equal(out["mtp_losses"][k - 1], mtp.cross_entropy(logits, batch["labels"][:, k:]))
    # Changing token p reaches depth k first at position p - k (it is its added token)...
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][:, p] = (changed["input_ids"][:, p] + 1) % config.vocab_size
    after = head_calls(model, changed)
    for k in range(config.mtp_depths + 1):
        assert torch.equal(before[k][:, : p - k], after[k][:, : p - k]), k
        assert not torch.equal(before[k][:, p - k], after[k][:, p - k]), k


def test_find_layers_lists_main_layers_then_depths_and_nothing_nested(built):
    model, config = built
    layers = find_layers(model)
    assert len(layers) == config.n_layers + config.mtp_depths
    assert [type(m).__name__ for _, m in layers] == ["DecoderLayer"] * N_LAYERS + ["MTPDepth"] * DEPTHS
    assert [name for name, _ in layers] == [f"layers.{i}" for i in range(N_LAYERS)] + [
        f"mtp.{k}" for k in range(DEPTHS)
    ]
    # No module inside a layer declares intervals of its own.
    declaring = [name for name, m in model.named_modules() if interval_map_of(m) is not None]
    assert declaring == [name for name, _ in layers]


def test_depth_declares_attention_and_mlp_intervals_only():
    declared = mtp.MTPDepth.recompute_intervals
    assert declared == DecoderLayer.recompute_intervals
    expected = {**Attention.intervals, **SwiGLU.intervals}
    assert {u.value: spans for u, spans in declared.items()} == {u: (s,) for u, s in expected.items()}


def test_outputs_are_typed_dicts_with_documented_keys(built):
    model, config = built
    assert typing.is_typeddict(mtp.MTPOutput) and typing.is_typeddict(mtp.MTPDepthOutput)
    batch = mtp.make_batch(config, 0)
    out = model(**batch)
    assert set(out) == set(mtp.MTPOutput.__annotations__) == {"loss", "main_loss", "mtp_losses", "logits"}
    assert out["logits"].shape == (config.batch_size, config.seq_len, config.vocab_size)
    assert isinstance(out["mtp_losses"], list)
    no_labels = model(batch["input_ids"])
    assert set(no_labels) == set(out)
    assert no_labels["loss"] is None and no_labels["main_loss"] is None and no_labels["mtp_losses"] == []
    depth = model.mtp[0]
    h = torch.randn(1, 5, config.dim)
    depth_out = depth(h, torch.randn(1, 5, config.dim), freqs_cis=model.freqs_cis[:5])
    assert set(depth_out) == set(mtp.MTPDepthOutput.__annotations__) == {"hidden_states"}
    assert depth_out["hidden_states"].shape == h.shape


def test_build_is_deterministic_and_validates():
    a, config = mtp.build("tiny")
    b, _ = mtp.build("tiny")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert torch.equal(mtp.make_batch(config, 3)["input_ids"], mtp.make_batch(config, 3)["input_ids"])
    assert isinstance(config, mtp.MTPConfig) and config.mtp_depths == 2 and config.mtp_loss_weight == 0.3
    with pytest.raises(ValueError, match="unknown mtp size"):
        mtp.build("huge")
    with pytest.raises(ValueError, match="mtp_depths"):
        mtp.build("tiny", mtp_depths=16)
    with pytest.raises(ValueError, match="mtp_depths"):
        mtp.build("tiny", mtp_depths=-1)
    no_depths, cfg0 = mtp.build("tiny", mtp_depths=0)
    out = no_depths(**mtp.make_batch(cfg0, 0))
    assert out["mtp_losses"] == [] and torch.equal(out["loss"], out["main_loss"])

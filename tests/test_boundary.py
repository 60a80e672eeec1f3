"""The checkpoint boundary: PyTree inputs/outputs, RNG, frozen modules, undo."""

import copy
from typing import TypedDict

import pytest
import torch
from torch import nn

from actplan._engine import boundary
from actplan._engine.boundary import (
    apply_gradient_checkpointing,
    is_checkpointed,
    remove_gradient_checkpointing,
)
from actplan._install.apply import offload_engine  # the model's own engine slot


class Out(TypedDict):
    hidden: torch.Tensor
    aux: list[torch.Tensor]
    note: str


class PyTreeLayer(nn.Module):
    """Takes a list of micro-batches plus kwargs; returns a list of TypedDicts."""

    def __init__(self, p_drop: float = 0.0):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.p_drop = p_drop

    def forward(self, micro_batches, *, bias, tag="x", extra=None):
        outs = []
        for mb in micro_batches:
            h = torch.tanh(self.lin(mb["x"]) * self.scale + bias)
            if self.p_drop:
                h = torch.native_dropout(h, self.p_drop, True)[0]
            aux = [h.sum(-1), (mb["y"] * h).mean()]
            outs.append(Out(hidden=h, aux=aux, note=tag))
        if extra is not None:
            outs[0]["hidden"] = outs[0]["hidden"] + extra["t"][0]
        return outs


def make_inputs():
    gen = torch.Generator().manual_seed(3)
    mbs = [
        {
            "x": torch.randn(3, 6, generator=gen, requires_grad=True),
            "y": torch.randn(3, 6, generator=gen),
            "id": i,
        }
        for i in range(3)
    ]
    bias = torch.randn(6, generator=gen, requires_grad=True)
    extra = {"t": (torch.randn(6, generator=gen, requires_grad=True),)}
    return mbs, bias, extra


def loss_and_grads(layer, wrap):
    torch.manual_seed(11)
    if wrap:
        apply_gradient_checkpointing(layer)
    mbs, bias, extra = make_inputs()
    outs = layer(mbs, bias=bias, tag="t", extra=extra)
    assert [o["note"] for o in outs] == ["t", "t", "t"]
    loss = sum(o["hidden"].pow(2).sum() + o["aux"][0].sum() + o["aux"][1] for o in outs)
    loss.backward()
    leaves = [mb["x"] for mb in mbs] + [bias, extra["t"][0]]
    grads = [t.grad for t in leaves] + [p.grad for p in layer.parameters()]
    return loss.detach(), grads


@pytest.mark.parametrize("p_drop", [0.0, 0.3])
def test_pytree_io_kwargs_and_rng_match_no_checkpoint(p_drop):
    torch.manual_seed(0)
    base_layer = PyTreeLayer(p_drop)
    base_loss, base_grads = loss_and_grads(copy.deepcopy(base_layer), wrap=False)
    loss, grads = loss_and_grads(copy.deepcopy(base_layer), wrap=True)
    assert torch.equal(loss, base_loss)
    assert all(g is not None for g in grads), "every tensor leaf that needs a gradient gets one"
    for got, want in zip(grads, base_grads, strict=True):
        assert torch.equal(got, want)


def test_wrapping_keeps_state_dict_and_parameters_and_is_undone():
    layer = PyTreeLayer()
    keys = list(layer.state_dict())
    params = [id(p) for p in layer.parameters()]
    apply_gradient_checkpointing(layer)
    assert is_checkpointed(layer)
    assert list(layer.state_dict()) == keys
    assert [id(p) for p in layer.parameters()] == params
    assert "forward" in layer.__dict__
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_gradient_checkpointing(layer)
    assert remove_gradient_checkpointing(layer)
    assert not is_checkpointed(layer) and "forward" not in layer.__dict__
    assert not remove_gradient_checkpointing(layer)


def test_existing_instance_forward_is_wrapped_and_restored():
    layer = nn.Linear(3, 3)
    calls = []

    def custom_forward(x):
        calls.append(1)
        return nn.Linear.forward(layer, x) * 2

    layer.forward = custom_forward
    apply_gradient_checkpointing(layer)
    layer(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert len(calls) == 2  # forward and replay
    remove_gradient_checkpointing(layer)
    assert layer.forward is custom_forward


def test_deepcopy_of_wrapped_module_runs_its_own_weights():
    layer = nn.Linear(4, 4)
    apply_gradient_checkpointing(layer)
    clone = copy.deepcopy(layer)
    with torch.no_grad():
        clone.weight.zero_()
        clone.bias.zero_()
    x = torch.randn(2, 4, requires_grad=True)
    assert torch.equal(clone(x), torch.zeros(2, 4))
    assert not torch.equal(layer(x), torch.zeros(2, 4))


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch)["loss"]
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "config",
    [
        "full",
        "matmuls",
        {"preset": "full", "offload": {"layer_input": True, "min_bytes": 0}},
        {"preset": "matmuls", "offload": {"units": "kept", "min_bytes": 0}},
    ],
    ids=["full", "matmuls", "full+offload", "matmuls+offload"],
)
def test_torch_save_of_a_planned_model_loads_the_plain_model(config, tmp_path):
    import actplan
    from actplan.models import build_model

    bundle = build_model("dense", "tiny")
    batch = bundle.make_batch(0)
    expected_loss, expected = _grads(bundle.model, batch)
    actplan.apply(bundle.model, config)
    _grads(bundle.model, batch)  # a step with the plan, so its runtime state is populated
    torch.save(bundle.model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)

    # The plan stays behind: the loaded model is plain, and exact.
    assert actplan.lowlevel.installed_plan(loaded) is None and offload_engine(loaded) is None
    assert not any(is_checkpointed(m) for m in loaded.modules())
    loss, grads = _grads(loaded, batch)
    assert torch.equal(loss, expected_loss) and grads.keys() == expected.keys()
    assert all(torch.equal(grads[name], expected[name]) for name in expected)
    # It takes a plan again, and the original keeps its own.
    plan = actplan.apply(loaded, config)
    assert actplan.lowlevel.installed_plan(loaded) is plan
    assert actplan.lowlevel.installed_plan(bundle.model) is not None
    loss, grads = _grads(loaded, batch)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(grads[name], expected[name]) for name in expected)
    assert actplan.remove(loaded) == len(actplan.lowlevel.find_layers(loaded))


def test_deepcopy_of_a_planned_model_keeps_the_plan():
    import actplan
    from actplan.models import build_model

    bundle = build_model("dense", "tiny")
    actplan.apply(bundle.model, "matmuls")
    clone = copy.deepcopy(bundle.model)
    assert actplan.lowlevel.installed_plan(clone) is not None
    assert all(is_checkpointed(layer) for _, layer in actplan.lowlevel.find_layers(clone))
    layer = actplan.lowlevel.find_layers(clone)[0][1]
    assert layer.forward.module is layer  # bound to the copy, not to the original


def test_frozen_module_with_grad_free_inputs_is_not_replayed():
    calls = []

    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.lin.requires_grad_(False)

        def forward(self, x):
            calls.append(1)
            return {"y": self.lin(x)}

    tower = apply_gradient_checkpointing(Frozen())
    out = tower(torch.randn(2, 4))
    assert out["y"].grad_fn is None and not out["y"].requires_grad
    head = nn.Linear(4, 1)
    head(out["y"]).sum().backward()
    assert len(calls) == 1
    # The same frozen tower fed a grad-requiring input is checkpointed normally.
    x = torch.randn(2, 4, requires_grad=True)
    tower(x)["y"].sum().backward()
    assert len(calls) == 3 and x.grad is not None


def test_context_fn_is_passed_only_when_set(monkeypatch):
    seen = []
    real = boundary.checkpoint

    def spy(fn, *args, **kwargs):
        seen.append("context_fn" in kwargs)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(boundary, "checkpoint", spy)
    plain = apply_gradient_checkpointing(nn.Linear(2, 2))
    plain(torch.randn(1, 2, requires_grad=True))
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    def context_fn():
        return create_selective_checkpoint_contexts([])

    selective = apply_gradient_checkpointing(nn.Linear(2, 2), context_fn=context_fn)
    selective(torch.randn(1, 2, requires_grad=True))
    assert seen == [False, True]


def test_no_grad_calls_bypass_checkpoint(monkeypatch):
    monkeypatch.setattr(boundary, "checkpoint", lambda *a, **k: pytest.fail("checkpoint called"))
    layer = apply_gradient_checkpointing(nn.Linear(2, 2))
    with torch.no_grad():
        layer(torch.randn(1, 2))


def test_rejects_non_modules():
    with pytest.raises(TypeError, match=r"expects an nn.Module"):
        apply_gradient_checkpointing(lambda x: x)


@pytest.mark.parametrize("selective", [True, False])
def test_a_forward_that_raises_leaves_no_checkpoint_state_behind(selective):
    # torch < 2.13 leaves the failed checkpoint's saved-tensor hooks and its context_fn's
    # forward context pushed until garbage collection; the boundary closes them (the error is
    # kept alive here, as a caller holding it would), so the next layer runs unaffected.
    from actplan._engine.policy import IntervalPolicy, MarkerError
    from actplan.markers import checkpoint_record
    from actplan.units import MarkerInterval, RecomputeIntervalMap

    imap = RecomputeIntervalMap({"qkv_proj": MarkerInterval("a", "b")})

    class Unbalanced(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            checkpoint_record("a")  # never closed: the forward fails at its end
            h = torch.tanh(self.lin(x))
            if not selective:
                raise ValueError("boom")
            return h

    layer = Unbalanced()
    if selective:
        apply_gradient_checkpointing(layer, policy=IntervalPolicy(imap, imap.intervals_of(["qkv_proj"])))
    else:
        apply_gradient_checkpointing(layer)
    with pytest.raises(MarkerError if selective else ValueError) as err:
        layer(torch.randn(2, 4, requires_grad=True))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert torch._C._len_torch_dispatch_stack() == 0
    plain = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    torch.tanh(plain(x)).sum().backward()
    assert x.grad is not None and err.value is not None

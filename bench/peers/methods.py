"""The peers actplan is compared with, installed on a copy of a reference model.

Each ``*_installer(model) -> description`` wraps every decoder layer the way a user of
that tool would, so ``bench.peers.main`` can run it next to actplan's rows on the same data:

- whole-layer ``torch.utils.checkpoint`` (what Hugging Face and most trainers do) comes
  from ``actplan.evaluate.contenders``;
- op-level selective checkpointing with torchtitan's default save list, re-stated here
  from its documented behaviour (save compute-heavy ops and collectives, and every
  other matmul), for when torchtitan itself does not import;
- op-level selective checkpointing that saves every matmul and attention kernel: the
  same save set as actplan's ``matmuls`` preset, but chosen by op type;
- ``torch_remat`` with save regions that match actplan's ``attn`` and ``matmuls``
  presets. torch_remat regions live in model source, so the annotated forwards below
  are what a torch_remat user would write into the dense and MoE blocks;
- torchtitan's own ``SelectiveAC`` where torchtitan imports (the re-statement above
  stands in for it where it does not);
- the automatic ones: each layer compiled with ``torch.compile`` under
  ``activation_memory_budget``, actplan's plans with compiled layers to set against
  them, and rockmate, which the bench tries and reports as not run, with the reason.

Sits on top of ``actplan`` and its reference models; nothing in ``actplan`` imports it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from types import FunctionType, MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from actplan._install.apply import apply, find_layers
from actplan._install.baselines import (
    ATTENTION_KERNELS,
    TITAN_SAVE_OPS,
    checkpoint_every_layer,
    titan_op_sac,
    titan_policy,
)
from actplan.config import RecomputeConfig
from actplan.models.dense import Attention, SwiGLU, apply_rope, dropout
from actplan.models.moe import MoE

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional


_titan_policy = titan_policy  # the tests' name for it


def _every_matmul_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    if func is aten.mm.default or func in TITAN_SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


titan_op_sac_installer = titan_op_sac


def op_sac_matmuls_installer(model: nn.Module) -> str:
    checkpoint_every_layer(
        model,
        context_fn=lambda: create_selective_checkpoint_contexts(_every_matmul_policy),
        preserve_rng_state=False,
    )
    return "op-level SAC saving every mm and attention kernel (actplan matmuls' save set, by op type)"


# -- torch_remat ------------------------------------------------------------------------------

REMAT_PRESETS: dict[str, frozenset[str]] = {
    "full": frozenset(),
    "attn": frozenset({"attn_core"}),
    "matmuls": frozenset(
        {"qkv_proj", "attn_core", "attn_proj", "mlp_up", "moe_router", "moe_experts", "shared_experts"}
    ),
}
"""Units each torch_remat row saves with ``region(..., recompute=False)``: actplan's presets."""


def _saved(remat: Any, keep: frozenset[str], unit: str, name: str, function: Callable) -> Callable:
    """``function`` as a torch_remat save region when ``unit`` is kept; else left to recompute."""
    return remat.region(function, name, recompute=False) if unit in keep else function


# torch_remat replays the whole layer, so code outside a region that reads a save region's
# output needs that output kept: ``recompute_needs_tensor`` sits before each such reader
# (it does nothing when the producer is not a save region).


def _remat_attention(self: Attention, hidden_states, freqs_cis, *, remat, keep):
    cfg = self.config
    batch, seq, _ = hidden_states.shape
    x = self.attn_norm(hidden_states)
    q = _saved(remat, keep, "qkv_proj", "q_proj", self.q_proj)(x)
    k = _saved(remat, keep, "qkv_proj", "k_proj", self.k_proj)(x)
    v = _saved(remat, keep, "qkv_proj", "v_proj", self.v_proj)(x)
    q = q.view(batch, seq, cfg.n_heads, cfg.head_dim)
    k = k.view(batch, seq, cfg.n_kv_heads, cfg.head_dim)
    v = v.view(batch, seq, cfg.n_kv_heads, cfg.head_dim)
    remat.recompute_needs_tensor(q, k)
    q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
    if "attn_core" not in keep:
        remat.recompute_needs_tensor(v)
    attn = _saved(remat, keep, "attn_core", "attn_core", F.scaled_dot_product_attention)(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    if "attn_proj" not in keep:
        remat.recompute_needs_tensor(attn)

    def project(attn):
        return self.o_proj(attn.transpose(1, 2).reshape(batch, seq, -1))

    attn_out = _saved(remat, keep, "attn_proj", "o_proj", project)(attn)
    remat.recompute_needs_tensor(attn_out)
    return hidden_states + dropout(attn_out, cfg.dropout, self.training)


def _remat_swiglu(self: SwiGLU, hidden_states, *, remat, keep):
    x = self.mlp_norm(hidden_states)
    gate, up = _saved(remat, keep, "mlp_up", "gate_up", lambda x: (self.gate_proj(x), self.up_proj(x)))(x)
    remat.recompute_needs_tensor(gate, up)
    mlp_out = dropout(self.down_proj(F.silu(gate) * up), self.config.dropout, self.training)
    return hidden_states + mlp_out


def _remat_moe(self: MoE, hidden_states, *, remat, keep):
    cfg = self.config
    batch, seq, dim = hidden_states.shape
    x = self.mlp_norm(hidden_states).reshape(batch * seq, dim)
    routed = _saved(remat, keep, "moe_router", "router", self.route)(x)
    remat.recompute_needs_tensor(*routed)
    expert_ids, weights, counts, aux_loss = routed
    order = expert_ids.flatten().argsort(stable=True)
    token_of_slot = order // cfg.top_k
    rows, local_counts, exchange = self._dispatch(x[token_of_slot], counts)
    chunks = rows.split(local_counts)
    experts = self.experts
    n = len(chunks)

    def gate_up(*chunks):
        return tuple(c @ experts.w_gate[e] for e, c in enumerate(chunks)) + tuple(
            c @ experts.w_up[e] for e, c in enumerate(chunks)
        )

    def down(*acts):
        return tuple(a @ experts.w_down[e] for e, a in enumerate(acts))

    gates_ups = _saved(remat, keep, "moe_experts", "experts_gate_up", gate_up)(*chunks)
    remat.recompute_needs_tensor(*gates_ups)
    acts = [F.silu(g) * u for g, u in zip(gates_ups[:n], gates_ups[n:], strict=True)]
    outs = _saved(remat, keep, "moe_experts", "experts_down", down)(*acts)
    remat.recompute_needs_tensor(*outs)
    expert_out = self._return(torch.cat(outs), exchange)
    slot_weights = weights.flatten()[order].unsqueeze(-1)
    combined = torch.zeros_like(x).index_add(0, token_of_slot, expert_out * slot_weights)
    if self.shared is not None:
        s = self.shared

        def shared(x):
            return s["down_proj"](F.silu(s["gate_proj"](x)) * s["up_proj"](x))

        shared_out = _saved(remat, keep, "shared_experts", "shared_experts", shared)(x)
        remat.recompute_needs_tensor(shared_out)
        combined = combined + shared_out
    return hidden_states + combined.view(batch, seq, dim), aux_loss, expert_ids


_REMAT_FORWARDS = {Attention: _remat_attention, SwiGLU: _remat_swiglu, MoE: _remat_moe}


def _remat_checkpoint(remat: Any, name: str, forward: Callable) -> Callable:
    """A layer forward under ``remat.checkpoint``. torch_remat wants a tensor or a flat tuple
    out, so the layer's dict output is flattened inside and rebuilt outside."""
    keys: list[str] = []

    def flat(*args, **kwargs):
        out = forward(*args, **kwargs)
        keys[:] = list(out)
        return tuple(out.values())

    def wrapped(*args, **kwargs):
        values = remat.checkpoint(region_name=name)(flat)(*args, **kwargs)
        return dict(zip(keys, values, strict=True))

    return wrapped


def remat_installer(preset: str) -> Callable[[nn.Module], str]:
    """Installs ``torch_remat`` per layer with the save regions of actplan's ``preset``."""
    keep = REMAT_PRESETS[preset]

    def install(model: nn.Module) -> str:
        remat = import_remat()
        for name, layer in find_layers(model):
            for module in layer.modules():
                annotated = _REMAT_FORWARDS.get(type(module))
                if annotated is not None:
                    module.forward = MethodType(partial(annotated, remat=remat, keep=keep), module)
            layer.forward = _remat_checkpoint(remat, name, layer.forward)
        saved = ", ".join(sorted(keep)) or "nothing"
        return f"torch_remat {remat_version()} per layer; save regions: {saved}"

    return install


def import_remat() -> Any:
    """``torch_remat``, with the one private torch hook it needs supplied if torch lacks it.

    torch_remat 0.2.x marks the storage of a skipped region's stand-in output with
    ``torch._C._set_storage_data_ptr_access_error_msg`` so that reading it raises a clear
    message. The CPU build of torch 2.13.0 has no such hook, and every save region then
    fails in backward. The hook only sets that message, so the bench supplies one that
    does nothing: a correct program never reads a stand-in, and the rows' gradient parity
    against no checkpointing checks that none was read.
    """
    import torch_remat

    if not hasattr(torch._C, "_set_storage_data_ptr_access_error_msg"):
        torch._C._set_storage_data_ptr_access_error_msg = lambda storage, message: None
    return torch_remat


def remat_version() -> str:
    from importlib.metadata import version

    return version("torch_remat")


# -- torchtitan's own activation checkpointing ------------------------------------------------


def titan_import_error() -> str | None:
    """Why torchtitan's AC module cannot be imported here, or None when it can."""
    try:
        import torchtitan.distributed.activation_checkpoint  # noqa: F401
    except Exception as err:  # any failure to import makes the peer unavailable, with its text
        return f"{type(err).__name__}: {err}"
    return None


def titan_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchtitan")
    except PackageNotFoundError:
        return None


def titan_ac_root(model: nn.Module) -> nn.Module:
    """The module whose ``layers`` torchtitan's AC wraps: the decoder of a torchtitan model under
    the bench's loss wrapper (``bench.peers.titan.TitanLM``), else the model itself (our
    reference models keep their blocks in ``layers`` too)."""
    decoder = getattr(model, "decoder", None)
    return decoder if isinstance(decoder, nn.Module) and hasattr(decoder, "layers") else model


def titan_sac_installer(model: nn.Module) -> str:
    """torchtitan's own ``SelectiveAC`` (its default config) applied to the model's ``layers``
    (a torchtitan model's decoder's, see ``titan_ac_root``).

    Its save list names the GPU attention kernels; ``get_save_ops``, the extension point
    torchtitan documents for this, adds the CPU kernel so attention is kept here as it would be
    on a GPU. torchtitan wraps each layer in ``checkpoint_wrapper`` modules, which prefix the
    parameter names; the bench compares gradients under the unwrapped names.
    """
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    class SelectiveACOnCPU(SelectiveAC):
        def get_save_ops(self) -> set:
            return super().get_save_ops() | ATTENTION_KERNELS

    SelectiveACOnCPU(SelectiveAC.Config()).apply(titan_ac_root(model))
    return (
        f"torchtitan {titan_version()} SelectiveAC, default config (compute-intensive ops, attention, "
        "collectives, every other mm), CPU attention kernel added to its save list"
    )


# -- torch.compile's activation memory budget ---------------------------------------------------

COMPILE_BACKEND = "aot_eager"
"""The backend of every compiled row. Its AOTAutograd partitioner is the one Inductor uses
(``min_cut_rematerialization_partition``, which reads ``activation_memory_budget``), and its
graphs run aten ops, so the bench's memory meter sees every allocation they make; Inductor's
kernels on a CPU would be faster but their buffers are not visible to the meter."""

COMPILE_BUDGETS = (0.1, 0.3, 0.5, 0.7, 1.0)
"""``torch._functorch.config.activation_memory_budget`` values benched; 1.0 is the default
(the partitioner optimises runtime alone, and already recomputes cheap ops)."""


def budget_backend(budget: float) -> Callable:
    """``aot_eager`` partitioning under ``activation_memory_budget=budget``.

    The partitioner reads the budget when it splits the joint graph, during compilation, so the
    patch sits around compilation itself: a recompile later (another shape) gets it too.
    """
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return aot_eager(gm, example_inputs)

    return backend


def _call(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    return forward(*args, **kwargs)


_ISOLATE_RECOMPILES = "isolate_recompiles" in inspect.signature(torch.compile).parameters


DynamoFlags = Callable[[], AbstractContextManager[Any]] | None
"""A context that sets the dynamo flags a model's layers need to compile (None: none needed);
entered around every call of a compiled layer, so a recompile gets them too, and no other row
(or test in the same process) inherits them."""


def compile_layers(
    model: nn.Module, backend: str | Callable, *, fullgraph: bool, flags: DynamoFlags = None
) -> None:
    """Compile every layer's forward through one ``torch.compile`` call for this model.

    Dynamo caches compiled graphs on the code object and does not tell backends apart, so a
    second model of the same class would reuse the first one's graphs, compiled under the first
    one's budget. ``isolate_recompiles=True`` gives this model's call its own cache: its layers
    share graphs with each other (as ``layer.compile`` would) and with no other model. Torch
    before 2.13 has no such option; there the call compiles its own copy of ``_call``'s code
    object, on which Dynamo keeps the cache. ``flags``: see ``DynamoFlags``.
    """
    if _ISOLATE_RECOMPILES:
        compiled = torch.compile(_call, backend=backend, fullgraph=fullgraph, isolate_recompiles=True)
    else:
        call = FunctionType(_call.__code__.replace(), _call.__globals__, _call.__name__)
        compiled = torch.compile(call, backend=backend, fullgraph=fullgraph)
    for _, layer in find_layers(model):
        forward = layer.forward

        if flags is None:

            def wrapped(*args, _forward=forward, **kwargs):
                return compiled(_forward, *args, **kwargs)

        else:

            def wrapped(*args, _forward=forward, **kwargs):
                with flags():
                    return compiled(_forward, *args, **kwargs)

        layer.forward = wrapped


def compile_budget_installer(
    budget: float, *, fullgraph: bool, flags: DynamoFlags = None
) -> Callable[[nn.Module], str]:
    """Each layer compiled with ``activation_memory_budget=budget``; no checkpointing."""

    def install(model: nn.Module) -> str:
        compile_layers(model, budget_backend(budget), fullgraph=fullgraph, flags=flags)
        return (
            f"torch.compile per layer ({COMPILE_BACKEND}, fullgraph={fullgraph}), "
            f"torch._functorch.config.activation_memory_budget={budget}"
        )

    return install


def compiled_actplan_installer(
    config: RecomputeConfig, *, flags: DynamoFlags = None, plan: Callable[..., Any] = apply
) -> Callable[[nn.Module], str]:
    """actplan's plan (``plan(model, config)``: ``actplan.apply``, or the torchtitan model's
    installer), then every layer compiled with ``fullgraph=True`` (docs/compile.md), under the
    model's dynamo ``flags``."""

    def install(model: nn.Module) -> str:
        summary = plan(model, config).summary()
        compile_layers(model, COMPILE_BACKEND, fullgraph=True, flags=flags)
        return f"{summary}\nlayers compiled ({COMPILE_BACKEND}, fullgraph=True)"

    return install


# -- rockmate -----------------------------------------------------------------------------------


def rockmate_unavailable(model: nn.Module, batch: dict[str, torch.Tensor]) -> str:
    """Why rockmate gives no row: its import error, or the error its graph builder raises on
    ``model`` (given the loss alone as output, as its tracer requires)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        import rockmate
    except Exception as err:
        try:
            installed = f"rockmate {version('rockmate')} is installed but "
        except PackageNotFoundError:
            installed = ""
        return f"{installed}import rockmate fails: {type(err).__name__}: {err}"

    class LossOnly(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
            return self.inner(**inputs)["loss"]

    try:
        rockmate.Rockmate(LossOnly(model), batch, budget=2**30)
    except Exception as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"rockmate {version('rockmate')} cannot build its graph: {type(err).__name__}: {message}"
    return (
        f"rockmate {version('rockmate')} builds a schedule for this model, but the bench has no "
        "adapter that trains with a Rockmate module yet"
    )

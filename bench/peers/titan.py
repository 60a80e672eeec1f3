"""torchtitan's own model and its own activation checkpointing, for the peers bench.

``titan-llama3`` is torchtitan 0.3.0's ``Llama3Model``, built from torchtitan's config classes
(``Llama3TransformerBlock``, ``make_gqa_config``, ``make_ffn_config``, ``ComplexRoPE`` with
llama scaling, fused QKV, its depth-scaled initialisation) at the shapes of our dense reference
model: ``small`` is dim 512, 8 layers, 8 heads (2 kv), ffn 1536, vocab 4096, batch 2 x 256, as
dense ``small``; ``tiny`` is dense ``tiny``'s shape, for tests.

Why a stand-in for ``attention.inner_attention`` on CPU: torchtitan's language models attend
with FlexAttention (its default; the backward has no CPU kernel outside Inductor, and
aot_eager compiles would need Inductor for the attention region) or varlen attention (CUDA
only), and torchtitan 0.3.0's ``get_attention_config`` refuses ``"sdpa"`` for language models
because SDPA cannot take per-document masks. Each block's ``inner_attention`` is therefore
torchtitan's own ``ScaledDotProductAttention`` module (same call: q, k, v as B, L, N, H; causal
SDPA; returns B, L, N, H). With one document per sequence, causal SDPA is what the
block-causal mask would compute, so no attention mask is passed (``attention_masks=None``), and
``positions`` (0 .. L-1 per row, as torchtitan's dataloader gives them) index the RoPE cache.
Everything else, from the fused QKV projection to the SwiGLU feed-forward, is torchtitan's code.

actplan's units come from the module names (``actplan.apply``, the derived
layout of a ``Llama3TransformerBlock``): ``attn_norm``, ``qkv_proj``, ``rope``,
``attn_core``, ``attn_proj``, ``mlp_norm``, ``mlp_up``, ``mlp_down``.

The peers are torchtitan's own classes from ``torchtitan.distributed.activation_checkpoint``,
applied to the decoder as torchtitan's ``parallelize_llama`` applies them:

- ``titan-full``: ``FullAC`` (whole block under ``checkpoint_wrapper``);
- ``titan-sac``: ``SelectiveAC``, its default config (op-level; the CPU attention kernel added
  to its save list through ``get_save_ops``, as on our models);
- ``titan-memory-budget[budget=B]``: ``MemoryBudgetAC(memory_budget=B)``, which sets
  ``torch._functorch.config.activation_memory_budget`` and relies on the blocks being compiled;
  each block is then compiled as torchtitan's ``apply_compile`` does (``fullgraph=True``), with
  ``backend="aot_eager"`` (see ``bench.peers.methods.COMPILE_BACKEND``). torchtitan sets the
  budget for the whole process; the bench keeps it for this row's compilation alone (patched
  around its backend), and compiles through its own ``compile_layers`` so that no row reuses
  another row's graphs (``Module.compile`` shares Dynamo's cache between models of one class).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import actplan
from actplan.config import RecomputeConfig
from actplan.models import ModelBundle
from bench.peers.methods import (
    COMPILE_BACKEND,
    budget_backend,
    compile_layers,
    titan_ac_root,
    titan_sac_installer,
    titan_version,
)

TITAN_MODELS = ("titan-llama3",)
"""Model choices of the peers bench that are torchtitan's own models."""


@dataclass(frozen=True)
class TitanShape:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    batch_size: int
    seq_len: int
    rope_theta: float = 500000.0


SIZES: dict[str, TitanShape] = {
    "tiny": TitanShape(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192,
                       batch_size=2, seq_len=16),
    "small": TitanShape(vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=2, ffn_dim=1536,
                        batch_size=2, seq_len=256),
}  # fmt: skip
"""The shapes of dense ``tiny`` and ``small`` (``actplan.models.dense.PRESETS``)."""


def titan_import_error() -> str | None:
    """Why torchtitan's llama3 model or AC module cannot be imported here, or None."""
    try:
        import torchtitan.distributed.activation_checkpoint
        import torchtitan.models.llama3  # noqa: F401
    except Exception as err:  # any failure to import makes the model unavailable, with its text
        return f"{type(err).__name__}: {err}"
    return None


class TitanLM(nn.Module):
    """torchtitan's decoder and its next-token loss: ``model(**batch)`` is the loss."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.decoder(tokens, positions)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _llama3_decoder(shape: TitanShape) -> nn.Module:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.common.param_init import depth_scaled_std
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    # torchtitan's llama3 initialisation (torchtitan.models.llama3._LINEAR_INIT and friends).
    def linear_init(std: float) -> dict[str, Callable]:
        return {"weight": functools.partial(nn.init.trunc_normal_, std=std), "bias": nn.init.zeros_}

    norm_init = {"weight": nn.init.ones_}
    head_dim = shape.dim // shape.n_heads
    rope = ComplexRoPE.Config(
        dim=head_dim, max_seq_len=shape.seq_len, theta=shape.rope_theta, scaling="llama"
    )
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=shape.dim, param_init=norm_init),
            ffn_norm=RMSNorm.Config(normalized_shape=shape.dim, param_init=norm_init),
            attention=make_gqa_config(
                dim=shape.dim,
                n_heads=shape.n_heads,
                n_kv_heads=shape.n_kv_heads,
                wqkv_param_init=linear_init(0.02),
                wo_param_init=linear_init(depth_scaled_std(0.02, layer_id)),
                inner_attention=ScaledDotProductAttention.Config(),  # the CPU stand-in (module doc)
                fuse_qkv=True,
                rope=rope,
            ),
            feed_forward=make_ffn_config(
                dim=shape.dim,
                hidden_dim=shape.ffn_dim,
                w1_param_init=linear_init(0.02),
                w2w3_param_init=linear_init(depth_scaled_std(0.02, layer_id)),
            ),
        )
        for layer_id in range(shape.n_layers)
    ]
    output_std = shape.dim**-0.5
    config = Llama3Model.Config(
        dim=shape.dim,
        vocab_size=shape.vocab_size,
        tok_embeddings=Embedding.Config(
            num_embeddings=shape.vocab_size,
            embedding_dim=shape.dim,
            param_init={"weight": functools.partial(nn.init.normal_, std=1.0)},
        ),
        norm=RMSNorm.Config(normalized_shape=shape.dim, param_init=norm_init),
        lm_head=Linear.Config(
            in_features=shape.dim,
            out_features=shape.vocab_size,
            param_init={
                "weight": functools.partial(
                    nn.init.trunc_normal_, std=output_std, a=-3 * output_std, b=3 * output_std
                ),
                "bias": nn.init.zeros_,
            },
        ),
        layers=layers,
    )
    decoder = config.build()
    decoder.init_states()
    return decoder


def _make_batch(shape: TitanShape, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab_size, (shape.batch_size, shape.seq_len + 1), generator=gen)
    positions = torch.arange(shape.seq_len).repeat(shape.batch_size, 1)
    return {"tokens": ids[:, :-1].contiguous(), "positions": positions, "labels": ids[:, 1:].contiguous()}


def build_titan_model(name: str, size: str, *, n_layers: int | None = None) -> ModelBundle:
    """torchtitan's ``name`` (``titan-llama3``) at ``size`` (``tiny`` or ``small``), random
    weights (seed 0), in training mode, with its batch maker."""
    if name not in TITAN_MODELS:
        raise ValueError(f"unknown torchtitan model {name!r}; choose one of {', '.join(TITAN_MODELS)}")
    if size not in SIZES:
        raise ValueError(f"{name} has no size {size!r}; sizes: {', '.join(SIZES)}")
    error = titan_import_error()
    if error is not None:
        raise RuntimeError(
            f"{name} needs torchtitan, which does not import here ({error}); install it with "
            "`pip install --no-deps torchtitan==0.3.0 && pip install spmd_types==0.2.3 tyro` "
            "(docs/benchmarks.md, the peers bench)"
        )
    shape = SIZES[size] if n_layers is None else replace(SIZES[size], n_layers=n_layers)
    torch.manual_seed(0)
    model = TitanLM(_llama3_decoder(shape)).train()
    description = (
        f"{name} {size}: torchtitan 0.3 Llama3Model, {shape.n_layers} layers, {shape.n_heads} heads "
        f"({shape.n_kv_heads} kv), ffn {shape.ffn_dim}, dim {shape.dim}, vocab {shape.vocab_size}, "
        f"batch {shape.batch_size}x{shape.seq_len}; SDPA as inner attention (CPU)"
    )
    return ModelBundle(name, size, model, functools.partial(_make_batch, shape), description)


# -- torchtitan's own activation checkpointing ------------------------------------------------


def titan_full_installer(model: nn.Module) -> str:
    """torchtitan's ``FullAC``, default config, applied to the decoder."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    FullAC(FullAC.Config()).apply(titan_ac_root(model))
    return (
        f"torchtitan {titan_version()} FullAC, default config (checkpoint_wrapper per block, RNG state kept)"
    )


def titan_memory_budget_name(budget: float) -> str:
    return f"titan-memory-budget[budget={budget}]"


def titan_memory_budget_installer(budget: float) -> Callable[[nn.Module], str]:
    """torchtitan's ``MemoryBudgetAC(memory_budget=budget)``, then every block compiled
    (``fullgraph=True``, aot_eager) under the budget it set (module docstring)."""

    def install(model: nn.Module) -> str:
        from torchtitan.distributed.activation_checkpoint import MemoryBudgetAC

        # MemoryBudgetAC writes the budget into the process-wide functorch config; read what it
        # set, then put the config back so no other row is compiled under it.
        with torch._functorch.config.patch(activation_memory_budget=1.0):
            MemoryBudgetAC(MemoryBudgetAC.Config(memory_budget=budget)).apply(titan_ac_root(model))
            set_budget = torch._functorch.config.activation_memory_budget
        compile_layers(model, budget_backend(set_budget), fullgraph=True, flags=titan_compile_flags)
        return (
            f"torchtitan {titan_version()} MemoryBudgetAC(memory_budget={budget}); blocks compiled as "
            f"torchtitan's apply_compile does (fullgraph=True), backend {COMPILE_BACKEND}"
        )

    return install


def titan_compile_flags() -> AbstractContextManager[Any]:
    """The two dynamo flags torchtitan's ``apply_compile`` sets for the whole process before it
    compiles the blocks: ``capture_scalar_outputs`` and
    ``skip_fwd_side_effects_in_bwd_under_checkpoint`` (which also lets actplan's marker
    bookkeeping run inside a compiled checkpoint); the bench sets them around each compiled
    call instead."""
    return torch._dynamo.config.patch(
        capture_scalar_outputs=True, skip_fwd_side_effects_in_bwd_under_checkpoint=True
    )


def titan_plan(model: nn.Module, config: RecomputeConfig) -> Any:
    """``actplan.apply`` on the decoder (what ``ActplanAC`` does); the plan."""
    return actplan.apply(titan_ac_root(model), config)


def titan_actplan_installer(config: RecomputeConfig) -> Callable[[nn.Module], str]:
    """actplan's plan on the decoder's blocks, as ``ActplanAC`` installs it inside torchtitan's
    ``parallelize_llama``: ``actplan.apply(decoder, config)``."""

    def install(model: nn.Module) -> str:
        return titan_plan(model, config).summary()

    return install


def titan_peer_entries() -> list[tuple[str, Callable[[nn.Module], str]]]:
    """The eager torchtitan peers on a torchtitan model: FullAC, then SelectiveAC."""
    return [("titan-full", titan_full_installer), ("titan-sac", titan_sac_installer)]

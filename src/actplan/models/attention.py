"""The attention blocks of the reference models and the pieces they share with the MLP.

``Attention`` (grouped-query, QK-norm, RoPE, SDPA) and ``MLAttention`` (DeepSeek's multi-head
latent attention), each a pre-norm block returning the residual stream after it; ``RMSNorm``,
rotary embeddings and out-of-place dropout. The dense, MoE, MTP and sparse models build on
them (``actplan.models.dense`` re-exports the blocks, the norm, RoPE and dropout).

Tensor-parallel ready: heads are counted from the projections' own width (``view(..., -1,
head_dim)``), so a rank whose projections hold ``n_heads / tp`` heads (colwise) runs the same
code; and token counts come from the normed input, which sequence parallelism gathers to the
whole sequence while the block's input (the residual stream) stays this rank's share of it.

Each block also states its tensor-parallel plan (``tensor_parallel_plan``): which
``torch.distributed.tensor.parallel`` style goes on which submodule, the way
``actplan.parallelize`` applies it (``TPPlan``: relative module name -> styles, applied in
order).

Imports only the marker and the vocabulary.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from actplan.markers import checkpoint_record
from actplan.units import MarkerInterval


class AttentionConfig(Protocol):
    """The sizes the attention blocks read (``DenseConfig`` and its subclasses have them)."""

    dim: int
    n_heads: int
    n_kv_heads: int
    norm_eps: float
    dropout: float
    q_lora_rank: int | None
    kv_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def head_dim(self) -> int: ...


TPPlan = dict[str, tuple[ParallelStyle, ...]]
"""A tensor-parallel plan: module name (relative to the module that states it) -> the styles
``parallelize_module`` applies to it, in order."""


def prefixed(prefix: str, plan: TPPlan) -> TPPlan:
    """``plan`` with its module names under ``prefix`` (``"attn."``)."""
    return {f"{prefix}{name}": styles for name, styles in plan.items()}


def sequence_layout(sequence_parallel: bool) -> Shard | Replicate:
    """How the residual stream between blocks is laid out: this rank's share of the sequence
    under sequence parallelism, the whole of it otherwise."""
    return Shard(1) if sequence_parallel else Replicate()


def gathered_norm(sequence_parallel: bool) -> tuple[ParallelStyle, ...]:
    """Styles for a pre-norm whose output feeds colwise projections.

    With sequence parallelism the norm runs on this rank's share of the sequence
    (``SequenceParallel``) and its output is all-gathered; without, its output is marked
    replicated. Either way the projections then take one replicated DTensor, so backward sums
    their input gradients first and reduces them once (a reduce-scatter, or one all-reduce),
    not once per projection.
    """
    gather = PrepareModuleOutput(
        output_layouts=sequence_layout(sequence_parallel),
        desired_output_layouts=Replicate(),
        use_local_output=False,
    )
    return (SequenceParallel(), gather) if sequence_parallel else (gather,)


def head_norm() -> tuple[ParallelStyle, ...]:
    """Styles for a norm over each head (QK-norm) under colwise projections: a rank holds
    ``n_heads / tp`` heads, so the heads dimension (2) is treated as sharded and the shared
    weight's gradient is summed over ranks."""
    return (SequenceParallel(sequence_dim=2, use_local_output=True),)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Out-of-place dropout (one op); ``F.dropout`` on CPU mutates a mask in place."""
    if not training or p == 0.0:
        return x
    return torch.native_dropout(x, p, True)[0]


class RMSNorm(nn.Module):
    """RMSNorm whose only full-size intermediates are the two that backward needs.

    ``x.pow(2).mean()`` would allocate a third (freed at once, and never held by a kept
    norm: nothing reads it after the mean).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sum_sq = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square()
        rstd = torch.rsqrt(sum_sq / x.shape[-1] + self.eps)
        return (xf * rstd).type_as(x) * self.weight


def rope_frequencies(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [batch, seq, heads, head_dim] by ``freqs_cis`` [seq, head_dim/2].

    The complex form allocates one output tensor; the rotate-half form allocates four
    short-lived ones.
    """
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3).type_as(x)


class Attention(nn.Module):
    """Pre-norm grouped-query attention with QK-norm and RoPE.

    Returns the residual stream after attention; each unit sits between two markers.
    """

    intervals: ClassVar[dict[str, MarkerInterval]] = {
        "attn_norm": MarkerInterval("attn_norm", "qkv_proj"),
        "qkv_proj": MarkerInterval("qkv_proj", "qk_norm"),
        "qk_norm": MarkerInterval("qk_norm", "rope"),
        "rope": MarkerInterval("rope", "attn_core"),
        "attn_core": MarkerInterval("attn_core", "attn_proj"),
        "attn_proj": MarkerInterval("attn_proj", "attn_residual"),
    }

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.q_proj = nn.Linear(config.dim, config.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.q_norm = RMSNorm(hd, config.norm_eps)
        self.k_norm = RMSNorm(hd, config.norm_eps)
        self.o_proj = nn.Linear(config.n_heads * hd, config.dim, bias=False)

    def tensor_parallel_plan(self, sequence_parallel: bool) -> TPPlan:
        """Megatron's split: q/k/v colwise (a rank holds ``n_heads / tp`` query heads and
        ``n_kv_heads / tp`` key/value heads), the output projection rowwise, QK-norm per local
        head; the norm before them gathers the sequence under sequence parallelism, and the
        output projection reduce-scatters back to it (all-reduces without)."""
        return {
            "attn_norm": gathered_norm(sequence_parallel),
            "q_proj": (ColwiseParallel(),),
            "k_proj": (ColwiseParallel(),),
            "v_proj": (ColwiseParallel(),),
            "q_norm": head_norm(),
            "k_norm": head_norm(),
            "o_proj": (RowwiseParallel(output_layouts=sequence_layout(sequence_parallel)),),
        }

    def forward(self, hidden_states: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        checkpoint_record("attn_norm")
        x = self.attn_norm(hidden_states)
        # Tokens from the normed input, heads from each projection's width (module docstring).
        batch, seq = x.shape[:2]
        checkpoint_record("qkv_proj")
        q = self.q_proj(x).view(batch, seq, -1, cfg.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, cfg.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, cfg.head_dim)
        checkpoint_record("qk_norm")
        q, k = self.q_norm(q), self.k_norm(k)
        checkpoint_record("rope")
        q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
        checkpoint_record("attn_core")
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        checkpoint_record("attn_proj")
        attn_out = self.o_proj(attn.transpose(1, 2).reshape(batch, seq, -1))
        attn_out = dropout(attn_out, cfg.dropout, self.training)
        checkpoint_record("attn_residual")
        return hidden_states + attn_out


class MLAttention(nn.Module):
    """Pre-norm multi-head latent attention (DeepSeek-V2/V3) with the units of ``Attention``.

    Queries go through a low-rank latent (``q_a_proj``, RMSNorm, ``q_b_proj``; one ``q_proj``
    when ``q_lora_rank`` is None). Keys and values come from one latent: ``kv_a_proj_with_mqa``
    gives it and a rotary key part shared by every head; RMSNorm; ``kv_b_proj`` gives each
    head's non-rotary key and its value. RoPE turns only the rotary parts. Units: the down and
    up projections are ``qkv_proj``, the two latent norms ``qk_norm``, rotating and joining
    the key and query parts ``rope``.

    SDPA's fused (flash) kernel takes one head size for q, k and v, so values are zero-padded
    from v_head_dim to the query size inside ``attn_core`` and the output sliced back, as
    Hugging Face runs DeepSeek-V3 under flash-attention 2. Unpadded, SDPA on the CPU falls back
    to the math kernel, which holds the s x s scores a GPU kernel does not.
    """

    intervals: ClassVar[dict[str, MarkerInterval | list[MarkerInterval]]] = {
        "attn_norm": MarkerInterval("attn_norm", "qkv_proj"),
        # down projections to the latents, then (after their norms) the up projections
        "qkv_proj": [MarkerInterval("qkv_proj", "qk_norm"), MarkerInterval("qkv_up", "rope")],
        "qk_norm": MarkerInterval("qk_norm", "qkv_up"),
        "rope": MarkerInterval("rope", "attn_core"),
        "attn_core": MarkerInterval("attn_core", "attn_proj"),
        "attn_proj": MarkerInterval("attn_proj", "attn_residual"),
    }

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__()
        self.config = config
        heads, qk_dim = config.n_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(config.dim, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(config.dim, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            config.dim, config.kv_lora_rank + config.qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.norm_eps)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * config.v_head_dim, config.dim, bias=False)

    def tensor_parallel_plan(self, sequence_parallel: bool) -> TPPlan:
        """Not supported yet: splitting the heads (``q_b_proj``/``q_proj`` and ``kv_b_proj``
        colwise) leaves the rotary key part, one for all heads, with the gradient of this
        rank's heads only, and no style sums it over the ranks."""
        raise ValueError(
            "tensor parallelism does not support multi-head latent attention yet: its rotary key "
            "part is shared by every head, and with the heads split its gradient would miss the "
            "other ranks' heads; use grouped-query attention (no kv_lora_rank) or no tensor parallelism"
        )

    def forward(self, hidden_states: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        nope, rope, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        checkpoint_record("attn_norm")
        x = self.attn_norm(hidden_states)
        batch, seq = x.shape[:2]  # tokens from the normed input, heads from q's width (module docstring)
        checkpoint_record("qkv_proj")
        q_latent = self.q_a_proj(x) if cfg.q_lora_rank else None
        kv_latent, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, rope], dim=-1)
        checkpoint_record("qk_norm")
        if q_latent is not None:
            q_latent = self.q_a_layernorm(q_latent)
        kv_latent = self.kv_a_layernorm(kv_latent)
        checkpoint_record("qkv_up")
        q = self.q_b_proj(q_latent) if q_latent is not None else self.q_proj(x)
        q_nope, q_rope = q.view(batch, seq, -1, nope + rope).split([nope, rope], dim=-1)
        heads = q_nope.shape[2]
        kv = self.kv_b_proj(kv_latent).view(batch, seq, heads, nope + v_dim)
        k_nope, v = kv.split([nope, v_dim], dim=-1)
        checkpoint_record("rope")
        q = torch.cat([q_nope, apply_rope(q_rope, freqs_cis)], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), freqs_cis).expand(-1, -1, heads, -1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        checkpoint_record("attn_core")
        if v_dim < nope + rope:
            v = F.pad(v, (0, nope + rope - v_dim))
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        checkpoint_record("attn_proj")
        attn_out = self.o_proj(attn[..., :v_dim].transpose(1, 2).reshape(batch, seq, -1))
        attn_out = dropout(attn_out, cfg.dropout, self.training)
        checkpoint_record("attn_residual")
        return hidden_states + attn_out

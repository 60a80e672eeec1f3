"""Reference sparse-attention decoder whose top-k key ids are shared across layers.

Every ``index_every``-th layer, starting at layer 0, is a *source*: an indexer
scores every causal key for every query with small projections of the normed
hidden state and keeps the ``index_topk`` best key ids per query. The layers up
to the next source are *consumers*: they reuse those ids. Every layer (the
source included) attends only to the keys its ids select.

The ids are explicit dataflow: a layer returns ``{"hidden_states", "topk_ids"}``
and takes ``topk_ids`` as a keyword input (``None`` for a source, which computes
them), and the model threads them from layer to layer. A consumer's ids are an
input of its checkpointed forward, so recomputing a consumer never reruns the
source's indexer, and nothing here looks at ``torch.is_grad_enabled()`` to guess
whether it is being replayed.

The ids are integer and carry no gradient. So that the indexer still trains
through the language-model loss (a stand-in for a separate indexer loss), the
source adds the indexer score of each selected key to its own attention logits;
consumers reuse the ids only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from actplan.markers import checkpoint_record
from actplan.models.dense import (
    DenseConfig,
    RMSNorm,
    SwiGLU,
    apply_rope,
    dropout,
    init_weights,
    preset_config,
    rope_frequencies,
)
from actplan.models.dense import make_batch as make_batch
from actplan.units import MarkerInterval, RecomputeIntervalMap


@dataclass(frozen=True)
class SparseConfig(DenseConfig):
    # Every index_every-th layer (0, k, 2k, ...) runs an indexer; the rest reuse its ids.
    index_every: int = 4
    # Keys each query attends to.
    index_topk: int = 64
    # Width of the indexer's query and key projections.
    index_dim: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.index_every < 1:
            raise ValueError(f"index_every ({self.index_every}) must be at least 1")
        if self.index_dim < 1:
            raise ValueError(f"index_dim ({self.index_dim}) must be at least 1")
        if not 1 <= self.index_topk <= self.seq_len:
            raise ValueError(f"index_topk ({self.index_topk}) must be between 1 and seq_len ({self.seq_len})")

    def is_source(self, layer_idx: int) -> bool:
        return layer_idx % self.index_every == 0


PRESETS: dict[str, SparseConfig] = {
    # A training step in a few milliseconds: for tests. Sources are layers 0 and 2.
    "tiny": SparseConfig(
        vocab_size=128,
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=192,
        max_seq_len=64,
        batch_size=2,
        seq_len=16,
        index_every=2,
        index_topk=6,
        index_dim=16,
    ),
    # About half a second per training step on two CPU cores: for the bench.
    # Sources are layers 0 and 4.
    "small": SparseConfig(),
    # Activations dominate (see dense's "long"): 2 x 1024 tokens through a narrow model,
    # sources at layers 0 and 3. About 1.8 s per step on two CPU cores (the top-k key gather).
    "long": SparseConfig(dim=256, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=768, max_seq_len=1024,
                         batch_size=2, seq_len=1024, index_every=3),
}


class SparseLayerOutput(TypedDict):
    hidden_states: torch.Tensor
    topk_ids: torch.Tensor  # [batch, seq, index_topk] int64 key positions, no grad


class Indexer(nn.Module):
    """Scores every causal key for every query and keeps the ``index_topk`` best.

    Returns the selected scores (differentiable, for the source's own attention)
    and the key ids (int64, no grad), both [batch, seq, index_topk]. Picks past
    the causal limit (early queries have fewer keys than ``index_topk``) score
    ``-inf``; attention masks them.
    """

    def __init__(self, config: SparseConfig) -> None:
        super().__init__()
        self.config = config
        self.q_proj = nn.Linear(config.dim, config.index_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.index_dim, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = x.shape[1]
        q, k = self.q_proj(x), self.k_proj(x)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(self.config.index_dim)
        future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        return scores.topk(self.config.index_topk, dim=-1)


def select_keys(x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Gather ``x`` [batch, seq, heads, dim] at ``topk_ids`` [batch, seq, k]: [batch, seq, k, heads, dim]."""
    rows = torch.arange(x.shape[0], device=x.device)[:, None, None]
    return x[rows, topk_ids]


class SparseAttention(nn.Module):
    """Pre-norm grouped-query attention over each query's selected keys, with QK-norm and RoPE.

    A source layer (``topk_ids=None``) first runs its indexer on the normed
    hidden state. Returns the residual stream after attention and the ids used.
    """

    intervals: ClassVar[dict[str, MarkerInterval]] = {
        "attn_norm": MarkerInterval("attn_norm", "attn_norm_end"),
        # Emitted only by source layers; its own end marker keeps consumers balanced.
        "sparse_indexer": MarkerInterval("sparse_indexer", "sparse_indexer_end"),
        "qkv_proj": MarkerInterval("qkv_proj", "qk_norm"),
        "qk_norm": MarkerInterval("qk_norm", "rope"),
        "rope": MarkerInterval("rope", "attn_core"),
        "attn_core": MarkerInterval("attn_core", "attn_proj"),
        "attn_proj": MarkerInterval("attn_proj", "attn_residual"),
    }

    def __init__(self, config: SparseConfig, *, is_source: bool) -> None:
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.indexer = Indexer(config) if is_source else None
        self.q_proj = nn.Linear(config.dim, config.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.q_norm = RMSNorm(hd, config.norm_eps)
        self.k_norm = RMSNorm(hd, config.norm_eps)
        self.o_proj = nn.Linear(config.n_heads * hd, config.dim, bias=False)

    def forward(
        self, hidden_states: torch.Tensor, freqs_cis: torch.Tensor, topk_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        batch, seq, _ = hidden_states.shape
        checkpoint_record("attn_norm")
        x = self.attn_norm(hidden_states)
        checkpoint_record("attn_norm_end")
        index_bias = None
        if self.indexer is not None:
            checkpoint_record("sparse_indexer")
            index_bias, topk_ids = self.indexer(x)
            checkpoint_record("sparse_indexer_end")
        checkpoint_record("qkv_proj")
        q = self.q_proj(x).view(batch, seq, cfg.n_heads, cfg.head_dim)
        k = self.k_proj(x).view(batch, seq, cfg.n_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(batch, seq, cfg.n_kv_heads, cfg.head_dim)
        checkpoint_record("qk_norm")
        q, k = self.q_norm(q), self.k_norm(k)
        checkpoint_record("rope")
        q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
        checkpoint_record("attn_core")
        attn = self.sparse_attention(q, k, v, topk_ids, index_bias)
        checkpoint_record("attn_proj")
        attn_out = dropout(self.o_proj(attn.reshape(batch, seq, -1)), cfg.dropout, self.training)
        checkpoint_record("attn_residual")
        return hidden_states + attn_out, topk_ids

    def sparse_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        topk_ids: torch.Tensor,
        index_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Softmax over each query's selected keys; picks past the query's position are masked."""
        cfg = self.config
        batch, seq, _, hd = q.shape
        group = cfg.n_heads // cfg.n_kv_heads
        k_sel, v_sel = select_keys(k, topk_ids), select_keys(v, topk_ids)  # [b, s, t, kv, hd]
        q = q.view(batch, seq, cfg.n_kv_heads, group, hd)
        logits = torch.einsum("bshgd,bsthd->bshgt", q, k_sel) / math.sqrt(hd)
        causal = topk_ids <= torch.arange(seq, device=q.device)[:, None]  # [b, s, t]
        if index_bias is not None:
            logits = logits + torch.where(causal, index_bias, 0.0)[:, :, None, None, :]
        logits = logits.masked_fill(~causal[:, :, None, None, :], float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1).type_as(q)
        out = torch.einsum("bshgt,bsthd->bshgd", probs, v_sel)
        return out.reshape(batch, seq, cfg.n_heads, hd)


class SparseDecoderLayer(nn.Module):
    """Sparse attention then SwiGLU; a source layer also runs the indexer.

    Both kinds share one class and one interval map (a consumer never emits the
    ``sparse_indexer`` markers), so a config keeping ``sparse_indexer`` applies to
    every layer.
    """

    recompute_intervals: ClassVar[RecomputeIntervalMap] = RecomputeIntervalMap(
        {**SparseAttention.intervals, **SwiGLU.intervals}
    )

    def __init__(self, config: SparseConfig, *, is_source: bool) -> None:
        super().__init__()
        self.is_source = is_source
        self.attn = SparseAttention(config, is_source=is_source)
        self.mlp = SwiGLU(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        freqs_cis: torch.Tensor,
        topk_ids: torch.Tensor | None = None,
    ) -> SparseLayerOutput:
        if self.is_source != (topk_ids is None):
            raise ValueError(
                "a source layer computes its own topk_ids (pass None); a consumer layer needs the "
                f"topk_ids of its source (this layer is a {'source' if self.is_source else 'consumer'})"
            )
        hidden_states, topk_ids = self.attn(hidden_states, freqs_cis, topk_ids)
        return {"hidden_states": self.mlp(hidden_states), "topk_ids": topk_ids}


class ModelOutput(TypedDict):
    loss: torch.Tensor | None
    logits: torch.Tensor


class SparseModel(nn.Module):
    def __init__(self, config: SparseConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(
            SparseDecoderLayer(config, is_source=config.is_source(i)) for i in range(config.n_layers)
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer(
            "freqs_cis",
            rope_frequencies(config.head_dim, config.max_seq_len, config.rope_theta),
            persistent=False,
        )
        self.reset_parameters()

    def reset_parameters(self, seed: int = 0) -> None:
        init_weights(self, depth=self.config.n_layers, seed=seed)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        seq = input_ids.shape[1]
        if seq < self.config.index_topk:
            raise ValueError(f"sequence length {seq} is shorter than index_topk ({self.config.index_topk})")
        hidden_states = self.embed(input_ids)
        freqs_cis = self.freqs_cis[:seq]
        topk_ids = None
        for layer in self.layers:
            out = layer(hidden_states, freqs_cis=freqs_cis, topk_ids=None if layer.is_source else topk_ids)
            hidden_states, topk_ids = out["hidden_states"], out["topk_ids"]
        logits = self.lm_head(self.norm(hidden_states))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return {"loss": loss, "logits": logits}


def build(size: str = "small", **overrides) -> tuple[SparseModel, SparseConfig]:
    """The sparse reference model of a named size, with optional config overrides."""
    config = preset_config("sparse", PRESETS, size, overrides)
    return SparseModel(config), config

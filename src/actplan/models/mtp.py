"""Reference multi-token-prediction model (DeepSeek-V3 style) on the dense blocks.

A main stack of ``dense.DecoderLayer``s predicts the next token. ``mtp_depths``
extra *depths* then predict further ahead, each one token further than the last:
depth k (1-based) combines the previous depth's hidden state (the main stack's
output for k = 1) at position t with the embedding of token t + k,

    x = proj(concat(h_norm(h[t]), e_norm(embed(ids[t + k]))))

runs one transformer block (``dense.Attention`` then ``dense.SwiGLU``) on it,
and predicts token t + k + 1 through its own output norm and the main model's
``lm_head``. The embedding and the head are shared: the depths reach them through
the model, they are registered once.

Depth k only has a token t + k for positions t < S - k, so it runs on positions
[0, S - k) and is scored against ``labels[:, k:]`` (``labels[t] = ids[t + 1]``).

Every depth is a checkpointable layer (``MTPDepth`` declares
``recompute_intervals``); the attention and MLP blocks inside it are plain
sub-modules, so actplan sees ``n_layers + mtp_depths`` layers: the main stack
first, then the depths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from actplan.models.dense import (
    Attention,
    DecoderLayer,
    DenseConfig,
    RMSNorm,
    SwiGLU,
    init_weights,
    preset_config,
    rope_frequencies,
)
from actplan.models.dense import make_batch as make_batch
from actplan.units import RecomputeIntervalMap


@dataclass(frozen=True)
class MTPConfig(DenseConfig):
    """The dense settings plus the number of MTP depths and the weight of their loss."""

    mtp_depths: int = 2
    mtp_loss_weight: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mtp_depths < 0:
            raise ValueError(f"mtp_depths ({self.mtp_depths}) must be 0 or more")
        if self.mtp_depths >= self.seq_len:
            raise ValueError(
                f"mtp_depths ({self.mtp_depths}) must be below seq_len ({self.seq_len}): "
                "depth k runs on seq_len - k positions"
            )


PRESETS: dict[str, MTPConfig] = {
    # Runs a training step in a few milliseconds: for tests.
    "tiny": MTPConfig(
        vocab_size=128,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=192,
        max_seq_len=64,
        batch_size=2,
        seq_len=16,
        mtp_depths=2,
    ),
    # Six main layers and two depths: eight transformer blocks, like dense small,
    # plus two more passes through the head. About 0.7 s per step on two CPU cores.
    "small": MTPConfig(n_layers=6, mtp_depths=2),
    # Activations dominate (see dense's "long"): 2 x 1024 tokens through four main layers
    # and two depths of a narrow model.
    "long": MTPConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768, max_seq_len=1024,
                      batch_size=2, seq_len=1024, mtp_depths=2),
}


class MTPDepthOutput(TypedDict):
    hidden_states: torch.Tensor


class MTPDepth(nn.Module):
    """One MTP depth: combine step, then attention and SwiGLU; returns a TypedDict.

    Only the transformer block is marked. The combine step (two RMSNorms, the
    concatenation and the 2*dim -> dim projection) has no recompute unit of its
    own, and none of the existing ones describes it honestly (``attn_norm`` is the
    norm in front of attention, not a norm-and-GEMM merge of two streams), so it
    sits outside every interval: under a selective plan it is always recomputed.
    The output norm (``norm``) belongs to the depth but runs outside its forward,
    in ``MTPModel.forward``, like the main stack's final norm.
    """

    recompute_intervals: ClassVar[RecomputeIntervalMap] = RecomputeIntervalMap(
        {**Attention.intervals, **SwiGLU.intervals}
    )

    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        self.h_norm = RMSNorm(config.dim, config.norm_eps)
        self.e_norm = RMSNorm(config.dim, config.norm_eps)
        self.proj = nn.Linear(2 * config.dim, config.dim, bias=False)
        self.attn = Attention(config)
        self.mlp = SwiGLU(config)
        self.norm = RMSNorm(config.dim, config.norm_eps)

    def forward(
        self, hidden_states: torch.Tensor, token_embeddings: torch.Tensor, *, freqs_cis: torch.Tensor
    ) -> MTPDepthOutput:
        if hidden_states.shape != token_embeddings.shape:
            raise ValueError(
                f"hidden_states {tuple(hidden_states.shape)} and token_embeddings "
                f"{tuple(token_embeddings.shape)} must have the same shape"
            )
        # Combine step: outside every marker interval, always recomputed.
        x = self.proj(torch.cat([self.h_norm(hidden_states), self.e_norm(token_embeddings)], dim=-1))
        return {"hidden_states": self.mlp(self.attn(x, freqs_cis))}


class MTPOutput(TypedDict):
    loss: torch.Tensor | None
    main_loss: torch.Tensor | None
    mtp_losses: list[torch.Tensor]
    logits: torch.Tensor


class MTPModel(nn.Module):
    """Dense decoder with ``mtp_depths`` multi-token-prediction depths sharing embed and head."""

    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPDepth(config) for _ in range(config.mtp_depths))
        self.register_buffer(
            "freqs_cis",
            rope_frequencies(config.head_dim, config.max_seq_len, config.rope_theta),
            persistent=False,
        )
        self.reset_parameters()

    def reset_parameters(self, seed: int = 0) -> None:
        # Residual-branch outputs of every block (main and depths) are scaled down.
        init_weights(self, depth=self.config.n_layers + self.config.mtp_depths, seed=seed)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> MTPOutput:
        """Main logits always; losses (main and per depth) only when ``labels`` are given.

        ``labels[:, t]`` is the token after ``input_ids[:, t]``. Without labels the
        depths do not run: they only exist to add training signal.
        """
        seq = input_ids.shape[1]
        embeddings = self.embed(input_ids)
        hidden_states = embeddings
        for layer in self.layers:
            hidden_states = layer(hidden_states, freqs_cis=self.freqs_cis[:seq])["hidden_states"]
        logits = self.lm_head(self.norm(hidden_states))
        if labels is None:
            return {"loss": None, "main_loss": None, "mtp_losses": [], "logits": logits}

        main_loss = cross_entropy(logits, labels)
        mtp_losses = []
        for k, depth in enumerate(self.mtp, start=1):
            # Position t (< seq - k) sees token t + k and predicts token t + k + 1.
            length = seq - k
            hidden_states = depth(
                hidden_states[:, :length], embeddings[:, k:], freqs_cis=self.freqs_cis[:length]
            )["hidden_states"]
            depth_logits = self.lm_head(depth.norm(hidden_states))
            mtp_losses.append(cross_entropy(depth_logits, labels[:, k:]))

        loss = main_loss
        if mtp_losses:
            loss = main_loss + self.config.mtp_loss_weight * torch.stack(mtp_losses).mean()
        return {"loss": loss, "main_loss": main_loss, "mtp_losses": mtp_losses, "logits": logits}


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build(size: str = "small", **overrides) -> tuple[MTPModel, MTPConfig]:
    """The MTP reference model of a named size, with optional config overrides."""
    config = preset_config("mtp", PRESETS, size, overrides)
    return MTPModel(config), config

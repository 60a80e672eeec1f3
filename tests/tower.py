"""Two small models that exercise the checkpoint boundary rather than the policy.

* ``TowerModel``: a **frozen encoder tower** (checkpointable layers, every
  parameter ``requires_grad=False``) reads stand-in image features that need no
  gradient; a trainable projector feeds its output, as prefix tokens, to a small
  trainable decoder. Under any plan the tower runs once, without a replay, and
  its outputs are detached: only the projector and the decoder train.
* ``MicroBatchModel``: a decoder whose layers take a **list of micro-batch
  hidden states** (intra-layer micro-batching: attention for every micro-batch,
  then the MLP for every micro-batch) and return a list of TypedDicts. Gradients
  must reach every micro-batch through the list structure.

Both reuse the dense blocks and interval declarations; the tower layers are the
dense ``DecoderLayer`` itself (causal, a stand-in for a vision encoder block).
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
    DecoderLayerOutput,
    DenseConfig,
    ModelOutput,
    RMSNorm,
    SwiGLU,
    init_weights,
    preset_config,
    rope_frequencies,
)
from actplan.units import RecomputeIntervalMap

# ---------------------------------------------------------------------------------------------
# Frozen encoder tower feeding a trainable decoder
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TowerConfig(DenseConfig):
    """Decoder fields as in ``DenseConfig``; the tower shares ``dim`` and the head layout."""

    tower_layers: int = 2
    # Width of the stand-in image features and how many image tokens a sample has.
    image_dim: int = 256
    image_tokens: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tower_layers < 1 or self.image_tokens < 1 or self.image_dim < 1:
            raise ValueError("tower_layers, image_tokens and image_dim must be at least 1")
        if self.image_tokens + self.seq_len > self.max_seq_len:
            raise ValueError(
                f"image_tokens + seq_len ({self.image_tokens + self.seq_len}) exceeds max_seq_len "
                f"({self.max_seq_len})"
            )

    @property
    def tower_config(self) -> DenseConfig:
        """The tower's layers: the decoder's shape, ``tower_layers`` deep, no dropout."""
        fields = {name: getattr(self, name) for name in DenseConfig.__dataclass_fields__}
        return DenseConfig(**{**fields, "n_layers": self.tower_layers, "dropout": 0.0})


TOWER_PRESETS: dict[str, TowerConfig] = {
    "tiny": TowerConfig(
        vocab_size=128,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=192,
        max_seq_len=64,
        batch_size=2,
        seq_len=16,
        tower_layers=2,
        image_dim=32,
        image_tokens=8,
    ),
    "small": TowerConfig(n_layers=4, seq_len=192, tower_layers=4),
}


class FrozenTower(nn.Module):
    """Encoder tower: input projection, dense layers, final norm; frozen at construction."""

    def __init__(self, config: TowerConfig) -> None:
        super().__init__()
        tower = config.tower_config
        self.in_proj = nn.Linear(config.image_dim, config.dim, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(tower) for _ in range(tower.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.requires_grad_(False)

    def forward(self, image_features: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        hidden_states = self.in_proj(image_features)
        for layer in self.layers:
            hidden_states = layer(hidden_states, freqs_cis=freqs_cis)["hidden_states"]
        return self.norm(hidden_states)


class TowerModel(nn.Module):
    """Frozen tower -> trainable projector -> image prefix + token embeddings -> decoder.

    The loss covers the text positions only.
    """

    def __init__(self, config: TowerConfig) -> None:
        super().__init__()
        self.config = config
        self.tower = FrozenTower(config)
        self.projector = nn.Linear(config.dim, config.dim, bias=False)
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer(
            "freqs_cis",
            rope_frequencies(config.head_dim, config.max_seq_len, config.rope_theta),
            persistent=False,
        )
        init_weights(self, depth=config.n_layers)

    def forward(
        self, image_features: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> ModelOutput:
        n_image = image_features.shape[1]
        image = self.tower(image_features, self.freqs_cis[:n_image])
        hidden_states = torch.cat([self.projector(image), self.embed(input_ids)], dim=1)
        freqs_cis = self.freqs_cis[: hidden_states.shape[1]]
        for layer in self.layers:
            hidden_states = layer(hidden_states, freqs_cis=freqs_cis)["hidden_states"]
        logits = self.lm_head(self.norm(hidden_states[:, n_image:]))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return {"loss": loss, "logits": logits}


def make_tower_batch(config: TowerConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Stand-in image features (no grad), token ids and next-token labels."""
    gen = torch.Generator().manual_seed(seed)
    image = torch.randn(config.batch_size, config.image_tokens, config.image_dim, generator=gen)
    ids = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len + 1), generator=gen)
    return {"image_features": image, "input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def build_tower(size: str = "small", **overrides) -> tuple[TowerModel, TowerConfig]:
    """The frozen-tower model of a named size, with optional config overrides."""
    config = preset_config("tower", TOWER_PRESETS, size, overrides)
    return TowerModel(config), config


# ---------------------------------------------------------------------------------------------
# Micro-batch-list layers
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MicroBatchConfig(DenseConfig):
    """Dense fields; ``make_micro_batches`` draws one micro-batch of ``batch_size`` rows per
    entry of ``micro_seq_lens`` (micro-batches may differ in length; ``seq_len`` is unused)."""

    micro_seq_lens: tuple[int, ...] = (256, 128)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.micro_seq_lens or min(self.micro_seq_lens) < 1:
            raise ValueError(f"micro_seq_lens {self.micro_seq_lens} must list at least one positive length")
        if max(self.micro_seq_lens) > self.max_seq_len:
            raise ValueError(f"micro_seq_lens {self.micro_seq_lens} exceed max_seq_len ({self.max_seq_len})")


MICRO_BATCH_PRESETS: dict[str, MicroBatchConfig] = {
    "tiny": MicroBatchConfig(
        vocab_size=128,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=192,
        max_seq_len=64,
        batch_size=2,
        seq_len=16,
        micro_seq_lens=(16, 8, 12),
    ),
    "small": MicroBatchConfig(micro_seq_lens=(160, 96)),
}


class MicroBatchDecoderLayer(nn.Module):
    """Dense attention and SwiGLU over a list of micro-batches, stage by stage.

    ``forward`` takes ``[hidden_states, ...]`` and returns ``[{"hidden_states"}, ...]``,
    one entry per micro-batch, in order (the shape intra-layer micro-batching
    has when one micro-batch's communication overlaps another's compute).
    """

    recompute_intervals: ClassVar[RecomputeIntervalMap] = DecoderLayer.recompute_intervals

    def __init__(self, config: MicroBatchConfig) -> None:
        super().__init__()
        self.attn = Attention(config)
        self.mlp = SwiGLU(config)

    def forward(
        self, hidden_states: list[torch.Tensor], *, freqs_cis: torch.Tensor
    ) -> list[DecoderLayerOutput]:
        after_attn = [self.attn(h, freqs_cis[: h.shape[1]]) for h in hidden_states]
        return [{"hidden_states": self.mlp(h)} for h in after_attn]


class MicroBatchModelOutput(TypedDict):
    loss: torch.Tensor | None
    logits: list[torch.Tensor]


class MicroBatchModel(nn.Module):
    """Decoder over a list of micro-batches; the loss is the token-weighted mean over all."""

    def __init__(self, config: MicroBatchConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(MicroBatchDecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer(
            "freqs_cis",
            rope_frequencies(config.head_dim, config.max_seq_len, config.rope_theta),
            persistent=False,
        )
        init_weights(self, depth=config.n_layers)

    def forward(
        self, input_ids: list[torch.Tensor], labels: list[torch.Tensor] | None = None
    ) -> MicroBatchModelOutput:
        hidden_states = [self.embed(ids) for ids in input_ids]
        for layer in self.layers:
            hidden_states = [out["hidden_states"] for out in layer(hidden_states, freqs_cis=self.freqs_cis)]
        logits = [self.lm_head(self.norm(h)) for h in hidden_states]
        loss = None
        if labels is not None:
            total = sum(
                F.cross_entropy(lg.flatten(0, 1).float(), lb.flatten(), reduction="sum")
                for lg, lb in zip(logits, labels, strict=True)
            )
            loss = total / sum(lb.numel() for lb in labels)
        return {"loss": loss, "logits": logits}


def make_micro_batches(config: MicroBatchConfig, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """One micro-batch of token ids and next-token labels per entry of ``micro_seq_lens``."""
    gen = torch.Generator().manual_seed(seed)
    input_ids, labels = [], []
    for seq in config.micro_seq_lens:
        ids = torch.randint(0, config.vocab_size, (config.batch_size, seq + 1), generator=gen)
        input_ids.append(ids[:, :-1].contiguous())
        labels.append(ids[:, 1:].contiguous())
    return {"input_ids": input_ids, "labels": labels}


def build_micro_batch(size: str = "small", **overrides) -> tuple[MicroBatchModel, MicroBatchConfig]:
    """The micro-batch-list model of a named size, with optional config overrides."""
    config = preset_config("micro-batch", MICRO_BATCH_PRESETS, size, overrides)
    return MicroBatchModel(config), config

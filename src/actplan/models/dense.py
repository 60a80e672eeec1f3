"""Reference dense decoder (Llama / Qwen3 style) with every recompute unit marked.

RMSNorm, QK-norm, rotary embeddings, grouped-query attention through SDPA (or
DeepSeek's multi-head latent attention, ``MLAttention``, when ``kv_lora_rank`` is
set) and a SwiGLU MLP. The attention blocks, the norm and RoPE live in
``actplan.models.attention`` and are re-exported here. Decoder layers return a TypedDict.
Besides those blocks, the only actplan imports are the marker and the vocabulary: the
model knows its units, the engine never imports the model.

Ops inside each unit are written out-of-place (dropout included): an in-place
update of a tensor a kept unit holds for backward would change what backward reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, TypedDict, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from actplan.markers import checkpoint_record
from actplan.models.attention import (
    Attention,
    MLAttention,
    RMSNorm,
    TPPlan,
    dropout,
    gathered_norm,
    prefixed,
    rope_frequencies,
    sequence_layout,
)
from actplan.models.attention import apply_rope as apply_rope
from actplan.units import MarkerInterval, RecomputeIntervalMap

ConfigT = TypeVar("ConfigT")


@dataclass(frozen=True)
class DenseConfig:
    vocab_size: int = 4096
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 2
    ffn_dim: int = 1536
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dropout: float = 0.0
    # Shape of the batches ``make_batch`` draws.
    batch_size: int = 2
    seq_len: int = 256
    # A head size apart from dim / n_heads (Qwen3 has 32 heads of 128 on dim 2048; one rank of
    # a tensor-parallel group holds n_heads / tp heads of the model's size). None: dim / n_heads.
    attn_head_dim: int | None = None
    # Multi-head latent attention (DeepSeek-V2/V3) when kv_lora_rank is set: queries through a
    # q_lora_rank latent (directly when None), keys and values from one kv_lora_rank latent;
    # query and key heads of qk_nope_head_dim + qk_rope_head_dim, value heads of v_head_dim.
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def mla(self) -> bool:
        return bool(self.kv_lora_rank)

    @property
    def rope_dim(self) -> int:
        """The size RoPE turns: the rotary part of an MLA head, or the whole head."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    def __post_init__(self) -> None:
        if self.mla:
            sizes = (self.kv_lora_rank, self.q_lora_rank or 1, self.qk_nope_head_dim, self.v_head_dim)
            if (
                min(*sizes, self.qk_rope_head_dim) < 1
                or self.v_head_dim > self.qk_nope_head_dim + self.qk_rope_head_dim
            ):
                raise ValueError(
                    f"latent attention sizes must be positive and v_head_dim ({self.v_head_dim}) at most "
                    f"qk_nope_head_dim + qk_rope_head_dim ({self.qk_nope_head_dim + self.qk_rope_head_dim})"
                )
        elif (self.attn_head_dim is None and self.dim % self.n_heads) or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"dim ({self.dim}) must divide by n_heads ({self.n_heads}) (or give attn_head_dim) "
                f"and n_heads by n_kv_heads ({self.n_kv_heads})"
            )
        if self.rope_dim % 2:
            raise ValueError(f"rotary head size ({self.rope_dim}) must be even for rotary embeddings")
        if self.seq_len > self.max_seq_len:
            raise ValueError(f"seq_len ({self.seq_len}) exceeds max_seq_len ({self.max_seq_len})")


PRESETS: dict[str, DenseConfig] = {
    # Runs a training step in a few milliseconds: for tests.
    "tiny": DenseConfig(
        vocab_size=128,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=192,
        max_seq_len=64,
        batch_size=2,
        seq_len=16,
    ),
    # About half a second per training step on two CPU cores: for the bench.
    "small": DenseConfig(),
    # Activations dominate, as in LLM training at long sequences: 2 x 1024 tokens through a
    # narrow model hold several times the parameters, gradients and AdamW state.
    "long": DenseConfig(dim=256, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=768, max_seq_len=1024,
                        batch_size=2, seq_len=1024),
}


class DecoderLayerOutput(TypedDict):
    hidden_states: torch.Tensor


class SwiGLU(nn.Module):
    """Pre-norm SwiGLU MLP; returns the residual stream after it."""

    intervals: ClassVar[dict[str, MarkerInterval]] = {
        "mlp_norm": MarkerInterval("mlp_norm", "mlp_up"),
        "mlp_up": MarkerInterval("mlp_up", "mlp_act"),
        "mlp_act": MarkerInterval("mlp_act", "mlp_down"),
        "mlp_down": MarkerInterval("mlp_down", "mlp_residual"),
    }

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.config = config
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.gate_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def tensor_parallel_plan(self, sequence_parallel: bool) -> TPPlan:
        """Megatron's split: gate and up colwise, down rowwise (reduce-scattered back to the
        sequence shards under sequence parallelism, all-reduced without)."""
        return {
            "mlp_norm": gathered_norm(sequence_parallel),
            "gate_proj": (ColwiseParallel(),),
            "up_proj": (ColwiseParallel(),),
            "down_proj": (RowwiseParallel(output_layouts=sequence_layout(sequence_parallel)),),
        }

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        checkpoint_record("mlp_norm")
        x = self.mlp_norm(hidden_states)
        checkpoint_record("mlp_up")
        gate, up = self.gate_proj(x), self.up_proj(x)
        checkpoint_record("mlp_act")
        act = F.silu(gate) * up
        checkpoint_record("mlp_down")
        mlp_out = dropout(self.down_proj(act), self.config.dropout, self.training)
        checkpoint_record("mlp_residual")
        return hidden_states + mlp_out


class DecoderLayer(nn.Module):
    """Attention then SwiGLU, returning a TypedDict."""

    recompute_intervals: ClassVar[RecomputeIntervalMap] = RecomputeIntervalMap(
        {**Attention.intervals, **SwiGLU.intervals}
    )
    attention_class: ClassVar[type[nn.Module]] = Attention

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.attn = self.attention_class(config)
        self.mlp = SwiGLU(config)

    def tensor_parallel_plan(self, sequence_parallel: bool) -> TPPlan:
        return {
            **prefixed("attn.", self.attn.tensor_parallel_plan(sequence_parallel)),
            **prefixed("mlp.", self.mlp.tensor_parallel_plan(sequence_parallel)),
        }

    def forward(self, hidden_states: torch.Tensor, *, freqs_cis: torch.Tensor) -> DecoderLayerOutput:
        return {"hidden_states": self.mlp(self.attn(hidden_states, freqs_cis))}


class MLADecoderLayer(DecoderLayer):
    """Multi-head latent attention then SwiGLU (DeepSeek's dense layers)."""

    recompute_intervals: ClassVar[RecomputeIntervalMap] = RecomputeIntervalMap(
        {**MLAttention.intervals, **SwiGLU.intervals}
    )
    attention_class: ClassVar[type[nn.Module]] = MLAttention


class SeededGenerators:
    """One seeded generator per device, made on first use: a model built on a GPU (under
    ``with torch.device("cuda"):``) draws its init there instead of on the host; on the CPU the
    draws are those of a single CPU generator; on the meta device, none."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._by_device: dict[torch.device, torch.Generator] = {}

    def __call__(self, device: torch.device) -> torch.Generator | None:
        if device.type == "meta":  # a model built on the meta device draws nothing
            return None
        if device not in self._by_device:
            self._by_device[device] = torch.Generator(device).manual_seed(self.seed)
        return self._by_device[device]


def copy_whole(param: torch.Tensor, value: torch.Tensor) -> None:
    """``param.copy_(value)``, where ``value`` is the whole tensor and ``param`` may be a DTensor
    (sharded by FSDP or TP): each rank keeps its own shard of ``value``, with no communication."""
    if isinstance(param, DTensor):
        value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(value)


def init_weights(model: nn.Module, depth: int, seed: int = 0) -> None:
    """Seeded init shared by the reference models: RMSNorm weights at one, the
    residual-branch output projections at 0.02 / sqrt(2 * depth), the rest at 0.02."""
    generator = SeededGenerators(seed)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    residual_std = 0.02 / math.sqrt(2 * depth)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if id(param) in norms:
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                param.normal_(0.0, std, generator=generator(param.device))


class ModelOutput(TypedDict):
    loss: torch.Tensor | None
    logits: torch.Tensor


class DenseModel(nn.Module):
    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        layer = MLADecoderLayer if config.mla else DecoderLayer
        self.layers = nn.ModuleList(layer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer(
            "freqs_cis",
            rope_frequencies(config.rope_dim, config.max_seq_len, config.rope_theta),
            persistent=False,
        )
        self.reset_parameters()

    def reset_parameters(self, seed: int = 0) -> None:
        init_weights(self, depth=self.config.n_layers, seed=seed)

    def tensor_parallel_plan(self, tp: int, sequence_parallel: bool | None = None) -> TPPlan:
        """Where ``actplan.parallelize`` puts each tensor-parallel style (``model_tp_plan``);
        sequence parallel unless ``sequence_parallel=False``."""
        return model_tp_plan(self, tp, True if sequence_parallel is None else sequence_parallel)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        seq = input_ids.shape[1]
        hidden_states = self.embed(input_ids)
        freqs_cis = self.freqs_cis[:seq]
        for layer in self.layers:
            hidden_states = layer(hidden_states, freqs_cis=freqs_cis)["hidden_states"]
        logits = self.lm_head(self.norm(hidden_states))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return {"loss": loss, "logits": logits}

    def activation_floor_bytes(self, batch: dict[str, torch.Tensor]) -> int:
        """Bytes that must stay alive at the end of forward whatever the layers do.

        Every checkpointed layer keeps its input (batch x seq x dim); outside the
        layers the final norm keeps its input, normalised product and output plus
        one statistic per token, and cross-entropy keeps its log-probabilities.
        """
        tokens = batch["input_ids"].numel()
        elt = self.embed.weight.element_size()
        layer_inputs = self.config.n_layers * tokens * self.config.dim * elt
        final_norm = 3 * tokens * self.config.dim * elt + 2 * tokens * 4  # + norm, rstd per token
        log_probs = tokens * self.config.vocab_size * 4
        return layer_inputs + final_norm + log_probs


def model_tp_plan(
    model: nn.Module, tp: int, sequence_parallel: bool, sizes: dict[str, int] | None = None
) -> TPPlan:
    """The tensor-parallel plan of a reference model (``embed``, ``layers``, ``norm``,
    ``lm_head``), each layer's from its own ``tensor_parallel_plan``.

    The embedding is split by vocabulary (rowwise): its partial sums are reduce-scattered to
    sequence shards under sequence parallelism, all-reduced otherwise. The final norm runs on
    the sequence shards, and the head is split by vocabulary (colwise) with its logits gathered,
    so the loss sees whole, replicated logits. Raises ``ValueError`` when a size (of the
    config's, or of ``sizes``) does not divide by ``tp``.
    """
    config = model.config
    sizes = {
        "vocab_size": config.vocab_size,
        "n_heads": config.n_heads,
        "ffn_dim": config.ffn_dim,
        **(sizes or {}),
    }
    if not config.mla:
        sizes["n_kv_heads"] = config.n_kv_heads
    if sequence_parallel:
        sizes["seq_len"] = config.seq_len  # of the batches make_batch draws
    uneven = [f"{name} ({size})" for name, size in sizes.items() if size % tp]
    if tp < 1 or uneven:
        raise ValueError(
            f"cannot split this model over {tp} tensor-parallel ranks: {', '.join(uneven) or 'tp < 1'} "
            f"must divide by {tp}; choose a tensor-parallel size that divides them"
        )
    seq = sequence_layout(sequence_parallel)
    plan: TPPlan = {"embed": (RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),)}
    for index, layer in enumerate(model.layers):
        plan.update(prefixed(f"layers.{index}.", layer.tensor_parallel_plan(sequence_parallel)))
    if sequence_parallel:
        plan["norm"] = (SequenceParallel(),)
    plan["lm_head"] = (ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),)
    return plan


def make_batch(config: DenseConfig, seed: int = 0, batch_size: int | None = None) -> dict[str, torch.Tensor]:
    """Random token ids and next-token labels of the configured shape (any reference config)."""
    gen = torch.Generator().manual_seed(seed)
    rows = batch_size or config.batch_size
    ids = torch.randint(0, config.vocab_size, (rows, config.seq_len + 1), generator=gen)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def preset_config(kind: str, presets: dict[str, ConfigT], size: str, overrides: dict) -> ConfigT:
    """The named size's config with ``overrides`` applied; shared by the reference models."""
    if size not in presets:
        raise ValueError(f"unknown {kind} size {size!r}; choose one of {', '.join(presets)}")
    return replace(presets[size], **overrides)


def build(size: str = "small", **overrides) -> tuple[DenseModel, DenseConfig]:
    """The dense reference model of a named size, with optional config overrides."""
    config = preset_config("dense", PRESETS, size, overrides)
    return DenseModel(config), config

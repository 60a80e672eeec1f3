"""Tiny torchtitan 0.3 decoders (2 blocks, dim 64) and a nanoGPT-style model, built as
torchtitan builds them, for ``tests/test_torchtitan.py`` and the tensor-parallel worker
``tests/dist/titan_tp_worker.py``; ``llama3_bundle`` and ``deepseek_v3_bundle`` are factories
for the command line (``--model helpers.titan:llama3_bundle``).

On CPU each model's ``inner_attention`` is torchtitan's own ``ScaledDotProductAttention``
(FlexAttention has no CPU backward); everything else is torchtitan's code. Importing this
module needs torchtitan (the ``torchtitan`` extra).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, build_mla_moe_layers
from torchtitan.models.llama3 import Llama3Model
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

from actplan.models import ModelBundle

DIM, VOCAB, HEADS, SEQ = 64, 128, 4, 16
LINEAR = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
NORM = {"weight": nn.init.ones_}
EXPERTS = {name: partial(nn.init.normal_, std=0.02) for name in ("w1_EFD", "w2_EDF", "w3_EFD")}


# ---------------------------------------------------------------------------------------------
# Tiny torchtitan models (2 blocks, dim 64) and a nanoGPT-style model


def _norm(size: int = DIM) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=size, param_init=NORM)


def _gqa(**kwargs):
    rope = ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=10000.0)
    return make_gqa_config(
        dim=DIM, n_heads=HEADS, n_kv_heads=2, wqkv_param_init=LINEAR, wo_param_init=LINEAR,
        inner_attention=ScaledDotProductAttention.Config(), rope=rope, **kwargs,
    )  # fmt: skip


def _ffn():
    return make_ffn_config(dim=DIM, hidden_dim=128, w1_param_init=LINEAR, w2w3_param_init=LINEAR)


def _llama3_blocks():
    return [
        Llama3TransformerBlock.Config(
            attention_norm=_norm(), ffn_norm=_norm(), attention=_gqa(fuse_qkv=True), feed_forward=_ffn()
        )
        for _ in range(2)
    ]


def _qwen3_blocks():
    attention = partial(_gqa, fuse_qkv=False, qk_norm=_norm(DIM // HEADS))
    return [
        Qwen3TransformerBlock.Config(
            attention_norm=_norm(), ffn_norm=_norm(), attention=attention(), feed_forward=_ffn()
        )
        for _ in range(2)
    ]


def _deepseek_v3_blocks():
    # MLA with a query low-rank (wq_a, q_norm, wq_b); block 0 dense, block 1 MoE: 4 routed
    # experts (top 2), one shared expert.
    layers = build_mla_moe_layers(
        n_layers=2, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=1.0, dense_hidden_dim=128,
        moe_hidden_dim=32, num_experts=4, num_shared_experts=1, router_top_k=2,
        router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, linear_init=LINEAR, norm_init=NORM,
        depth_init=lambda _: LINEAR, depth_experts_init=lambda _: EXPERTS,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0),
    )  # fmt: skip
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


MODELS = {
    "llama3": (Llama3Model, _llama3_blocks),
    "qwen3": (Qwen3Model, _qwen3_blocks),
    "deepseek_v3": (DeepSeekV3Model, _deepseek_v3_blocks),
}


def decoder_config(kind: str):
    """The tiny model's torchtitan config (``build_decoder`` builds it; a tensor-parallel run
    sets its ``sharding_config``s first)."""
    model_class, layers = MODELS[kind]
    return model_class.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init={"weight": nn.init.normal_}
        ),
        norm=_norm(),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=LINEAR),
        layers=layers(),
    )


def build_decoder(kind: str, config=None) -> nn.Module:
    config = decoder_config(kind) if config is None else config
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model.train()


class WithLoss(nn.Module):
    """A decoder returning its next-token loss: ``model(**batch)`` is the loss, as a bundle's is."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.decoder(tokens, positions)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


class CausalSelfAttention(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)
        self.resid_dropout = nn.Dropout(dropout)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (t.view(batch, length, HEADS, -1).transpose(1, 2) for t in self.c_attn(x).split(DIM, dim=2))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(batch, length, DIM)))


class MLP(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(DIM, 4 * DIM)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * DIM, DIM)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = CausalSelfAttention(dropout)
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = MLP(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's layout: ``transformer.h`` holds the blocks; dropout on, so replays must draw
    the same masks."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, DIM),
                wpe=nn.Embedding(SEQ, DIM),
                h=nn.ModuleList(Block(dropout) for _ in range(2)),
                ln_f=nn.LayerNorm(DIM),
            )
        )
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(tokens) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tokens, "positions": torch.arange(SEQ).repeat(2, 1)}


def build(kind: str) -> nn.Module:
    if kind == "nanogpt":
        torch.manual_seed(0)
        return NanoGPT().train()
    return WithLoss(build_decoder(kind))


def llama3_bundle() -> ModelBundle:
    """For ``actplan units --model helpers.titan:llama3_bundle``."""
    return ModelBundle("llama3", "tiny", build("llama3"), make_batch, "torchtitan llama3, 2 blocks")


def deepseek_v3_bundle() -> ModelBundle:
    return ModelBundle("deepseek_v3", "tiny", build("deepseek_v3"), make_batch, "torchtitan deepseek_v3")


KINDS = ["llama3", "qwen3", "deepseek_v3", "nanogpt"]
# What the planner writes: a mix of modes per layer, kept units, offload of what is kept.
MIXED = {
    "mode": "selective",
    "keep": ["qkv_proj", "attn_core", "attn_proj"],
    "overrides": [{"layers": "0", "mode": "full"}],
    "offload": {"units": "kept", "layer_input": True, "min_bytes": 0, "skip_last": 0},
}


# ---------------------------------------------------------------------------------------------
# Under torchtitan's own tensor parallelism (tests/dist/titan_tp_worker.py)

TP_ROWS, TP_SEQ = 8, 64  # per data-parallel rank: activations outweigh the weights, as in training


class TitanLoss(nn.Module):
    """The decoder and torchtitan's loss, as its trainer computes it: next-token cross entropy
    (``cross_entropy_loss``: vocabulary-parallel when the logits are split over the pair), over
    this rank's tokens."""

    def __init__(self, decoder: nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from torchtitan.components.loss import cross_entropy_loss

        logits = self.decoder(tokens[:, :-1], positions[:, :-1])
        labels = tokens[:, 1:]
        return cross_entropy_loss(logits, labels, global_vocab_size=VOCAB) / labels.numel()


def tp_batch(seed: int) -> dict[str, torch.Tensor]:
    """TP_ROWS sequences of TP_SEQ + 1 tokens (TP_SEQ in, as many labels): TP_SEQ divides over
    a tensor-parallel pair."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randint(0, VOCAB, (TP_ROWS, TP_SEQ + 1), generator=generator),
        "positions": torch.arange(TP_SEQ + 1).repeat(TP_ROWS, 1),
    }


def planner_config(kind: str) -> dict:
    """What actplan's planner picks for the whole (unsplit) model at ``tp_batch``'s shape,
    made once in the test process and handed to every rank."""
    from planned import half_way_plan

    bundle = ModelBundle(kind, "tiny", TitanLoss(build_decoder(kind)), tp_batch, f"torchtitan {kind}")
    return half_way_plan(bundle, kind)

"""Reference mixture-of-experts decoder, with optional expert parallelism.

Qwen3-MoE / DeepSeek style: the dense model's attention block (grouped-query, or multi-head
latent attention when ``kv_lora_rank`` is set), a top-k router (softmax or sigmoid scores,
auxiliary balance loss), token dispatch sorted by expert, per-expert SwiGLU GEMMs, an
always-on shared expert and a weighted combine; the first ``first_k_dense`` layers are dense.

With a process group of size R > 1 the experts are split across ranks and tokens travel with
``all_to_all_single_autograd`` (gloo on CPU, NCCL on GPU). Routing decisions (top-k, sort,
token counts) and collective outputs are what the selective policy always saves, so a replay
never re-routes or re-communicates. Imports only the marker, vocabulary and dense blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, TypedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from actplan.markers import checkpoint_record
from actplan.models.attention import TPPlan, prefixed
from actplan.models.dense import (
    Attention,
    DecoderLayer,
    DenseConfig,
    MLADecoderLayer,
    MLAttention,
    RMSNorm,
    SeededGenerators,
    copy_whole,
    model_tp_plan,
    preset_config,
    rope_frequencies,
)
from actplan.models.dense import make_batch as make_batch
from actplan.models.experts import ExpertGroup, GroupedExperts, RoutesItsOwnTokens
from actplan.units import MarkerInterval, RecomputeIntervalMap


@dataclass(frozen=True)
class MoEConfig(DenseConfig):
    n_experts: int = 8
    top_k: int = 2
    expert_ffn_dim: int = 512
    shared_expert_ffn_dim: int = 512  # 0: no shared expert
    first_k_dense: int = 1
    router: Literal["softmax", "sigmoid"] = "softmax"
    aux_loss_coef: float = 0.01
    # One rank of an expert-parallel group of this size, run alone (the estimate's layout): it
    # holds n_experts / simulated_ep experts and, routing balanced, receives as many token
    # slots as it sends; the exchange is a copy where the all-to-all would be.
    simulated_ep: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and n_experts ({self.n_experts})")
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"router must be 'softmax' or 'sigmoid', got {self.router!r}")
        if self.simulated_ep < 1 or self.n_experts % self.simulated_ep:
            raise ValueError(
                f"simulated_ep ({self.simulated_ep}) must be 1 or more and divide "
                f"n_experts ({self.n_experts})"
            )
        if not 0 <= self.first_k_dense <= self.n_layers:
            raise ValueError(
                f"first_k_dense ({self.first_k_dense}) must be within 0..n_layers ({self.n_layers})"
            )


PRESETS: dict[str, MoEConfig] = {
    "tiny": MoEConfig(
        vocab_size=128,
        dim=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        max_seq_len=64,
        n_experts=4,
        top_k=2,
        expert_ffn_dim=64,
        shared_expert_ffn_dim=32,
        first_k_dense=1,
        batch_size=2,
        seq_len=16,
    ),
    # About 1.2 s per training step on two CPU cores: for the bench and the planner. The batch
    # is large enough that activations, not weights and AdamW state, dominate the peak without
    # checkpointing, as in LLM training (2048 tokens, 0.9 GiB peak against 0.5 GiB with `full`).
    "small": MoEConfig(
        vocab_size=4096,
        dim=384,
        n_layers=6,
        n_heads=6,
        n_kv_heads=2,
        ffn_dim=1024,
        n_experts=8,
        top_k=2,
        expert_ffn_dim=384,
        shared_expert_ffn_dim=384,
        first_k_dense=1,
        batch_size=8,
        seq_len=256,
    ),
    # Activations dominate more still (see dense's "long"): 2 x 1024 tokens, narrow experts.
    "long": MoEConfig(
        vocab_size=4096,
        dim=256,
        n_layers=6,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=768,
        n_experts=8,
        top_k=2,
        expert_ffn_dim=128,
        shared_expert_ffn_dim=128,
        first_k_dense=1,
        max_seq_len=1024,
        batch_size=2,
        seq_len=1024,
    ),
}


class MoELayerOutput(TypedDict):
    hidden_states: torch.Tensor
    aux_loss: torch.Tensor
    expert_ids: torch.Tensor  # [tokens, top_k] routing decisions, for checks


class MoE(nn.Module):
    """Pre-norm routed experts plus a shared expert; returns the residual stream after them."""

    intervals: ClassVar[dict[str, MarkerInterval | list[MarkerInterval]]] = {
        "mlp_norm": MarkerInterval("mlp_norm", "moe_router"),
        "moe_router": MarkerInterval("moe_router", "moe_dispatch"),
        "moe_dispatch": MarkerInterval("moe_dispatch", "moe_experts"),
        # gate/up GEMMs, then (after the activation) the down GEMMs
        "moe_experts": [MarkerInterval("moe_experts", "moe_act"), MarkerInterval("moe_down", "moe_combine")],
        "moe_act": MarkerInterval("moe_act", "moe_down"),
        "moe_combine": MarkerInterval("moe_combine", "shared_experts"),
        "shared_experts": MarkerInterval("shared_experts", "moe_residual"),
    }

    def __init__(self, config: MoEConfig, ep: ExpertGroup) -> None:
        super().__init__()
        self.config = config
        self.ep = ep
        d = config.dim
        self.mlp_norm = RMSNorm(d, config.norm_eps)
        self.router = nn.Linear(d, config.n_experts, bias=False)
        self.experts = GroupedExperts(config, ep)
        self.shared = None
        if config.shared_expert_ffn_dim:
            s = config.shared_expert_ffn_dim
            self.shared = nn.ModuleDict(
                {
                    "gate_proj": nn.Linear(d, s, bias=False),
                    "up_proj": nn.Linear(d, s, bias=False),
                    "down_proj": nn.Linear(s, d, bias=False),
                }
            )

    def tensor_parallel_plan(self, sequence_parallel: bool) -> TPPlan:
        """Without sequence parallelism: the shared expert split as a dense MLP (gate and up
        colwise, down rowwise and all-reduced); the norm, the router and the routed experts
        replicated (or split over ranks by expert parallelism), so every tensor-parallel rank
        routes the same tokens. With it, as torchtitan runs MoE layers under tensor
        parallelism, each tensor-parallel rank routes its own sequence shard: the norm, the
        router and the shared expert replicated on sequence shards (their gradients summed over
        the tensor-parallel ranks), the routed experts split by expert parallelism only, which
        it needs."""
        if sequence_parallel:
            if self.ep.size == 1:
                raise ValueError(
                    "under sequence parallelism each tensor-parallel rank routes its own tokens, and the "
                    "MoE reference model's routed experts must then be split by expert parallelism "
                    "(build it with an ep_group); or pass sequence_parallel=False"
                )
            own_rows = (SequenceParallel(sequence_dim=0, use_local_output=True),)  # [tokens, dim] rows
            shared = {f"shared.{name}": own_rows for name in ("gate_proj", "up_proj", "down_proj")}
            return {
                "mlp_norm": (SequenceParallel(use_local_output=True),),
                "router": own_rows,
                "experts": (RoutesItsOwnTokens(),),
                **(shared if self.shared is not None else {}),
            }
        if self.shared is None:
            return {}
        return {
            "shared.gate_proj": (ColwiseParallel(),),
            "shared.up_proj": (ColwiseParallel(),),
            "shared.down_proj": (RowwiseParallel(output_layouts=Replicate()),),
        }

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k expert ids and weights per token, tokens per expert, and the balance loss."""
        cfg = self.config
        logits = self.router(x).float()
        scores = logits.softmax(-1) if cfg.router == "softmax" else logits.sigmoid()
        weights, expert_ids = scores.topk(cfg.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        # Switch-style balance loss: experts' share of routed tokens times mean score.
        tokens_per_expert = torch.bincount(expert_ids.flatten(), minlength=cfg.n_experts)
        share = tokens_per_expert.float() / expert_ids.numel()
        aux_loss = cfg.n_experts * (share * scores.mean(0)).sum()
        return expert_ids, weights.type_as(x), tokens_per_expert, aux_loss

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        batch, seq, dim = hidden_states.shape
        checkpoint_record("mlp_norm")
        x = self.mlp_norm(hidden_states).reshape(batch * seq, dim)
        checkpoint_record("moe_router")
        expert_ids, weights, counts, aux_loss = self.route(x)
        # Under sequence parallelism each rank's balance loss is its shard's, and the router's
        # gradient is summed over the shards: the mean over them is the loss trained on.
        if self.experts.token_shards > 1:
            aux_loss = aux_loss / self.experts.token_shards

        checkpoint_record("moe_dispatch")
        flat_ids = expert_ids.flatten()
        order = flat_ids.argsort(stable=True)  # token slots grouped by expert
        token_of_slot = order // cfg.top_k
        rows, local_counts, exchange = self._dispatch(x[token_of_slot], counts)
        outs = self.experts(rows, local_counts)

        checkpoint_record("moe_combine")
        expert_out = self._return(torch.cat(outs), exchange)
        slot_weights = weights.flatten()[order].unsqueeze(-1)
        combined = torch.zeros_like(x).index_add(0, token_of_slot, expert_out * slot_weights)

        checkpoint_record("shared_experts")
        if self.shared is not None:
            s = self.shared
            combined = combined + s["down_proj"](F.silu(s["gate_proj"](x)) * s["up_proj"](x))
        checkpoint_record("moe_residual")
        return hidden_states + combined.view(batch, seq, dim), aux_loss, expert_ids

    # -- expert parallelism -------------------------------------------------------------

    def _dispatch(self, rows: torch.Tensor, counts: torch.Tensor):
        """Send each row to the rank holding its expert; returns rows grouped by local expert."""
        ep = self.ep
        if ep.size == 1:
            return rows, counts.tolist(), None
        if ep.group is None:  # simulated: balanced routing sends and receives as many slots
            share, extra = divmod(rows.shape[0], ep.n_local)
            local = [share + (e < extra) for e in range(ep.n_local)]
            return rows.clone(), local, "simulated"
        from torch.distributed import _functional_collectives as fc

        send = counts.view(ep.size, ep.n_local)  # [destination rank, its local expert]
        received = fc.all_to_all_single(send.flatten(), None, None, ep.group)
        received = fc.wait_tensor(received).view(ep.size, ep.n_local)  # [source rank, my expert]
        input_splits = send.sum(1).tolist()
        output_splits = received.sum(1).tolist()
        arrived = fc.all_to_all_single_autograd(rows, output_splits, input_splits, ep.group)
        arrived = fc.wait_tensor(arrived)
        # Arrived rows are ordered (source rank, expert); the GEMMs want (expert, source rank):
        # a stable sort of each row's (expert, source) key, whatever the number of ranks.
        flat = received.flatten()
        slots = torch.arange(flat.numel(), device=flat.device)
        segment = torch.repeat_interleave(slots, flat, output_size=sum(output_splits))
        by_expert = ((segment % ep.n_local) * ep.size + segment // ep.n_local).argsort(stable=True)
        return arrived[by_expert], received.sum(0).tolist(), (by_expert, input_splits, output_splits)

    def _return(self, expert_out: torch.Tensor, exchange) -> torch.Tensor:
        """Send expert outputs back to the ranks their tokens came from."""
        if exchange is None:
            return expert_out
        if exchange == "simulated":
            return expert_out.clone()
        from torch.distributed import _functional_collectives as fc

        by_expert, input_splits, output_splits = exchange
        arrival_order = torch.zeros_like(expert_out).index_copy(0, by_expert, expert_out)
        back = fc.all_to_all_single_autograd(arrival_order, input_splits, output_splits, self.ep.group)
        return fc.wait_tensor(back)


class MoEDecoderLayer(nn.Module):
    """Attention then routed experts, returning a TypedDict with the aux loss and routing."""

    recompute_intervals: ClassVar[RecomputeIntervalMap] = RecomputeIntervalMap(
        {**Attention.intervals, **MoE.intervals}
    )
    attention_class: ClassVar[type[nn.Module]] = Attention

    def __init__(self, config: MoEConfig, experts: ExpertGroup) -> None:
        super().__init__()
        self.attn = self.attention_class(config)
        self.moe = MoE(config, experts)

    def tensor_parallel_plan(self, sequence_parallel: bool) -> TPPlan:
        return {
            **prefixed("attn.", self.attn.tensor_parallel_plan(sequence_parallel)),
            **prefixed("moe.", self.moe.tensor_parallel_plan(sequence_parallel)),
        }

    def forward(self, hidden_states: torch.Tensor, *, freqs_cis: torch.Tensor) -> MoELayerOutput:
        hidden_states, aux_loss, expert_ids = self.moe(self.attn(hidden_states, freqs_cis))
        return {"hidden_states": hidden_states, "aux_loss": aux_loss, "expert_ids": expert_ids}


class MLAMoEDecoderLayer(MoEDecoderLayer):
    """Multi-head latent attention then routed experts (DeepSeek-V2/V3's MoE layers)."""

    recompute_intervals: ClassVar[RecomputeIntervalMap] = RecomputeIntervalMap(
        {**MLAttention.intervals, **MoE.intervals}
    )
    attention_class: ClassVar[type[nn.Module]] = MLAttention


class MoEOutput(TypedDict):
    loss: torch.Tensor | None
    lm_loss: torch.Tensor | None
    aux_loss: torch.Tensor
    logits: torch.Tensor
    expert_ids: list[torch.Tensor]


class MoEModel(nn.Module):
    def __init__(self, config: MoEConfig, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.expert_group = ExpertGroup(config.n_experts, ep_group, config.simulated_ep)
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        dense_layer, moe_layer = (
            (MLADecoderLayer, MLAMoEDecoderLayer) if config.mla else (DecoderLayer, MoEDecoderLayer)
        )
        self.layers = nn.ModuleList(
            dense_layer(config) if i < config.first_k_dense else moe_layer(config, self.expert_group)
            for i in range(config.n_layers)
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer(
            "freqs_cis",
            rope_frequencies(config.rope_dim, config.max_seq_len, config.rope_theta),
            persistent=False,
        )
        self.reset_parameters()

    def reset_parameters(self, seed: int = 0) -> None:
        """Seeded init; an expert gets the same weights whichever rank holds it."""
        generator = SeededGenerators(seed)
        ep = self.expert_group
        std_out = 0.02 / math.sqrt(2 * self.config.n_layers)
        with torch.no_grad():
            for name, param in self.named_parameters():
                std = std_out if name.endswith(("o_proj.weight", "down_proj.weight", "w_down")) else 0.02
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(("w_gate", "w_up", "w_down")):
                    # Draw every expert, keep this rank's slice (its FSDP shard of it, if sharded).
                    full = torch.empty(self.config.n_experts, *param.shape[1:], device=param.device)
                    full.normal_(0.0, std, generator=generator(param.device))
                    copy_whole(param, full[ep.first : ep.first + ep.n_local])
                else:
                    param.normal_(0.0, std, generator=generator(param.device))

    def tensor_parallel_plan(self, tp: int, sequence_parallel: bool | None = None) -> TPPlan:
        """As the dense model's, with ``MoE.tensor_parallel_plan`` for the MoE blocks; without
        sequence parallelism by default (``sequence_parallel=True`` needs the routed experts
        split by expert parallelism)."""
        sizes = {"shared_expert_ffn_dim": shared} if (shared := self.config.shared_expert_ffn_dim) else {}
        return model_tp_plan(self, tp, bool(sequence_parallel), sizes)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> MoEOutput:
        seq = input_ids.shape[1]
        hidden_states = self.embed(input_ids)
        freqs_cis = self.freqs_cis[:seq]
        aux_loss = hidden_states.new_zeros((), dtype=torch.float32)
        expert_ids = []
        for layer in self.layers:
            out = layer(hidden_states, freqs_cis=freqs_cis)
            hidden_states = out["hidden_states"]
            if "aux_loss" in out:
                aux_loss = aux_loss + out["aux_loss"]
                expert_ids.append(out["expert_ids"])
        logits = self.lm_head(self.norm(hidden_states))
        lm_loss = loss = None
        if labels is not None:
            lm_loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            whole = lm_loss.to_local() if isinstance(lm_loss, DTensor) else lm_loss  # loss parallel
            loss = whole + self.config.aux_loss_coef * aux_loss
        return {
            "loss": loss,
            "lm_loss": lm_loss,
            "aux_loss": aux_loss,
            "logits": logits,
            "expert_ids": expert_ids,
        }


def build(
    size: str = "small", ep_group: dist.ProcessGroup | None = None, **overrides
) -> tuple[MoEModel, MoEConfig]:
    """The MoE reference model of a named size; ``ep_group`` splits its experts across ranks."""
    config = preset_config("moe", PRESETS, size, overrides)
    return MoEModel(config, ep_group), config

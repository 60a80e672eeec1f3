"""The routed experts of the MoE reference model: which experts a rank holds
(``ExpertGroup``), their stacked SwiGLU weights (``GroupedExperts``), and the mark a
tensor-parallel plan puts on them when every tensor-parallel rank routes tokens of its own
(``RoutesItsOwnTokens``). Imports only torch and the marker.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from actplan.markers import checkpoint_record


class ExpertSizes(Protocol):
    """What ``GroupedExperts`` reads of a config (``MoEConfig`` has both)."""

    dim: int
    expert_ffn_dim: int


__all__ = ["ExpertGroup", "GroupedExperts", "RoutesItsOwnTokens"]


class ExpertGroup:
    """Which experts this rank holds, and the process group that shares them out."""

    def __init__(self, n_experts: int, group: dist.ProcessGroup | None = None, simulated: int = 1) -> None:
        self.group = group
        # Without a group, `simulated` > 1 is rank 0 of a group that size, run alone.
        self.size = dist.get_world_size(group) if group is not None else simulated
        self.rank = dist.get_rank(group) if group is not None else 0
        if n_experts % self.size:
            raise ValueError(
                f"{n_experts} experts cannot be split evenly over an expert-parallel group of "
                f"{self.size}; choose n_experts divisible by the group size"
            )
        self.n_local = n_experts // self.size
        self.first = self.rank * self.n_local

    def __deepcopy__(self, memo: dict) -> ExpertGroup:
        # A process group cannot be copied; copies of a model share its expert layout.
        return self


class GroupedExperts(nn.Module):
    """This rank's experts: SwiGLU weights stacked as [local experts, in, out].

    ``expert_parallel_group`` tells ``actplan.parallelize`` that these weights are split across
    ranks (each holds different experts), so they must not be averaged with the other ranks'
    like replicated ones. Left out of FSDP, its mixed precision does not cast them either:
    ``compute_dtype`` (``parallelize`` sets it from ``mp_policy``) casts them for each forward.
    ``token_shards`` is how many tensor-parallel ranks split each sequence's tokens between
    them when routing: set by a plan under which each routes its own sequence shard
    (``RoutesItsOwnTokens``); 1 otherwise, where every tensor-parallel rank sends the same
    tokens and the gradients count each token once per rank."""

    def __init__(self, config: ExpertSizes, ep: ExpertGroup) -> None:
        super().__init__()
        d, f, n = config.dim, config.expert_ffn_dim, ep.n_local
        self.ep = ep
        self.compute_dtype: torch.dtype | None = None
        self.token_shards = 1
        self.w_gate = nn.Parameter(torch.empty(n, d, f))
        self.w_up = nn.Parameter(torch.empty(n, d, f))
        self.w_down = nn.Parameter(torch.empty(n, f, d))

    @property
    def expert_parallel_group(self) -> dist.ProcessGroup | None:
        return self.ep.group if self.ep.size > 1 else None

    def forward(self, rows: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        """Each expert's output rows, in expert order."""
        chunks = rows.split(counts)
        checkpoint_record("moe_experts")
        dtype = self.compute_dtype or self.w_gate.dtype  # `.to` of the same dtype is no op
        w_gate, w_up = self.w_gate.to(dtype), self.w_up.to(dtype)
        gates = [chunk @ w_gate[e] for e, chunk in enumerate(chunks)]
        ups = [chunk @ w_up[e] for e, chunk in enumerate(chunks)]
        checkpoint_record("moe_act")
        acts = [F.silu(g) * u for g, u in zip(gates, ups, strict=True)]
        checkpoint_record("moe_down")
        w_down = self.w_down.to(dtype)
        return [a @ w_down[e] for e, a in enumerate(acts)]


class RoutesItsOwnTokens(ParallelStyle):
    """Marks a ``GroupedExperts`` as fed by a block under sequence parallelism: each of the
    mesh's tensor-parallel ranks routes the tokens of its own sequence shard
    (``token_shards``), so the experts' gradients hold each token once, and
    ``actplan.parallelize`` averages them over the data-parallel ranks alone; the block scales
    its balance loss by it. Changes no parameter and no input."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, GroupedExperts):
            raise TypeError(f"RoutesItsOwnTokens marks a GroupedExperts, got {type(module).__name__}")
        module.token_shards = device_mesh.size()
        return module

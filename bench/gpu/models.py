"""The model sizes the GPU benchmarks use, and building a reference model on its device in its dtype.

Shared by ``bench.gpu.suite`` and ``bench.gpu.offload``. ``gpu`` sizes fill an H200-class
device with a Llama-7B-shaped layer stack (hidden size 4096, sequence 4096, bf16); ``tiny``
sizes rehearse the same code on a CPU in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from actplan.models import ModelBundle, build_model

GPU_DENSE: dict[str, Any] = dict(
    dim=4096, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=11008, vocab_size=32000,
    max_seq_len=4096, seq_len=4096, batch_size=1,
)  # fmt: skip
"""8 Llama-7B layers at 4096 tokens: 1.7 B parameters, about 1 GiB of activations per layer in bf16."""

GPU_MOE: dict[str, Any] = dict(
    dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, ffn_dim=11008, n_experts=8, top_k=2,
    expert_ffn_dim=2048, shared_expert_ffn_dim=2048, first_k_dense=1, vocab_size=32000,
    max_seq_len=4096, seq_len=4096, batch_size=1,
)  # fmt: skip
"""One dense and three MoE layers (8 experts, top-2, a shared expert): 1.3 B parameters."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ModelSpec:
    """A reference model by name, preset size and config overrides, in one dtype."""

    name: str
    preset: str
    dtype: str = "fp32"
    overrides: dict[str, Any] = field(default_factory=dict)

    def build(self, device: torch.device) -> ModelBundle:
        """Build the model straight on ``device`` (its init draws there) and cast it to the dtype."""
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPES)}")
        with torch.device(device):
            bundle = build_model(self.name, self.preset, **self.overrides)
        cast_floating(bundle.model, DTYPES[self.dtype])
        return bundle


SCALES: dict[str, dict[str, ModelSpec]] = {
    "gpu": {
        "dense": ModelSpec("dense", "small", "bf16", GPU_DENSE),
        "moe": ModelSpec("moe", "small", "bf16", GPU_MOE),
    },
    # The same code on a CPU in seconds; bf16 so the cast and tolerance paths run too.
    "tiny": {
        "dense": ModelSpec("dense", "tiny", "bf16"),
        "moe": ModelSpec("moe", "tiny", "bf16"),
    },
}


def cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters and floating-point buffers to ``dtype``; complex buffers (the RoPE table)
    stay as they are, where ``model.to(dtype)`` would drop their imaginary part."""
    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                param.data = param.data.to(dtype)
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer.is_floating_point():
                    setattr(module, name, buffer.to(dtype))


def batch_on(bundle: ModelBundle, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """One training batch of ``bundle`` on ``device``."""
    return bundle.batch(seed, device)

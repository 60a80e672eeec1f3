"""torchtitan models, as they are: blocks found by class, units derived from module names.

torchtitan 0.3 builds every language model from ``TransformerBlock`` subclasses in
``model.layers`` (llama3, qwen3, deepseek_v3, gpt_oss, ...), with the same submodule names
throughout: ``attention_norm``, ``attention.qkv_linear.wqkv`` (or ``wq``/``wk``/``wv``), MLA's
``attention.wq_a``/``wkv_a``/``wkv_b``, ``attention.rope``, ``attention.wo``, ``ffn_norm``,
``feed_forward.w1``/``w3``/``w2``, ``moe.router``, ``moe.routed_experts.inner_experts``,
``moe.shared_experts``. ``SOURCE`` (a ``blocks.BlockSource``) finds the blocks by class
(``TransformerBlock`` in their MRO, told by name: torchtitan is never imported here) and
derives their layouts with ``hf_derive``.

Plugging actplan in where torchtitan applies activation checkpointing (``actplan.apply``,
``ActplanAC``) installs a plan, so it lives a layer up, in ``actplan._install._torchtitan_ac``.
Imports ``units``, ``blocks`` and ``hf`` (``interval_map_for``).
"""

from __future__ import annotations

from torch import nn

from actplan.integrations.blocks import BlockSource, attention_blocks, classes_from, layout_of
from actplan.integrations.hf import interval_map_for
from actplan.units import RecomputeIntervalMap

_TORCHTITAN = ("torchtitan.",)


def is_torchtitan_block(module: nn.Module) -> bool:
    """A torchtitan ``TransformerBlock`` (any model's subclass of it)."""
    return any(
        cls.__name__ == "TransformerBlock" and cls.__module__.startswith("torchtitan.")
        for cls in type(module).__mro__
    )


class _Torchtitan(BlockSource):
    """The ``LayerSource`` for torchtitan models (see ``actplan.integrations``)."""

    name = "torchtitan"
    framework = "torchtitan"
    apply_example = "actplan.apply(model, config, layouts="
    doc = 'docs/torchtitan.md, "When a layout cannot be derived"'

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The outermost ``TransformerBlock``s in model order; for a model built without them,
        the members of its first ``ModuleList``/``ModuleDict`` of attention blocks."""
        found: list[tuple[str, nn.Module]] = []
        for name, module in model.named_modules():
            if is_torchtitan_block(module) and not any(name.startswith(f"{outer}.") for outer, _ in found):
                found.append((name, module))
        return found or attention_blocks(model)

    def recognises(self, model: nn.Module) -> bool:
        return any(classes_from(m, _TORCHTITAN) for m in model.modules())

    def interval_map(self, module: nn.Module) -> RecomputeIntervalMap | None:
        if not is_torchtitan_block(module):
            return None
        source, layout, _ = layout_of(module, None)
        return interval_map_for(module, layout) if source == "derived" else None

    def wrapped_fix(self) -> str:
        return (
            "turn torchtitan's activation checkpointing off where actplan's is on: in the config "
            "function set activation_checkpoint=ActplanAC.Config(plan=...) (from "
            "actplan) instead of FullAC/SelectiveAC, or "
            "activation_checkpoint=None and call actplan.apply(model, plan) where "
            "torchtitan applies it (after tensor parallelism, before torch.compile and FSDP)"
        )


SOURCE = _Torchtitan()
"""Registered by ``actplan.integrations`` on first use."""

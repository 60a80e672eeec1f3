"""torchtitan models, as they are: blocks found by class, units derived from module names.

torchtitan 0.3 builds every language model from ``TransformerBlock`` subclasses in
``model.layers`` (llama3, qwen3, deepseek_v3, gpt_oss, ...), with the same submodule names
throughout: ``attention_norm``, ``attention.qkv_linear.wqkv`` (or ``wq``/``wk``/``wv``), MLA's
``attention.wq_a``/``wkv_a``/``wkv_b``, ``attention.rope``, ``attention.wo``, ``ffn_norm``,
``feed_forward.w1``/``w3``/``w2``, ``moe.router``, ``moe.routed_experts.inner_experts``,
``moe.shared_experts``. ``SOURCE`` (a ``blocks.BlockSource``) finds the blocks by class
(``TransformerBlock`` in their MRO, told by name: torchtitan is never imported here) and
derives their layouts with ``hf_derive``.

Where torchtitan applies activation checkpointing (after tensor parallelism, before
``torch.compile`` and FSDP), call ``apply_to_torchtitan(model, config)``, or set the trainer's
``activation_checkpoint`` to ``ActplanAC.Config(plan=...)``: ``ActplanAC`` is a member of
torchtitan's ``ActivationCheckpointing`` family, so this module hands it out lazily (it
imports torchtitan; ``import actplan`` never does). Imports ``units``, ``blocks`` and ``hf``
(``interval_map_for``); ``_torchtitan_ac`` on first use of ``ActplanAC``.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from actplan.integrations.blocks import BlockSource, Layouts, attention_blocks, classes_from, layout_of
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
    apply_example = "apply_to_torchtitan(model, config, layouts="
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
            "actplan.integrations.torchtitan) instead of FullAC/SelectiveAC, or "
            "activation_checkpoint=None and call apply_to_torchtitan(model, plan) where "
            "torchtitan applies it (after tensor parallelism, before torch.compile and FSDP)"
        )


SOURCE = _Torchtitan()
"""Registered by ``actplan.integrations`` on first use."""


def apply_to_torchtitan(
    model: nn.Module,
    config: Any = "matmuls",
    *,
    layouts: Layouts | None = None,
) -> Any:
    """Install an actplan plan on a torchtitan model's blocks; returns the ``actplan.Plan``.

    ``config``: a preset name (``"matmuls"``), a path to a YAML/JSON plan (``actplan plan``
    writes one), a ``RecomputeConfig`` or its dict. ``layouts``: units by block class name, for
    blocks whose layout cannot be derived (``None`` leaves a class alone). Call it where
    torchtitan's ``parallelize_*`` applies activation checkpointing: after tensor parallelism,
    before ``torch.compile`` and FSDP (``ActplanAC`` does exactly that). Raises ``ConfigError``
    for blocks torchtitan already wrapped with its own checkpointing and for a layout it
    cannot derive."""
    # The public face, looked up when called: this plug-in calls actplan as a training script
    # does, from above the installer that integrations sit below (docs/architecture.md).
    return importlib.import_module("actplan").apply(model, config, layouts=layouts)


def __getattr__(name: str) -> Any:
    # ``ActplanAC`` subclasses torchtitan's ActivationCheckpointing: imported on first use only.
    if name == "ActplanAC":
        return importlib.import_module("actplan.integrations._torchtitan_ac").ActplanAC
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""``ActplanAC``: actplan as a member of torchtitan's activation-checkpointing family.

torchtitan selects its checkpointing with the trainer config's ``activation_checkpoint``
(``FullAC.Config()``, ``SelectiveAC.Config()``, ...), and each model's ``parallelize_*``
calls ``config.build(dump_folder=...).apply(model)`` after tensor parallelism and before
``torch.compile`` and FSDP. ``ActplanAC.Config(plan=...)`` goes in the same place; its
``apply`` installs the plan with ``actplan.apply``. The dict-valued fields are left
off torchtitan's command line (tyro cannot parse them); ``plan`` is on it. This module
imports torchtitan: the public ``actplan.torchtitan`` re-exports ``ActplanAC`` (``import
actplan`` never imports torchtitan).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Annotated, Any

import tyro
from torch import nn
from torchtitan.distributed import activation_checkpoint as torchtitan_ac

from actplan._install.apply import apply
from actplan.config import ConfigError

logger = logging.getLogger("actplan")


class ActplanAC(torchtitan_ac.ActivationCheckpointing):
    """Keep, recompute or offload each block's activations by named unit, as an actplan
    plan says, with gradients bit-identical to no checkpointing. In a config function::

        config.activation_checkpoint = ActplanAC.Config(plan="matmuls")

    The plan covers every block at once (its overrides select blocks by index), so ``apply``
    plans the model rather than wrapping blocks one by one."""

    @dataclass(kw_only=True, slots=True)
    class Config(torchtitan_ac.ActivationCheckpointing.Config):
        plan: str = "matmuls"
        """A preset (``none``, ``full``, ``attn``, ``matmuls``, ``megatron-selective``) or the
        path of a YAML or JSON plan (``actplan plan`` writes one)."""

        recompute_config: Annotated[dict[str, Any] | None, tyro.conf.Suppress] = None
        """A ``RecomputeConfig`` as a dict, written in the config function: the plan instead of
        ``plan`` (leave ``plan`` at its default then). Not a command-line option."""

        layouts: Annotated[dict[str, Any] | None, tyro.conf.Suppress] = None
        """Units by block class name, for blocks whose layout cannot be derived from their
        module names (``None`` for a class not to checkpoint); see docs/torchtitan.md."""

    def __init__(self, config: ActplanAC.Config, dump_folder: str = "") -> None:
        super().__init__(config, dump_folder)
        # torchtitan's replay settings: actplan always restores the RNG state and checks
        # the replay itself, so other values would be silently ignored.
        default = ActplanAC.Config()
        changed = [
            f.name
            for f in fields(torchtitan_ac.ActivationCheckpointing.Config)
            if getattr(config, f.name) != getattr(default, f.name)
        ]
        if config.recompute_config is not None and config.plan != default.plan:
            raise ConfigError(
                f"ActplanAC.Config: both plan={config.plan!r} and recompute_config are set; give "
                "one: a preset name or plan file in plan, or the config dict in recompute_config"
            )
        if changed:
            raise ConfigError(
                f"ActplanAC.Config: {', '.join(changed)} set, and actplan has no such setting (it "
                "always restores the RNG state before a replay and checks the replay op by op); "
                "leave them at their defaults"
            )

    def _wrap_block(self, module: nn.Module, *, base_fqn: str | None = None) -> nn.Module:
        raise NotImplementedError("ActplanAC plans every block at once: call apply(model)")

    def apply(self, model: nn.Module) -> None:
        # As torchtitan's own AC does before wrapping (a workaround for selective
        # checkpointing under compile with several pipeline microbatches).
        disable_cache = getattr(torchtitan_ac, "_disable_dynamo_lru_cache", None)
        if disable_cache is not None:
            disable_cache()
        config = self.config
        plan = apply(
            model,
            config.recompute_config if config.recompute_config is not None else config.plan,
            layouts=config.layouts,
        )
        logger.info("Applied actplan activation checkpointing to the model:\n%s", plan.summary())

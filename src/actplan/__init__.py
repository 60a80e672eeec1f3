"""actplan: decide, for every activation a transformer saves, keep, recompute or offload, and do it exactly.

The public API. Model authors use ``checkpoint_record`` and the vocabulary;
training code uses ``RecomputeConfig``, ``apply``, ``remove`` and ``offload_engine``.
"""

from actplan._engine.boundary import (
    apply_gradient_checkpointing,
    is_checkpointed,
    remove_gradient_checkpointing,
)
from actplan._engine.offload import OffloadedTensorMutatedError, OffloadEngine, OffloadStats
from actplan._engine.policy import IntervalPolicy, KeptTensorMutatedError, MarkerError
from actplan._install.apply import (
    apply,
    find_layers,
    held_by_layer,
    held_by_unit,
    installed_plan,
    offload_engine,
    plan_for,
    remove,
)
from actplan._install.parallel import parallelize
from actplan._install.plan import LayerPlan, Plan
from actplan._install.torchtitan import apply_to_torchtitan
from actplan._torch_internals import TorchInternalsError
from actplan.config import PRESETS, ConfigError, LayerSelector, OffloadConfig, RecomputeConfig
from actplan.markers import checkpoint_record
from actplan.units import UNIT_DESCRIPTIONS, MarkerInterval, RecomputeIntervalMap, RecomputeUnit

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "UNIT_DESCRIPTIONS",
    "ActplanAC",
    "ConfigError",
    "IntervalPolicy",
    "KeptTensorMutatedError",
    "LayerPlan",
    "LayerSelector",
    "MarkerError",
    "MarkerInterval",
    "OffloadConfig",
    "OffloadEngine",
    "OffloadStats",
    "OffloadedTensorMutatedError",
    "Plan",
    "RecomputeConfig",
    "RecomputeIntervalMap",
    "RecomputeUnit",
    "TorchInternalsError",
    "apply",
    "apply_gradient_checkpointing",
    "apply_to_torchtitan",
    "checkpoint_record",
    "find_layers",
    "held_by_layer",
    "held_by_unit",
    "installed_plan",
    "is_checkpointed",
    "offload_engine",
    "parallelize",
    "plan_for",
    "remove",
    "remove_gradient_checkpointing",
]


def __getattr__(name: str):
    # ``ActplanAC`` subclasses torchtitan's ActivationCheckpointing: torchtitan is imported only
    # when it is asked for.
    if name == "ActplanAC":
        from actplan._install.torchtitan import ActplanAC

        return ActplanAC
    raise AttributeError(f"module 'actplan' has no attribute {name!r}")

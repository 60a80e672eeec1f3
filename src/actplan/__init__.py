"""actplan: decide, for every activation a transformer saves, keep, recompute or offload, and do it exactly.

The public API, small on purpose. Training code: ``apply(model, config)`` installs a plan and
returns it (``Plan``: per layer what is kept, recomputed or offloaded; the installed plan also
reports what its layers hold, ``plan.held_by_unit()``, and its ``plan.offload_engine``),
``remove(model)`` undoes it, ``plan_for`` resolves without installing, ``parallelize`` applies
tensor parallelism, the plan and FSDP2 in the order they must go. Configs: ``RecomputeConfig``
and the ``PRESETS`` (more in ``actplan.config``). Model authors: ``checkpoint_record`` markers
and the vocabulary that names the activations between them (``RecomputeUnit``,
``MarkerInterval``, ``RecomputeIntervalMap``); ``apply_gradient_checkpointing`` wraps one
module by hand. The engine's own pieces (``IntervalPolicy``, ``OffloadEngine``, ...) are in
``actplan.lowlevel``; torchtitan's plug-in, ``ActplanAC``, in ``actplan.torchtitan``. A name
that moved raises an ``AttributeError`` naming its place.
"""

from actplan import lowlevel as lowlevel  # actplan.lowlevel after `import actplan`
from actplan._engine.boundary import apply_gradient_checkpointing
from actplan._engine.offload import OffloadedTensorMutatedError
from actplan._engine.policy import KeptTensorMutatedError, MarkerError
from actplan._install.apply import apply, plan_for, remove
from actplan._install.parallel import parallelize
from actplan._install.plan import Plan
from actplan._torch_internals import TorchInternalsError
from actplan.config import PRESETS, ConfigError, RecomputeConfig
from actplan.markers import checkpoint_record
from actplan.units import MarkerInterval, RecomputeIntervalMap, RecomputeUnit

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "ConfigError",
    "KeptTensorMutatedError",
    "MarkerError",
    "MarkerInterval",
    "OffloadedTensorMutatedError",
    "Plan",
    "RecomputeConfig",
    "RecomputeIntervalMap",
    "RecomputeUnit",
    "TorchInternalsError",
    "apply",
    "apply_gradient_checkpointing",
    "checkpoint_record",
    "parallelize",
    "plan_for",
    "remove",
]

_MOVED = {
    **dict.fromkeys(
        ("IntervalPolicy", "OffloadEngine", "OffloadStats", "LayerPlan", "find_layers", "is_checkpointed",
         "installed_plan", "UNIT_DESCRIPTIONS"),
        "actplan.lowlevel.{name}",
    ),
    "LayerSelector": "actplan.config.LayerSelector",
    "OffloadConfig": "actplan.config.OffloadConfig",
    "ActplanAC": "actplan.torchtitan.ActplanAC",
    "apply_to_torchtitan": "actplan.apply(model, config, layouts=...), the same call",
    "remove_gradient_checkpointing": "actplan.remove(module), which returns how many layers it unwrapped",
    "held_by_layer": "plan.held_by_layer(), on the plan actplan.apply returns",
    "held_by_unit": "plan.held_by_unit(), on the plan actplan.apply returns",
    "offload_engine": "plan.offload_engine, on the plan actplan.apply returns",
}  # fmt: skip


def __getattr__(name: str):
    where = _MOVED.get(name)
    if where is not None:
        raise AttributeError(f"actplan.{name} has moved: use {where.format(name=name)}")
    raise AttributeError(f"module 'actplan' has no attribute {name!r}")

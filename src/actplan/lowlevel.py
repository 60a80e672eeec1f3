"""The engine's own pieces, for code that builds on actplan rather than configuring it.

``IntervalPolicy``: the marker-driven selective policy one checkpointed layer runs (give it
to ``actplan.apply_gradient_checkpointing(module, policy=...)`` to wrap a module by hand).
``OffloadEngine`` and its ``OffloadStats``: the host tier an offloading plan moves saved
tensors through. ``find_layers``: the layers ``actplan.apply`` would plan, in order;
``LayerPlan``: one layer's resolved choice in a ``Plan``; ``installed_plan(model)``: the plan
installed on a model now; ``is_checkpointed(module)``: whether a checkpoint wrapper is on it.
``UNIT_DESCRIPTIONS``: what each ``RecomputeUnit`` stands for. ``tensor_parallelize`` and
``tensor_parallel_plan``: the tensor-parallel step ``actplan.parallelize`` takes first, for
code that writes the steps itself.
"""

from actplan._engine.boundary import is_checkpointed
from actplan._engine.offload import OffloadEngine, OffloadStats
from actplan._engine.policy import IntervalPolicy
from actplan._install.apply import find_layers, installed_plan
from actplan._install.plan import LayerPlan
from actplan._install.tensor_parallel import tensor_parallel_plan, tensor_parallelize
from actplan.units import UNIT_DESCRIPTIONS

__all__ = [
    "UNIT_DESCRIPTIONS",
    "IntervalPolicy",
    "LayerPlan",
    "OffloadEngine",
    "OffloadStats",
    "find_layers",
    "installed_plan",
    "is_checkpointed",
    "tensor_parallel_plan",
    "tensor_parallelize",
]

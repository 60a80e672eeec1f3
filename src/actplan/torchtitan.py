"""actplan in torchtitan: ``ActplanAC``, a member of torchtitan's activation-checkpointing
family. Set ``activation_checkpoint=ActplanAC.Config(plan="matmuls")`` (a preset, a plan file
``actplan plan`` or ``actplan estimate --out`` wrote, or ``recompute_config=`` a config dict) in
a trainer config function; torchtitan's ``parallelize_*`` then installs the plan where it
applies checkpointing, after tensor parallelism and before ``torch.compile`` and FSDP. Outside
a config function, ``actplan.apply(model, plan)`` at that same place does the same.

Importing this module imports torchtitan (and tyro, which its configs use).
"""

from actplan._install._torchtitan_ac import ActplanAC

__all__ = ["ActplanAC"]
